"""memplan.models.batches: the image size a batch gets where the user gives none."""

from types import SimpleNamespace

import pytest

from memplan.models.batches import DEFAULT_IMAGE_SIZE, resolve_lengths
from memplan.settings import TrainingSettings


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SimpleNamespace(image_size=64), 64),
        # CLIP's and SigLIP's configs keep it in their vision tower's: memplan had taken 224 and then refused it
        # with "give --image-size 32 or leave it out", where it was left out (a helper's bug hunt)
        (SimpleNamespace(vision_config=SimpleNamespace(image_size=32)), 32),
        (SimpleNamespace(image_size=[48, 48]), 48),
        (SimpleNamespace(), DEFAULT_IMAGE_SIZE),
    ],
)
def test_an_image_models_batch_takes_the_size_its_config_names(config, expected):
    settings = resolve_lengths(config, "image-classification", TrainingSettings(batch_size=2))
    assert settings.image_size == expected
    given = resolve_lengths(config, "image-classification", TrainingSettings(batch_size=2, image_size=96))
    assert given.image_size == 96
