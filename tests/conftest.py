"""Fixtures shared by the test modules."""
import pytest

from llamax import models
from llamax._native import cpu
from llamax.model import Model


@pytest.fixture(params=cpu.levels(), ids=lambda lv: cpu.LEVEL_NAMES[lv])
def every_simd_level(request):
    """Runs a test once per SIMD level this CPU has (the cap of csrc/cpu.h on every kernel), so that
    each fast path is held against its scalar reference; a module opts in with
    `pytestmark = pytest.mark.usefixtures("every_simd_level")`."""
    cpu.set_simd_level(request.param)
    yield request.param
    cpu.set_simd_level(-1)


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


@pytest.fixture(scope="session")
def chat_server():
    """`llamax serve` on SmolLM2 (2 slots, 2048 cells, no API key) over loopback, shared by the modules
    that drive the request surface with real clients (test_request_surface, test_agents)."""
    from test_server import LiveServer

    srv = LiveServer("-np", "2", "-c", "2048")
    yield srv
    assert srv.stop() == 0, "".join(srv.lines[-20:])


@pytest.fixture(scope="session")
def family_paths(tmp_path_factory, smollm2_gguf):
    """Every synthetic family model (tests/synthetic_families.py, seed 0) written once for the session."""
    from synthetic_families import FAMILIES, write_family

    d = tmp_path_factory.mktemp("families")
    return {n: write_family(d / f"{n}.gguf", smollm2_gguf, n) for n in FAMILIES}
