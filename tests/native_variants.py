"""The instruction-set variants of the native CPU kernels (pallas_kernels/csrc), for tests that
build each one the CPU runs with the matching target flags: ``setup.py`` builds only the
installing machine's variant (-march=native), so the others are checked only here."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "pallas_kernels" / "csrc"
CXX = os.environ.get("CXX", "c++")
# name -> (compiler target flags, /proc/cpuinfo flags the CPU needs to run it)
VARIANTS = {
    "avx512": (
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
        {"avx512f", "avx512bw", "avx512vl"},
    ),
    "avx2": (["-mavx2", "-mfma", "-mno-avx512f"], {"avx2", "fma"}),
    "portable": (["-mno-avx2", "-mno-fma", "-mno-avx512f"], set()),
}

needs_x86_compiler = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which(CXX) is None,
    reason="needs an x86-64 CPU and a C++ compiler",
)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    }


def runnable_variants() -> dict[str, list[str]]:
    """{variant: target flags} for every variant this CPU runs."""
    flags = cpu_flags()
    return {name: target for name, (target, needs) in VARIANTS.items() if needs <= flags}
