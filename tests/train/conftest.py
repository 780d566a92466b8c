import pytest


@pytest.fixture(scope="session")
def tiny_dir(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=0)
