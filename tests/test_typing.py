"""Typing: mypy is clean on llamax/ (the [tool.mypy] section of pyproject.toml), the stubs of the
compiled llamax._native modules agree with the modules as built (stubtest), and the package says it
is typed (py.typed, PEP 561). A cold run of both takes ~25 s on one core."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = sorted(p.stem for p in (ROOT / "llamax" / "_native").glob("*.pyi") if p.stem != "__init__")

# Cython adds these to every module; they are not llamax's API
STUBTEST_ALLOWLIST = r"""
llamax\._native\.\w+\.__test__
llamax\._native\.\w+\.__reduce_cython__
llamax\._native\.\w+\.__setstate_cython__
llamax\._native\.\w+\.__pyx_capi__
"""


def test_py_typed_marker_and_stubs_ship():
    assert (ROOT / "llamax" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"llamax" = ["py.typed"]' in pyproject and '"*.pyi"' in pyproject
    # one stub per compiled module the Python layer may import
    built = {p.name.split(".")[0] for p in (ROOT / "llamax" / "_native").glob("*.so")} - {"libllamax"}
    assert not built or built == set(NATIVE), f"stubs {NATIVE} vs built modules {sorted(built)}"


def test_mypy_is_clean():
    api = pytest.importorskip("mypy.api")
    # the cache next to the sources (.gitignored): a cold run ~15 s of CPU, a warm one ~2 s
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"),
                                "--no-color-output", str(ROOT / "llamax")])
    assert status == 0, f"mypy found errors:\n{out}{err}"


def test_native_stubs_match_the_modules(tmp_path):
    stubtest = pytest.importorskip("mypy.stubtest")
    for name in NATIVE:
        importlib.import_module(f"llamax._native.{name}")  # a module that is not built fails here, clearly
    allow = tmp_path / "allowlist.txt"
    allow.write_text(STUBTEST_ALLOWLIST)
    args = [f"llamax._native.{m}" for m in NATIVE] + ["--allowlist", str(allow), "--concise",
                                                      "--mypy-config-file", str(ROOT / "pyproject.toml")]
    code = stubtest.test_stubs(stubtest.parse_options(args))
    assert code == 0, "llamax/_native/*.pyi disagree with the compiled modules (see stubtest's output above)"
