"""Loading the C++ kernels: where ``setup.py`` built a kernel's shared library it must load and
register, so that a loader bug fails here instead of silently skipping the kernels' own tests."""

import importlib.machinery
from pathlib import Path

import pytest

import jaxpaged.kernels
from jaxpaged.kernels.cpu_attention import native_kernel_available
from jaxpaged.kernels.cpu_layer_ops import native_layer_ops_available
from jaxpaged.kernels.cpu_matmul import native_matmul_available
from jaxpaged.kernels.native import register_cpu_targets


@pytest.mark.parametrize(
    "stem,available",
    [
        ("_matmul_cpu", native_matmul_available),
        ("_paged_attention_cpu", native_kernel_available),
        ("_layer_ops_cpu", native_layer_ops_available),
    ],
)
def test_a_built_kernel_loads(stem, available):
    here = Path(jaxpaged.kernels.__file__).parent
    built = any((here / f"{stem}{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)
    assert available() == built


def test_a_missing_library_is_reported_not_raised():
    assert register_cpu_targets("jaxpaged.kernels._no_such_kernel", {"jaxpaged_none": "None"}) is False
