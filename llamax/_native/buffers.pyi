"""Type stub of buffers.pyx (a threaded join of C-contiguous buffers)."""
from collections.abc import Iterable

from typing_extensions import Buffer

def join(parts: Iterable[Buffer], n_threads: int | None = None) -> bytes: ...
def join_ref(parts: Iterable[Buffer]) -> bytes: ...
