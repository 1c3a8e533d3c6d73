"""The one place a thread count is resolved (scikit-learn's semantics), for the native kernels and
the Python layer alike. No llamax imports: every native wrapper imports it."""
from __future__ import annotations

import os

__all__ = ["resolve_n_threads"]


def _available_cores() -> int:
    """Cores this process may run on: the affinity mask when the OS has one, else os.cpu_count()."""
    if hasattr(os, "sched_getaffinity"):
        try:
            n = len(os.sched_getaffinity(0))
            if n > 0:
                return n
        except OSError:  # pragma: no cover - exotic platforms
            pass
    process_cpu_count = getattr(os, "process_cpu_count", None)  # Python >= 3.13
    count: int | None = process_cpu_count() if process_cpu_count is not None else os.cpu_count()
    return max(1, count or 1)


def resolve_n_threads(n_threads: int | None = None) -> int:
    """Resolve a thread count with scikit-learn's semantics.

    Args:
        n_threads: None or -1 for every core this process may use (the affinity mask, else
            os.cpu_count()); a positive int is taken as is (it may exceed the core count).

    Returns:
        The number of threads, >= 1.

    Raises:
        ValueError: n_threads is 0 or < -1.
        TypeError: n_threads is not an int (bool is refused too).
    """
    if n_threads is None:
        return _available_cores()
    if isinstance(n_threads, bool) or not isinstance(n_threads, int):
        raise TypeError(f"n_threads must be an int or None, got {type(n_threads).__name__}")
    if n_threads == -1:
        return _available_cores()
    if n_threads == 0 or n_threads < -1:
        raise ValueError(f"n_threads = {n_threads}: use a positive count, or None / -1 for all cores")
    return n_threads
