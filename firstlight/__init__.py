"""firstlight: bring large language models up on new hardware."""

__version__ = "0.1.0"
