import pytest


@pytest.fixture(scope="session")
def tiny_dir(tiny_checkpoint):
    return tiny_checkpoint("llama", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from firstlight.models.loader import load_model

    model, tok = load_model(tiny_dir)
    return model.eval(), tok
