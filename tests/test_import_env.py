"""`import llamax` leaves the process environment as it found it, yet libgomp still loads with
llamax's short spin-wait (its value, printed by libgomp itself with OMP_DISPLAY_ENV)."""
import os
import subprocess
import sys

OURS = ("GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")
PROBE = ("import os, subprocess, llamax\n"
         "print(sorted(k for k in %r if k in os.environ))\n"
         "print(subprocess.run(['env'], capture_output=True, text=True).stdout.count('GOMP_SPINCOUNT'))\n" % (OURS,))


def run(**extra):
    env = {k: v for k, v in os.environ.items() if k not in OURS}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **extra)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)


def uses_openmp():
    import llamax._native as nat
    lib = os.path.join(os.path.dirname(nat.__file__), "libllamax.so")
    return b"libgomp" in open(lib, "rb").read()


def test_import_sets_no_environment_variable():
    r = run()
    assert r.stdout.split() == ["[]", "0"]  # not in os.environ, not in a child's environment
    if uses_openmp():
        assert "GOMP_SPINCOUNT = '10000'" in r.stderr  # libgomp read it as it loaded


def test_a_value_the_user_set_is_kept_and_wins():
    r = run(GOMP_SPINCOUNT="123")
    assert r.stdout.split() == ["['GOMP_SPINCOUNT']", "1"]
    if uses_openmp():
        assert "GOMP_SPINCOUNT = '123'" in r.stderr
