"""Data parallelism: the router (here), and replicas on virtual devices (``dp_on_4_devices.py``,
run in a subprocess with 4 CPU devices)."""

from __future__ import annotations

import pytest

from jaxpaged import LLM
from jaxpaged.data_parallel import Router
from virtual_devices import run_on_virtual_devices


def test_on_4_virtual_devices(request):
    run_on_virtual_devices("dp_on_4_devices.py", 4, request.config)


def test_too_few_devices_fails_at_start_up(tiny):
    with pytest.raises(
        ValueError, match=r"data_parallel_size x tensor_parallel_size = 2 x 1 = 2 needs 2 devices"
    ):
        LLM(str(tiny[0]), data_parallel_size=2)


def test_router_least_loaded_then_prefix_home():
    r = Router(3, block_size=4, slack=2)
    assert r.choose([1, 2, 3], None, [2, 0, 1]) == 1  # shorter than a block: least loaded
    assert r.choose([1, 2, 3, 4, 5], None, [0, 0, 0]) == 0  # first block seen: least loaded, remembered
    assert r.choose([1, 2, 3, 4, 9, 9], None, [1, 0, 0]) == 0  # same first block: its replica
    assert r.choose([1, 2, 3, 4], "tenant", [1, 0, 0]) == 1  # another cache salt: another prefix
    assert r.choose([1, 2, 3, 4, 7], None, [2, 1, 0]) == 0  # home within slack of the least loaded
    assert r.choose([1, 2, 3, 4, 7], None, [3, 0, 0]) == 1  # too far behind: least loaded, new home
    assert r.choose([1, 2, 3, 4], None, [0, 1, 0]) == 1
    assert r.num_routed == [3, 4, 0] and r.num_prefix_routed == 3


def test_router_without_prefix_caching_is_least_loaded():
    r = Router(2, block_size=None, slack=64)
    assert [r.choose([1, 2, 3, 4, 5], None, loads) for loads in ([0, 0], [1, 0], [1, 1])] == [0, 1, 0]
    assert r.num_prefix_routed == 0
