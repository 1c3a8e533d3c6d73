"""The one timing helper of the benchmark scripts (run as `python benchmarks/bench_x.py`, so this
directory is on sys.path)."""
import statistics
import time


def median_time(fn, runs: int, *, warmup: int = 1, setup=None) -> float:
    """Median wall time of fn() in seconds over `runs` calls, after `warmup` untimed calls; setup(),
    if given, runs untimed before each timed call."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(runs):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
