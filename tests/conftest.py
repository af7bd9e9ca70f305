import pytest

from tests.zoo import TINY_HF_CONFIGS, write_tiny_config


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Tiny transformers configs written as model directories (the config.json model source)."""
    folder = tmp_path_factory.mktemp("tiny-models")
    return {name: write_tiny_config(name, folder) for name in TINY_HF_CONFIGS}
