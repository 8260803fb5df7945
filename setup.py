"""Builds the optional native CPU attention kernel (pallas_kernels/csrc); metadata lives in pyproject.toml.

The kernel is a plain shared library loaded with ctypes and registered as an XLA FFI target, so
it needs only XLA's FFI headers (shipped in jaxlib) at build time. It is compiled for the
installing machine's CPU (-march=native): install on the machine that runs it. If the build
fails (no C++ compiler) the install still succeeds and the engine uses XLA attention.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildSharedLibrary(build_ext):
    """No Python module init is needed (ctypes loads it), so skip the PyInit export check."""

    def get_export_symbols(self, ext):
        return []


def _ffi_include_dir() -> str:
    import jaxlib

    return os.path.join(os.path.dirname(jaxlib.__file__), "include")


setup(
    ext_modules=[
        Extension(
            "pallas_kernels._paged_attention_cpu",
            sources=["pallas_kernels/csrc/paged_attention_cpu.cc"],
            include_dirs=[_ffi_include_dir()],
            language="c++",
            extra_compile_args=["-std=c++17", "-O3", "-march=native", "-fopenmp-simd", "-Wno-attributes",
                                "-Wno-return-type"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildSharedLibrary},
)
