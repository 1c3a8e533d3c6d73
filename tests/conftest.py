"""Fixtures shared by the test modules."""
import pytest

from llamax import models
from llamax.model import Model


@pytest.fixture(scope="session")
def model():
    """SmolLM2-135M from the registry (fetched into $LLAMAX_CACHE on first use), loaded once per run."""
    return Model.load("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M GGUF in the registry cache (pulled on first use)."""
    return models.path("smollm2-135m")


@pytest.fixture(scope="session")
def gemma():
    """Gemma 3 270M from the registry (fetched into $LLAMAX_CACHE on first use), loaded once per run."""
    return Model.load("gemma3-270m")
