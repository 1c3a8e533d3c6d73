"""What the fuzz harnesses share: a reader of the fuzzer's bytes (the choices of one case), the
interesting numbers, the tiny model and a scratch directory.

Each harness (tests/fuzz/<target>.py) has `one_input(data: bytes) -> None`: one case, driven by the
bytes only (the same bytes, the same case), raising `Finding` (an AssertionError) when the library
breaks its contract and letting any unexpected exception escape. tests/test_fuzz.py feeds it
Hypothesis' bytes and the seeds of tests/fuzz/corpus/<target>/; benchmarks/fuzz.py feeds it
atheris' (coverage-guided libFuzzer) for the long runs.
"""
from __future__ import annotations

import functools
import os
import struct
import tempfile
from pathlib import Path

CORPUS = Path(__file__).parent / "corpus"

#: lengths and counts a hostile file claims
INTERESTING_U64 = (0, 1, 2, 7, 8, 63, 64, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
                   2**62, 2**63 - 1, 2**63, 2**64 - 1)
INTERESTING_U32 = (0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 63, 64, 255, 256, 1024, 2**15, 2**16, 2**31 - 1,
                   2**31, 2**32 - 1)


class Finding(AssertionError):
    """The library broke its contract on this input (the message says how)."""


class Draw:
    """The choices of one case, read from the fuzzer's bytes; past their end every read is 0, so
    any byte string is a valid case (short inputs are the simple cases)."""

    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)
        self.at = 0

    def bytes(self, n: int) -> bytes:
        out = self.data[self.at:self.at + n]
        self.at += len(out)
        return out

    def uint(self, nbytes: int) -> int:
        return int.from_bytes(self.bytes(nbytes).ljust(nbytes, b"\0"), "little")

    def below(self, n: int) -> int:
        """An int in [0, n) (0 when n <= 1)."""
        if n <= 1:
            return 0
        k = (n.bit_length() + 7) // 8
        return self.uint(k) % n

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def chance(self, num: int, den: int) -> bool:
        return self.below(den) < num

    def rest(self) -> bytes:
        out = self.data[self.at:]
        self.at = len(self.data)
        return out

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def u64_value(self, near: int = 0) -> int:
        """An interesting u64: a boundary, near a real value, or any."""
        k = self.below(4)
        if k == 0:
            return self.pick(INTERESTING_U64)
        if k == 1:
            return max(0, near + self.below(17) - 8)
        if k == 2:
            return self.uint(8)
        return (near * 2 + 1) % 2**64

    def u32_value(self, near: int = 0) -> int:
        k = self.below(3)
        if k == 0:
            return self.pick(INTERESTING_U32)
        if k == 1:
            return max(0, min(2**32 - 1, near + self.below(17) - 8))
        return self.uint(4)


def overwrite(buf: bytearray, at: int, fmt: str, value: int) -> None:
    """Pack value (modulo the field's width) at `at` when it fits in the buffer (unsigned format fmt)."""
    n = struct.calcsize(fmt)
    if 0 <= at and at + n <= len(buf):
        struct.pack_into(fmt, buf, at, value % (1 << (8 * n)))


def peek(buf, at: int, fmt: str) -> int:
    """The value of format fmt at `at`, 0 when it lies outside buf."""
    n = struct.calcsize(fmt)
    return struct.unpack_from(fmt, buf, at)[0] if 0 <= at and at + n <= len(buf) else 0


def mutate_bytes(d: Draw, buf: bytearray, lo: int = 0, hi: int | None = None, max_ops: int = 4) -> None:
    """A few blind mutations inside [lo, hi): bit flips, byte sets, word sets, a cut, a splice."""
    hi = len(buf) if hi is None else min(hi, len(buf))
    for _ in range(1 + d.below(max_ops)):
        if hi <= lo:
            return
        at = lo + d.below(hi - lo)
        op = d.below(6)
        if op == 0:
            buf[at] ^= 1 << d.below(8)
        elif op == 1:
            buf[at] = d.uint(1)
        elif op == 2:
            overwrite(buf, at & ~3, "<I", d.u32_value(peek(buf, at & ~3, "<I")))
        elif op == 3:
            overwrite(buf, at & ~7, "<Q", d.u64_value())
        elif op == 4:
            n = d.below(16) + 1
            del buf[at:at + n]
            hi = min(hi, len(buf))
        else:
            buf[at:at] = d.bytes(d.below(16) + 1) or b"\0"


@functools.lru_cache(maxsize=None)
def scratch() -> Path:
    """A private directory for the files of the cases: inside $LLAMAX_FUZZ_SCRATCH when set (the long
    runs' work directory: their children end without exit hooks), else in RAM when /dev/shm exists."""
    base = os.environ.get("LLAMAX_FUZZ_SCRATCH")
    if base is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    return Path(tempfile.mkdtemp(prefix="llamax-fuzz-", dir=base))


@functools.lru_cache(maxsize=None)
def tiny_model_path() -> Path:
    from tests.fuzz import tiny_gguf

    return tiny_gguf.write(scratch() / "tiny.gguf")


@functools.lru_cache(maxsize=None)
def tiny_model():
    from llamax import Model

    return Model.load(tiny_model_path(), n_threads=1)


def _cleanup() -> None:
    import shutil

    if scratch.cache_info().currsize:
        shutil.rmtree(scratch(), ignore_errors=True)


import atexit  # noqa: E402

atexit.register(_cleanup)


class Hang(AssertionError):
    """A case ran past its time limit."""


import contextlib  # noqa: E402
import signal  # noqa: E402


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise Hang in the main thread when the block runs longer than seconds (SIGALRM; a no-op off
    the main thread or without setitimer)."""
    import threading

    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def alarm(signum, frame):
        raise Hang(f"the case ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
