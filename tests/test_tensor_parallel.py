"""Tensor parallelism and multi-host serving.

The multi-device checks live in ``tp_on_4_devices.py`` and run here in a subprocess with 4
virtual CPU devices; this process (one device) checks configuration errors, the fused-kernel
layout, the leader/follower step protocol, and a real 2-process run on ``jax.distributed``.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpaged import LLM, EngineArgs, LLMEngine, SamplingParams
from jaxpaged.distributed import Leader, follow
from jaxpaged.parallel import interleave_shards, kv_head_repeats
from virtual_devices import TESTS, run_on_virtual_devices


def test_on_4_virtual_devices(request):
    run_on_virtual_devices("tp_on_4_devices.py", 4, request.config)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_parallel_sizes_are_validated(bad):
    for name in ("tensor_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
            EngineArgs(**{name: bad}).create_engine_config()


def test_more_devices_than_there_are_fails_at_start_up(tiny):
    path, _ = tiny
    assert jax.device_count() == 1
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices, but only 1"):
        LLM(str(path), tensor_parallel_size=2)


def test_kv_head_repeats():
    assert kv_head_repeats(9, 3, 3) == 1  # SmolLM2 on 3 devices: one kv head each
    assert kv_head_repeats(6, 3, 2) == 2  # 3 kv heads on 2 devices: 6 copies, 3 each
    assert kv_head_repeats(4, 1, 4) == 4
    assert kv_head_repeats(32, 8, 4) == 1
    with pytest.raises(ValueError, match="does not divide the model's 9 attention"):
        kv_head_repeats(9, 3, 2)


def test_interleave_puts_whole_sections_on_each_shard():
    # Columns [q0 q1 q2 q3 | k0 k1 | v0 v1] (one column per head) on 2 shards.
    a = np.array([[10, 11, 12, 13, 20, 21, 30, 31]])
    out = interleave_shards(a, (4, 2, 2), 2)
    np.testing.assert_array_equal(out, [[10, 11, 20, 30, 12, 13, 21, 31]])
    np.testing.assert_array_equal(interleave_shards(a, (4, 2, 2), 1), a)


class _Queue:
    """An in-process channel: the leader's messages, read back in order by a follower."""

    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)

    def recv(self):
        return self.messages.pop(0)


def test_follower_replays_the_leaders_device_work(tiny):
    """The multi-host protocol without the transport: a follower runner fed the leader's messages
    ends with the same KV pages, through chunked prefill, prefix hits, copy-on-write (n=2) and swap."""
    path, _ = tiny
    args = EngineArgs(
        model=str(path),
        block_size=4,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=14,
        preemption_mode="swap",
        swap_space=2**-10,
    )
    leader, follower = (LLMEngine.from_engine_args(args) for _ in range(2))
    channel = _Queue()
    Leader(leader.runner, channel)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 350, 9).tolist()
    for i, n in enumerate([12, 20, 7]):
        leader.add_request(
            str(i),
            shared + rng.integers(3, 350, n).tolist(),
            SamplingParams(temperature=0.8, seed=i, max_tokens=10, n=2, ignore_eos=True),
        )
    while leader.has_unfinished_requests():
        leader.step()
    kinds = {m[0] for m in channel.messages}
    transfers = [m[1] for m in channel.messages if m[0] == "transfers"]
    assert kinds <= {"step", "transfers"} and "step" in kinds
    assert any(t.blocks_to_copy for t in transfers) and any(t.blocks_to_swap_out for t in transfers)
    assert leader.kv_cache_manager.stats.hits > 0
    num_steps = sum(m[0] == "step" for m in channel.messages)
    channel.send(("stop",))
    assert follow(follower.runner, channel) == num_steps
    np.testing.assert_array_equal(np.asarray(follower.runner.kv_pages), np.asarray(leader.runner.kv_pages))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_jax_distributed_match_one(tiny):
    """Two CPU processes on localhost (gloo collectives), one device each: the engine is split
    over both (TP=2 across processes); the leader's outputs equal a one-process engine's."""
    path, _ = tiny
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    worker = [sys.executable, str(TESTS / "multihost_worker.py"), str(path), str(port), "2"]
    follower = subprocess.Popen(
        worker + ["1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lead = subprocess.run(worker + ["0"], env=env, capture_output=True, text=True, timeout=300)
        follower_out, _ = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert lead.returncode == 0, lead.stdout[-3000:] + lead.stderr[-3000:]
    assert follower.returncode == 0, follower_out[-3000:]
    got = json.loads(lead.stdout.strip().splitlines()[-1])

    sys.path.insert(0, str(TESTS))
    from multihost_worker import PROMPTS

    llm = LLM(str(path), num_gpu_blocks_override=32, block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    for (tokens, logprobs), out in zip(got, outs):
        c = out.outputs[0]
        assert tokens == c.token_ids
        np.testing.assert_allclose(
            logprobs, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], atol=1e-4
        )


def test_serve_has_multihost_flags():
    from jaxpaged.cli import build_parser

    ns = build_parser().parse_args(
        [
            "serve",
            "--coordinator-address",
            "10.0.0.1:1234",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--tensor-parallel-size",
            "2",
            "--data-parallel-size",
            "1",
        ]
    )
    assert (ns.coordinator_address, ns.num_processes, ns.process_id) == ("10.0.0.1:1234", 2, 1)
    assert (ns.tensor_parallel_size, ns.data_parallel_size) == (2, 1)
    assert pathlib.Path(TESTS / "multihost_worker.py").is_file()
