"""Multi-host serving: one tensor-parallel engine spanning processes, on ``jax.distributed``.

Every process builds the same engine over the global mesh (each loads the checkpoint and puts
only its own devices' shards in place). Process 0, the leader, schedules and serves HTTP; the
others follow: JAX is multi-controller, so every process must run the same jitted programs on
the same inputs in the same order. The leader therefore broadcasts, before each device
operation, what it is about to run, and followers run exactly that:

* ``("transfers", transfers)``: a step's block transfers (swap/copy lists), sent when the leader
  applies them;
* ``("step", batch)``: the step's padded host batch (``ModelRunner.prepare``'s ``StepBatch``);
  followers run the same forward and sampler programs (and drop the sampled tokens; each
  process keeps its own copy of the last step's samples, which the next step's in-flight
  decode inputs are read from on the device);
* ``("stop",)``: the leader is shutting down.

Messages are pickled and sent with ``multihost_utils.broadcast_one_to_all`` (a length, then the
bytes padded to a power of two so few shapes compile). Only run processes you trust on the
coordinator's network: a follower unpickles what the leader sends.

Hooks wrap the runner's ``apply_block_transfers`` / ``run_batch`` on the instance; the runner
itself knows nothing of processes. Swap preemption is not supported across hosts (its host
page pool would need every process's KV shard on the leader).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np

from jaxpaged.config import EngineArgs

logger = logging.getLogger(__name__)


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """``jax.distributed.initialize`` (call before anything else touches JAX's devices), with gloo
    collectives so that CPU processes can run cross-process programs too."""
    if num_processes < 2:
        raise ValueError(f"num_processes must be at least 2 for multi-host serving, got {num_processes}.")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}.")
    if not coordinator_address:
        raise ValueError("multi-host serving needs --coordinator-address HOST:PORT (the leader's address).")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    logger.info(
        "process %d of %d: %d local devices, %d in all",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


class Channel(Protocol):
    def send(self, message: tuple) -> None: ...
    def recv(self) -> tuple: ...


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 255).bit_length()


class BroadcastChannel:
    """Messages from process 0 to every process, over JAX's own collectives."""

    def _broadcast(self, data: bytes) -> bytes:
        from jax.experimental import multihost_utils

        leader = jax.process_index() == 0
        n = multihost_utils.broadcast_one_to_all(np.array([len(data) if leader else 0], np.int32))
        n = int(np.asarray(n)[0])
        buf = np.zeros(_bucket(n), np.uint8)
        if leader:
            buf[:n] = np.frombuffer(data, np.uint8)
        return np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes()

    def send(self, message: tuple) -> None:
        self._broadcast(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> tuple:
        return pickle.loads(self._broadcast(b""))


@dataclass
class Transfers:
    """The block transfers of one step (the part of a ``SchedulerOutput`` the runner applies)."""

    blocks_to_swap_out: list = field(default_factory=list)
    blocks_to_copy: list = field(default_factory=list)
    blocks_to_swap_in: list = field(default_factory=list)

    @classmethod
    def of(cls, out: Any) -> "Transfers":
        return cls(list(out.blocks_to_swap_out), list(out.blocks_to_copy), list(out.blocks_to_swap_in))

    def __bool__(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_copy or self.blocks_to_swap_in)


class Leader:
    """Wraps a runner so that every device operation it runs is first broadcast to the followers."""

    def __init__(self, runner: Any, channel: Channel):
        self.runner, self.channel = runner, channel
        self._apply, self._run_batch = runner.apply_block_transfers, runner.run_batch
        runner.apply_block_transfers = self.apply_block_transfers
        runner.run_batch = self.run_batch

    def apply_block_transfers(self, out: Any) -> None:
        transfers = Transfers.of(out)
        if transfers:
            self.channel.send(("transfers", transfers))
        self._apply(out)

    def run_batch(self, batch: Any):
        self.channel.send(("step", batch))
        return self._run_batch(batch)

    def stop(self) -> None:
        self.channel.send(("stop",))


def follow(runner: Any, channel: Channel) -> int:
    """Run what the leader runs until it stops; returns the number of steps followed."""
    steps = 0
    while True:
        message = channel.recv()
        kind = message[0]
        if kind == "stop":
            return steps
        if kind == "transfers":
            runner.apply_block_transfers(message[1])
            continue
        runner.collect(runner.run_batch(message[1]))
        steps += 1


def build_engine(args: EngineArgs):
    """The engine of this process in a multi-host run (after ``initialize``). The leader gets its
    ``LLMEngine`` back, hooked to broadcast its steps (call ``stop_followers`` when done); a
    follower follows the leader in here until the leader stops, then gets None."""
    from jaxpaged.engine import LLMEngine

    config = args.create_engine_config()
    p = config.parallel
    if p.data_parallel_size != 1:
        raise ValueError("data_parallel_size must be 1 with multi-host serving (one engine spans the hosts).")
    if p.tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"with multi-host serving, tensor_parallel_size must equal the number of devices of all "
            f"processes ({jax.process_count()} processes, {jax.device_count()} devices); got "
            f"{p.tensor_parallel_size}."
        )
    if config.scheduler.preemption_mode == "swap":
        raise ValueError("preemption_mode='swap' is not supported with multi-host serving; use 'recompute'.")
    engine = LLMEngine(config)
    channel = BroadcastChannel()
    if jax.process_index() == 0:
        engine.multihost_leader = Leader(engine.runner, channel)
        return engine
    logger.info("process %d follows the leader's steps", jax.process_index())
    steps = follow(engine.runner, channel)
    logger.info("the leader stopped after %d steps; process %d exits", steps, jax.process_index())
    return None


def stop_followers(engine: Any) -> None:
    leader = getattr(engine, "multihost_leader", None)
    if leader is not None:
        leader.stop()
