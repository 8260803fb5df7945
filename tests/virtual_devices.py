"""Running a test module in a subprocess with N virtual CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=N`` only takes effect before JAX starts, and
the pytest process has already started it with one device; so multi-device test modules (named
without the ``test_`` prefix, so the main run does not collect them) run in a child pytest.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).parent


def run_on_virtual_devices(module: str, num_devices: int, config: pytest.Config, timeout: float = 900) -> str:
    """Run ``tests/<module>`` under pytest with ``num_devices`` CPU devices; fail with its output if
    it fails. The parent's ``-m`` marker expression is passed on."""
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={num_devices}".strip())
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(TESTS / module)]
    if config.getoption("markexpr"):
        cmd += ["-m", config.getoption("markexpr")]
    proc = subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode == 5:
        pytest.skip(f"{module}: no test selected")
    if proc.returncode != 0:
        pytest.fail(
            f"{module} on {num_devices} virtual devices failed (exit {proc.returncode}):\n{output[-6000:]}"
        )
    print(output[-2000:])
    return output
