"""Build of llamax's native core: one Cython extension per concept over csrc/.

Flags: a portable baseline (no -march) with runtime dispatch inside the kernels;
LLAMAX_NATIVE=1 adds -march=native for a local build; LLAMAX_NO_OPENMP=1 builds
without OpenMP (the C code guards every pragma with _OPENMP).
"""
import os
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# (module, sources): listed explicitly, one per wrapped concept.
EXTENSIONS = [
    ("llamax._native.cells", ["llamax/_native/cells.pyx", "csrc/kv_cells.c", "csrc/slot_finder.c"]),
    ("llamax._native.kq_mask", ["llamax/_native/kq_mask.pyx", "csrc/kq_mask.c"]),
    ("llamax._native.rope", ["llamax/_native/rope.pyx", "csrc/rope.c", "csrc/quants.c", "csrc/hadamard.c"]),
    ("llamax._native.hadamard", ["llamax/_native/hadamard.pyx", "csrc/hadamard.c"]),
    ("llamax._native.attention", ["llamax/_native/attention.pyx", "csrc/attention.c", "csrc/quants.c"]),
    ("llamax._native.quants", ["llamax/_native/quants.pyx", "csrc/quants.c"]),
    ("llamax._native.matmul", ["llamax/_native/matmul.pyx", "csrc/matmul.c", "csrc/quants.c"]),
    ("llamax._native.gemm", ["llamax/_native/gemm.pyx", "csrc/gemm.c", "csrc/quants.c"]),
    ("llamax._native.layer", ["llamax/_native/layer.pyx", "csrc/layer.c", "csrc/gemm.c", "csrc/matmul.c", "csrc/attention.c",
                              "csrc/rope.c", "csrc/hadamard.c", "csrc/quants.c"]),
    ("llamax._native.buffers", ["llamax/_native/buffers.pyx", "csrc/buffers.c"]),
    ("llamax._native.sampling", ["llamax/_native/sampling.pyx", "csrc/sampling.c"]),
]


def _compiler_accepts(compiler, flag: str) -> bool:
    """True if the C compiler compiles and links a trivial program with `flag`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
                    if "openmp" in flag else "int main(void){return 0;}\n")
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=[flag])
            compiler.link_executable(objs, os.path.join(tmp, "t"), extra_postargs=[flag])
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    """Per-compiler flags; OpenMP only when the compiler has it."""

    def build_extensions(self):
        ctype = self.compiler.compiler_type
        if ctype == "msvc":
            cflags, lflags = ["/O2"], []
            if os.environ.get("LLAMAX_NO_OPENMP") != "1":
                cflags.append("/openmp")
        else:
            cflags = ["-O3", "-std=c11", "-fno-math-errno", "-Wall", "-Wno-unused-function",
                      "-Wno-unknown-pragmas"]
            lflags = []
            if os.environ.get("LLAMAX_NATIVE") == "1":
                cflags.append("-march=native")
            if os.environ.get("LLAMAX_NO_OPENMP") != "1" and _compiler_accepts(self.compiler, "-fopenmp"):
                cflags.append("-fopenmp")
                lflags.append("-fopenmp")
            elif os.environ.get("LLAMAX_NO_OPENMP") != "1":
                print("llamax: the compiler has no OpenMP; building single-threaded kernels", file=sys.stderr)
        # Cython's generated C is not C11-clean with -Wall; keep our flags for csrc only where it matters.
        for ext in self.extensions:
            ext.extra_compile_args = list(cflags)
            ext.extra_link_args = list(lflags)
        super().build_extensions()


def _extensions():
    only = os.environ.get("LLAMAX_EXTENSIONS")  # dev aid: build a subset, e.g. "cells,kq_mask"
    exts = []
    for name, sources in EXTENSIONS:
        if only and name.rsplit(".", 1)[1] not in only.split(","):
            continue
        exts.append(Extension(name, sources, include_dirs=["csrc", np.get_include()],
                              define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]))
    return cythonize(exts, language_level=3, compiler_directives={
        "boundscheck": False, "wraparound": False, "cdivision": True, "initializedcheck": False,
    })


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
