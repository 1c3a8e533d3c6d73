"""Build of llamax's native core: libllamax (every csrc unit, compiled once) and one Cython
extension per concept over it.

Flags: a portable baseline (no -march) with runtime dispatch inside the kernels;
LLAMAX_NATIVE=1 adds -march=native for a local build; LLAMAX_NO_OPENMP=1 builds
without OpenMP (the C code guards every pragma with _OPENMP); LLAMAX_SANITIZE=1 builds with
AddressSanitizer and UndefinedBehaviorSanitizer (-O1 -g; the interpreter needs the runtimes
preloaded: .ci/sanitize does it and runs the suite).
"""
import os
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The native library: every csrc unit compiled once into libllamax (one CPU probe, one level cap),
# which the Cython extensions link at run time from their own directory.
CORE_SOURCES = ["csrc/cpu.c", "csrc/quants.c", "csrc/hadamard.c", "csrc/kv_cells.c", "csrc/slot_finder.c",
                "csrc/kq_mask.c", "csrc/rope.c", "csrc/matmul.c", "csrc/gemm.c", "csrc/product.c", "csrc/attention.c", "csrc/attn_tile.c",
                "csrc/team.c", "csrc/layer.c", "csrc/moe.c", "csrc/buffers.c", "csrc/sampling.c", "csrc/ssm.c",
                "csrc/ssd.c", "csrc/delta_net.c", "csrc/mamba_layer.c", "csrc/mamba2_layer.c"]
CORE_PACKAGE = "llamax._native"

# one Cython extension per wrapped concept
EXTENSIONS = ["cpu", "cells", "kq_mask", "rope", "hadamard", "attention", "attn_tile", "quants", "matmul", "gemm",
              "layer", "moe", "buffers", "sampling", "ssm", "ssd", "delta_net", "mamba_layer", "mamba2_layer"]


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
    """Per-compiler flags (OpenMP only when the compiler has it); libllamax built before the
    extensions, into the package directory beside them."""

    def _flags(self):
        if self.compiler.compiler_type == "msvc":
            cflags, lflags = ["/O2"], []
            if os.environ.get("LLAMAX_NO_OPENMP") != "1":
                cflags.append("/openmp")
            return cflags, lflags
        cflags = ["-O3", "-std=c11", "-fno-math-errno", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"]
        lflags = []
        if os.environ.get("LLAMAX_SANITIZE") == "1":
            # every UB check fatal, so a report fails the test that caused it
            san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
            cflags = ["-O1", "-g", "-fno-omit-frame-pointer"] + san + cflags[1:]
            lflags += san
        if os.environ.get("LLAMAX_NATIVE") == "1":
            cflags.append("-march=native")
        if os.environ.get("LLAMAX_NO_OPENMP") != "1" and _compiler_accepts(self.compiler, "-fopenmp"):
            cflags.append("-fopenmp")
            lflags.append("-fopenmp")
        elif os.environ.get("LLAMAX_NO_OPENMP") != "1":
            print("llamax: the compiler has no OpenMP; building single-threaded kernels", file=sys.stderr)
        return cflags, lflags

    def _core_path(self, inplace: bool) -> str:
        """libllamax's path in the build tree, or in the source tree when inplace."""
        name = "libllamax.dylib" if sys.platform == "darwin" else "libllamax.so"
        if inplace:
            pkg_dir = self.get_finalized_command("build_py").get_package_dir(CORE_PACKAGE)
        else:
            pkg_dir = os.path.join(self.build_lib, *CORE_PACKAGE.split("."))
        return os.path.join(pkg_dir, name)

    def _build_core(self, cflags, lflags):
        """Compile csrc once; link it as libllamax (ELF / Mach-O) or return the objects (MSVC)."""
        objects = self.compiler.compile(CORE_SOURCES, output_dir=self.build_temp, include_dirs=["csrc"],
                                        extra_postargs=cflags, depends=[os.path.join("csrc", h) for h in
                                                                        os.listdir("csrc") if h.endswith(".h")])
        if self.compiler.compiler_type == "msvc":
            # no DLL exports are declared: each extension links the objects (one copy per module)
            return objects, []
        lib = self._core_path(False)
        os.makedirs(os.path.dirname(lib), exist_ok=True)
        name = os.path.basename(lib)
        if sys.platform == "darwin":
            self.compiler.spawn(self.compiler.linker_so[:1] + ["-dynamiclib", "-install_name", "@rpath/" + name]
                                + objects + lflags + ["-o", lib])
            rpath = "-Wl,-rpath,@loader_path"
        else:
            self.compiler.link_shared_object(objects, lib, extra_postargs=lflags + ["-Wl,-soname," + name])
            rpath = "-Wl,-rpath,$ORIGIN"
        return [], ["-L" + os.path.dirname(lib), "-lllamax", rpath]

    def build_extensions(self):
        cflags, lflags = self._flags()
        objects, core_link = self._build_core(cflags, lflags)
        # Cython's generated C is not C11-clean with -Wall; keep our flags for csrc only where it matters.
        for ext in self.extensions:
            ext.extra_compile_args = list(cflags)
            ext.extra_objects = list(objects)
            ext.extra_link_args = list(lflags) + core_link
        super().build_extensions()

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        if os.path.exists(self._core_path(False)):
            self.copy_file(self._core_path(False), self._core_path(True), level=self.verbose)

    def get_outputs(self):
        outs = super().get_outputs()
        if self.inplace:
            return outs
        return sorted(outs + [self._core_path(False)])

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            mapping[self._core_path(False)] = self._core_path(True)
        return mapping


def _extensions():
    only = os.environ.get("LLAMAX_EXTENSIONS")  # dev aid: build a subset, e.g. "cells,kq_mask"
    exts = []
    for name in EXTENSIONS:
        if only and name not in only.split(","):
            continue
        exts.append(Extension(f"{CORE_PACKAGE}.{name}", [f"llamax/_native/{name}.pyx"], include_dirs=["csrc", np.get_include()],
                              define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]))
    return cythonize(exts, language_level=3, compiler_directives={
        "boundscheck": False, "wraparound": False, "cdivision": True, "initializedcheck": False,
    })


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
