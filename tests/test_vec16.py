"""The vector header of the CPU kernels (pallas_kernels/csrc/vec16.h) in each of its variants —
AVX-512, two AVX2 halves, portable loops — built with the matching target flags, on the same
inputs: the same results as each other and as numpy. ``setup.py`` builds only the installing
machine's variant, so this is where the others are checked (each where the CPU runs it)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from native_variants import CSRC, CXX, ROOT, cpu_flags, needs_x86_compiler, runnable_variants

pytestmark = needs_x86_compiler


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """{variant: {check: values}} for every variant this CPU runs."""
    out = {}
    for name, target in runnable_variants().items():
        exe = tmp_path_factory.mktemp(name) / "vec16_check"
        subprocess.run(
            [
                CXX,
                "-std=c++17",
                "-O2",
                "-ffp-contract=off",
                *target,
                f"-I{CSRC}",
                str(ROOT / "tests" / "csrc" / "vec16_check.cc"),
                "-o",
                str(exe),
            ],
            check=True,
        )
        checks: dict[str, list] = {}
        for line in subprocess.run(
            [str(exe)], check=True, capture_output=True, text=True
        ).stdout.splitlines():
            key, *values = line.split()
            checks.setdefault(key, []).append([float(v) for v in values])
        out[name] = {
            k: np.array(v, np.float32).squeeze(0) if len(v) == 1 else np.array(v, np.float32)
            for k, v in checks.items()
        }
    return out


def test_every_variant_matches_numpy(outputs):
    assert "portable" in outputs and ("avx2" in outputs) == ({"avx2", "fma"} <= cpu_flags())
    for name, o in outputs.items():
        x = o["inputs"].reshape(16, 16).astype(np.float64)
        edges = o["edges"].astype(np.float64)
        with np.errstate(over="ignore"):
            want = np.where(edges >= -87, np.exp(edges), 0.0).astype(np.float32)  # exp(89): inf
        np.testing.assert_allclose(o["exp_edges"], want, rtol=2e-7, err_msg=name)
        np.testing.assert_allclose(o["exp"], np.exp(0.5 * x), rtol=2e-7, atol=0, err_msg=name)
        n = np.arange(16)
        np.testing.assert_allclose(o["reduce"][:, 0], x.sum(1), rtol=1e-5, atol=1e-4, err_msg=name)
        assert np.array_equal(o["reduce"][:, 1], x.max(1)), name
        assert np.array_equal(o["reduce"][:, 2], [sum(1 << j for j in range(16) if r[j] <= 0) for r in x]), (
            name
        )
        lanes = n[None, :] < n[:, None]  # row i: its first i lanes
        assert np.array_equal(o["masked"], np.where(lanes, x, 0)), name
        assert np.array_equal(o["select"], np.where(lanes, x, -1)), name
        xf = x.astype(np.float32)
        arith = (xf * xf + (np.maximum(xf, 0) - 2)) / (3 + xf * xf)
        np.testing.assert_allclose(o["arith"], arith, rtol=1e-6, err_msg=name)
        bf16 = ((0x3F80 + 7 * n).astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(o["bf16"], [np.where(n < k, bf16, 0) for k in (0, 5, 10, 15)]), name
        np.testing.assert_allclose(o["sum_each"], x.sum(1), rtol=1e-5, atol=1e-4, err_msg=name)
        assert np.array_equal(o["transposed"], x.T.astype(np.float32)), name


def test_variants_agree(outputs):
    """Exactly where the operation is exact; to float32 rounding where the order of a sum or the
    exp algorithm differs (the portable loops call std::exp)."""
    base = outputs["portable"]
    for name, o in outputs.items():
        for key in ("inputs", "masked", "select", "bf16", "transposed", "arith"):
            assert np.array_equal(o[key], base[key]), (name, key)
        assert np.array_equal(o["reduce"][:, 1:], base["reduce"][:, 1:]), name
        for key in ("exp", "exp_edges", "sum_each"):
            exact_order = key != "sum_each"
            np.testing.assert_allclose(
                o[key],
                base[key],
                rtol=3e-7 if exact_order else 1e-5,
                atol=0 if exact_order else 1e-4,
                err_msg=f"{name} {key}",
            )
