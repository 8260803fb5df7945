"""Builds the optional native CPU kernels (pallas_kernels/csrc: paged attention, dense matmul,
the rotary embedding and RMSNorm);
metadata lives in pyproject.toml.

Each kernel is a plain shared library loaded with ctypes and registered as an XLA FFI target, so
it needs only XLA's FFI headers (shipped in jaxlib) at build time. It is compiled for the
installing machine's CPU (-march=native): install on the machine that runs it. If the build
fails (no C++ compiler) the install still succeeds and XLA's own attention and dot are used.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildSharedLibrary(build_ext):
    """No Python module init is needed (ctypes loads it), so skip the PyInit export check; the kernels
    compile in parallel (one per core: 57 s one after another on 2 cores, most of an install)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def get_export_symbols(self, ext):
        return []


def _ffi_include_dir() -> str:
    import jaxlib

    return os.path.join(os.path.dirname(jaxlib.__file__), "include")


def _native_extension(name: str) -> Extension:
    # -ffp-contract=off: the compiler may not fuse a plain a * b + c into one rounding (GCC does by default
    # in C++), so elementwise kernels round as torch does; the kernels' fused multiply-adds are explicit.
    return Extension(
        f"jaxpaged.kernels.{name}",
        sources=[f"pallas_kernels/csrc/{name.lstrip('_')}.cc"],
        depends=[
            "pallas_kernels/csrc/bf16.h",
            "pallas_kernels/csrc/vec16.h",
            "pallas_kernels/csrc/stacked.h",
        ],
        include_dirs=[_ffi_include_dir()],
        language="c++",
        extra_compile_args=[
            "-std=c++17",
            "-O3",
            "-march=native",
            "-fopenmp-simd",
            "-ffp-contract=off",
            "-Wno-attributes",
            "-Wno-return-type",
        ],
        optional=True,
    )


setup(
    ext_modules=[
        _native_extension("_paged_attention_cpu"),
        _native_extension("_matmul_cpu"),
        _native_extension("_layer_ops_cpu"),
    ],
    cmdclass={"build_ext": BuildSharedLibrary},
)
