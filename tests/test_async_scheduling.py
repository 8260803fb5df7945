"""Async scheduling (step k+1 launched before step k's tokens are taken in), the runner's
persistent batch, and output kinds: none of them may change what a request produces."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from jaxpaged.request import Request
from jaxpaged.step_programs import packed_inputs
from tiny_models import random_prompts


def _engine(path, **kw) -> LLMEngine:
    args = dict(
        model=str(path), block_size=4, max_num_batched_tokens=16, max_num_seqs=6, num_gpu_blocks_override=40
    )
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **kw}))


def _workload(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy and seeded requests; stop ids and stop strings that end some early (so the async engine
    has computed a token it must drop); n = 2; a shared prefix; prompts longer than the step budget."""
    rng = np.random.default_rng(7)
    shared = rng.integers(3, vocab, 10).tolist()
    prompts = random_prompts(rng, [3, 30, 12, 7, 21, 5, 16, 9])
    prompts[0] = shared + prompts[0]  # the first and the last request: the first is computed by then
    prompts[7] = shared + prompts[7]
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=15, stop_token_ids=[int(t) for t in range(3, vocab, 7)]),
        SamplingParams(temperature=0.9, seed=5, max_tokens=13, stop=["a", "e"], ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, max_tokens=9, n=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True, top_k=5),
        SamplingParams(temperature=0.0, max_tokens=10),
    ]
    return [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]


def _run(engine: LLMEngine, workload) -> dict[str, list]:
    for rid, prompt, sp in workload:
        engine.add_request(rid, prompt, sp)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [
                    (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob)
                    for c in out.outputs
                ]
    assert engine.kv_cache_manager.num_free_blocks == engine.cache_info.num_usable_blocks
    return final


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_async_and_sync_scheduling_produce_the_same_outputs(tiny, preemption_mode):
    """Under chunked prefill, prefix hits, forks and a pool small enough to preempt."""
    path, hf = tiny
    workload = _workload(hf.config.vocab_size)
    kw = dict(preemption_mode=preemption_mode, swap_space=2**-10, num_gpu_blocks_override=20)
    sync_engine, async_engine = _engine(path, async_scheduling=False, **kw), _engine(path, **kw)
    want, got = _run(sync_engine, workload), _run(async_engine, workload)
    assert async_engine.scheduler.num_preemptions > 0 and async_engine.kv_cache_manager.stats.hits > 0
    assert set(got) == {rid for rid, _, _ in workload}
    for rid in want:
        for (w_ids, w_text, w_reason, w_stop, w_lp), (g_ids, g_text, g_reason, g_stop, g_lp) in zip(
            want[rid], got[rid]
        ):
            assert (g_ids, g_text, g_reason, g_stop) == (w_ids, w_text, w_reason, w_stop), rid
            assert g_lp == pytest.approx(w_lp, abs=1e-4), rid
    # Requests stopped by a token or a string before max_tokens were among them.
    assert any(
        r[0][2] == "stop" and len(r[0][0]) < sp.max_tokens
        for (rid, _, sp), r in zip(workload, (got[rid] for rid, _, _ in workload))
    )


def _launch_order(engine: LLMEngine) -> list[str]:
    """Record the order in which the engine launches and collects steps."""
    events = []
    launch, collect = engine.runner.launch, engine.runner.collect

    def logged_launch(out):
        step = launch(out)
        if step is not None:
            events.append("launch")
        return step

    def logged_collect(step):
        events.append("collect")
        return collect(step)

    engine.runner.launch, engine.runner.collect = logged_launch, logged_collect
    return events


def test_async_engine_launches_the_next_step_before_taking_in_the_last(tiny):
    path, _ = tiny
    engine = _engine(path)
    events = _launch_order(engine)
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # Each step is launched before the previous one is collected; the last call only takes one in.
    n = events.count("launch")
    assert n == 6 and events == ["launch"] + ["launch", "collect"] * (n - 1) + ["collect"]


def test_penalties_make_steps_synchronous(tiny):
    """Penalties count the previous step's token on the host, so those steps alternate launch/collect,
    and the output equals the synchronous engine's."""
    path, _ = tiny
    sp = SamplingParams(temperature=0.0, max_tokens=8, frequency_penalty=1.5, ignore_eos=True)
    outs = []
    for async_scheduling in (True, False):
        engine = _engine(path, async_scheduling=async_scheduling)
        events = _launch_order(engine)
        engine.add_request("p", [9, 8, 7, 6], sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs.append(out.outputs[0].token_ids)
        assert events == ["launch", "collect"] * (len(events) // 2)
    assert outs[0] == outs[1]


def test_abort_while_a_step_is_in_flight_frees_everything(tiny):
    path, _ = tiny
    engine = _engine(path)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("x", [3, 4, 5, 6], sp)
    engine.add_request("y", [7, 8, 9], sp)
    while not engine.step():
        pass
    engine.abort_request("x")  # its next step is already on the device
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert "x" not in finished and len(finished["y"].outputs[0].token_ids) == 20
    assert engine.kv_cache_manager.num_free_blocks == engine.cache_info.num_usable_blocks
    engine.step()  # hands the last finished ids to the runner
    assert len(engine.runner.slots) == 0


def test_persistent_block_tables_follow_the_requests(tiny):
    """Once each step's table writes are taken, every scheduled sequence's device row holds exactly its
    block table, through growth, prefix hits, forks with copy-on-write, preemption and swap (the
    writes replayed here into a numpy copy of the device tables)."""
    path, hf = tiny
    engine = _engine(path, preemption_mode="swap", swap_space=2**-14, num_gpu_blocks_override=24)
    prepare, slots, table = engine.runner.prepare, engine.runner.slots, engine.runner.block_table
    take = table.take_writes
    device = np.zeros(np.shape(table.tables), np.int32)
    scheduled, checked = [], []

    def recorded_prepare(out):
        scheduled[:] = [(r, list(r.block_ids)) for r in out.requests]  # prepare takes the writes
        batch = prepare(out)
        for r in out.requests + [c for _, c in out.forks]:  # a fork's child runs from the next step
            assert table.num_blocks[slots.slot(r)] == len(r.block_ids), r.request_id
        return batch

    def checked_take():
        writes = take()
        if writes is not None:
            device[writes[0], writes[1]] = writes[2]
        for r, blocks in scheduled:
            assert device[table.device_row[slots.slot(r)], : len(blocks)].tolist() == blocks, r.request_id
        checked.append(len(scheduled))
        return writes

    engine.runner.prepare, table.take_writes = recorded_prepare, checked_take
    _run(engine, _workload(hf.config.vocab_size))
    assert engine.scheduler.num_swapped_out > 0 and len(checked) > 20


@pytest.mark.parametrize("num_blocks,num_steps", [(14, 1), (40, 1), (80, 4)])
def test_steady_decode_steps_build_the_batch_the_full_preparation_builds(tiny, num_blocks, num_steps):
    """A decode step of the same sequences as the step before, all tokens in flight, is prepared
    from that step's batch (``_next_steady_batch``); every array it feeds the device equals what the
    full preparation builds for the same step, through block openings, rows that finish (other
    sequences), preemption and admissions (full steps; with 14 blocks), and the engines' outputs are
    the same. With 40 (80) blocks nothing is preempted: after the first sequence in the batch ends, the
    others sample at lower rows than in the step before, then run steady. With 4 scheduler steps
    the steady batches are multi-step groups (single steps run while prompts are computed)."""
    path, hf = tiny
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, [5, 9, 3, 14, 7, 11])
    # With several steps a group, longer outputs: the same rows repeat in whole groups between the
    # group that ends a sequence (fewer steps for it: the rows are reordered) and the next.
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            ignore_eos=True,
            max_tokens=(6 + 5 * i) if num_steps == 1 else 20 + 8 * i,
        )
        for i in range(len(prompts))
    ]
    workload = [(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    def leaves(b):
        import jax

        return [
            np.asarray(x)
            for x in jax.tree_util.tree_leaves(
                (
                    b.input_ids,
                    b.positions,
                    b.token_rows,
                    b.md,
                    b.table_rows,
                    b.logits_indices,
                    b.prev_index,
                    b.sampling,
                )
            )
        ]

    engine = _engine(path, num_gpu_blocks_override=num_blocks, num_scheduler_steps=num_steps)
    runner = engine.runner
    full_prepare, next_steady = type(runner).prepare, runner.batches._next_steady_batch
    steady, groups = [], []

    def counted_next_steady(*args):
        steady.append(True)
        return next_steady(*args)

    def compared_prepare(out):
        # The full preparation on a copy of the state it reads and changes, then the real one.
        state = {
            o: {k: v.copy() if isinstance(v, (np.ndarray, dict, list)) else v for k, v in vars(o).items()}
            for o in (runner.slots, runner.block_table)
        }
        kept, runner.batches._steady = runner.batches._steady, None
        want = full_prepare(runner, out)
        for o, saved in state.items():
            vars(o).update(saved)
        runner.batches._steady = kept
        got = full_prepare(runner, out)
        assert (got.table_width, got.flags, got.num_rows, got.num_steps) == (
            want.table_width,
            want.flags,
            want.num_rows,
            want.num_steps,
        )
        np.testing.assert_array_equal(
            *(np.asarray(b.row_steps if b.num_steps > 1 else 0) for b in (got, want))
        )
        groups.append(got.num_steps > 1)
        for g, w in zip(leaves(got), leaves(want), strict=True):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(
            np.concatenate([got.step_table_writes, *got.table_writes], axis=1),
            np.concatenate([want.step_table_writes, *want.table_writes], axis=1),
        )
        # What the device receives: the packed inputs (a steady batch advances the last one's).
        (got_packed, got_layout), (want_packed, want_layout) = (packed_inputs(b) for b in (got, want))
        assert got_layout == want_layout
        np.testing.assert_array_equal(got_packed, want_packed)
        return got

    def checked_run_batch(b):
        # A steady batch may skip registering its programs only if they are registered already.
        launched = type(runner).run_batch(runner, b)
        assert set(b.program_keys) <= runner.program_keys
        return launched

    runner.batches._next_steady_batch = counted_next_steady
    runner.prepare = compared_prepare
    runner.run_batch = checked_run_batch
    got = _run(engine, workload)
    assert len(steady) > 10 / num_steps and (engine.scheduler.num_preemptions > 0) == (num_blocks == 14)
    assert any(groups) == (num_steps > 1)
    assert got == _run(_engine(path, num_gpu_blocks_override=num_blocks, async_scheduling=False), workload)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_each_token_is_written_at_the_slot_its_requests_block_table_gives(tiny, preemption_mode):
    """The host sends each token's row, not its KV slot: the step program looks the slot up in the row's
    device block table at the token's position. Over chunked prefill, prefix hits, forks (copy on write),
    preemption and steady decode steps (which advance the last step's inputs and send no slots at all),
    every token's slot is the one its request's own block table gives, and padding tokens write nothing."""
    import jax

    from jaxpaged import step_programs
    from jaxpaged.kernels import PAD_SLOT

    path, hf = tiny
    engine = _engine(path, preemption_mode=preemption_mode, swap_space=2**-10, num_gpu_blocks_override=20)
    runner, bs = engine.runner, engine.cache_info.block_size
    unpack = jax.jit(step_programs.unpack_inputs, static_argnums=(1, 3))
    prepare, forward, next_steady = runner.prepare, runner.forward, runner.batches._next_steady_batch
    tables, steady, checked = {}, [], []

    def recorded_prepare(out):
        b = prepare(out)
        tables[id(b)] = [list(r.block_ids) for r in out.requests]
        return b

    def counted_next_steady(*args):
        steady.append(True)
        return next_steady(*args)

    def checked_forward(b):
        packed, layout = step_programs.packed_inputs(b)
        md = unpack(packed, layout, jax.numpy.array(runner.block_table.tables), bs)[2]
        want = [
            PAD_SLOT if r < 0 else tables[id(b)][r][p // bs] * bs + p % bs
            for r, p in zip(b.token_rows.tolist(), b.positions.tolist())
        ]
        assert b.md.slot_mapping is None and np.asarray(md.slot_mapping).tolist() == want
        checked.append((b.token_rows >= 0).sum())
        return forward(b)

    runner.prepare, runner.forward, runner.batches._next_steady_batch = (
        recorded_prepare,
        checked_forward,
        counted_next_steady,
    )
    _run(engine, _workload(hf.config.vocab_size))
    assert len(steady) > 5 and max(checked) > len(steady) and engine.scheduler.num_preemptions > 0


def test_step_fn_writes_each_token_at_the_slot_its_rows_block_table_gives(tiny):
    """``step_fn`` (the forward alone, given the rows' block tables) takes each token's row from the
    query starts: the K/V it writes land exactly in the slots the rows' tables give at the tokens'
    positions (a prompt chunk, a decode token, a chunk crossing into a second block), and the padding
    tokens after them write nothing."""
    import jax.numpy as jnp

    from jaxpaged.step_programs import step_fn
    from jaxpaged.kernels import AttentionMetadata, build_prefill_tiles

    path, _ = tiny
    runner = _engine(path, max_num_seqs=4).runner
    bs, T, R = runner.block_size, 16, 4
    tables = np.zeros((R, runner.max_blocks_per_seq), np.int32)
    tables[0, :2], tables[1, :3], tables[2, :2] = [3, 9], [5, 12, 30], [20, 7]
    spans = [(0, 5), (9, 1), (2, 4)]  # (first position, tokens) of rows 0-2; row 3 is padding
    positions = np.zeros(T, np.int32)
    qsl = np.full(R + 1, sum(n for _, n in spans), np.int32)
    qsl[0] = 0
    for r, (p, n) in enumerate(spans):
        qsl[r + 1] = qsl[r] + n
        positions[qsl[r] : qsl[r + 1]] = np.arange(p, p + n)
    if runner.gathers_pages:
        tile = 16
        tile_arrays = build_prefill_tiles(qsl, tile, 4)
    else:
        tile, tile_arrays = 1, (np.zeros(0, np.int32),) * 3
    seq_lens = np.array([p + n for p, n in spans] + [0], np.int32)
    md = AttentionMetadata(None, tables, seq_lens, qsl, *tile_arrays, tile)
    kv, _ = step_fn(
        runner.model.module,
        runner.model.params,
        jnp.zeros_like(runner.kv_pages),
        np.arange(3, 3 + T, dtype=np.int32),
        positions,
        md,
        qsl[1:] - 1,
    )
    kv = np.asarray(kv)  # [layer, K/V, block, offset, head, dim]
    written = {b * bs + o for b, o in zip(*np.nonzero(np.abs(kv).sum(axis=(0, 1, 4, 5))))}
    want = {int(tables[r, q // bs]) * bs + q % bs for r, (p, n) in enumerate(spans) for q in range(p, p + n)}
    assert written == want


def test_steady_steps_register_a_new_context_bucket(tiny):
    """A steady decode step whose sequences grow into the next context bucket (the XLA attention
    backend reads a power-of-two number of block-table columns, from 256 tokens' worth, or all) uses
    another forward program: it is registered (counted) like any other, and the outputs match the
    synchronous engine's."""
    path, _ = tiny
    workload = [("long", [5, 9, 11, 3], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))]
    engine = _engine(path, num_gpu_blocks_override=80, attention_backend="xla")
    runner = engine.runner
    widths = []

    def checked_run_batch(b):
        launched = type(runner).run_batch(runner, b)
        assert set(b.program_keys) <= runner.program_keys
        widths.append((b.table_width, runner.batches._steady is not None and runner.batches._steady[1] is b))
        return launched

    runner.run_batch = checked_run_batch
    got = _run(engine, workload)
    steady_widths = [w for w, steady in widths if steady]
    assert len(set(steady_widths)) > 1
    assert got == _run(
        _engine(path, num_gpu_blocks_override=80, attention_backend="xla", async_scheduling=False), workload
    )


def test_output_kinds(tiny):
    """DELTA outputs add up to the CUMULATIVE ones; FINAL_ONLY yields only the finished output."""
    path, _ = tiny
    engine = _engine(path)
    prompt = [11, 12, 13, 14, 15]
    outs = {}
    for kind in RequestOutputKind:
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1, output_kind=kind)
        engine.add_request(kind.name, prompt, sp)
        outs[kind.name] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    cumulative, delta, final = outs["CUMULATIVE"], outs["DELTA"], outs["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished and len(cumulative) == len(delta) > 1
    full = cumulative[-1].outputs[0]
    assert "".join(o.outputs[0].text for o in delta) == full.text == final[0].outputs[0].text
    assert sum((o.outputs[0].token_ids for o in delta), []) == full.token_ids == final[0].outputs[0].token_ids
    assert sum((o.outputs[0].logprobs for o in delta), []) == full.logprobs
    assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 13))


def test_cumulative_logprob_adds_each_logprob_once_in_order():
    """Read between appends or only at the end, the sum is the logprobs added up in order."""
    rng = np.random.default_rng(1)
    values = (-rng.exponential(size=200)).tolist()
    req = Request(
        request_id="r",
        prompt_token_ids=[1, 2],
        sampling_params=SamplingParams(logprobs=0),
        max_tokens=200,
        seed=0,
    )
    once = Request(
        request_id="s",
        prompt_token_ids=[1, 2],
        sampling_params=SamplingParams(logprobs=0),
        max_tokens=200,
        seed=0,
    )
    expected, seen = 0.0, []
    for i, v in enumerate(values):
        req.output_logprobs.append(v)
        expected += v
        if i % 7 in (0, 3):
            seen.append(req.cumulative_logprob == expected)
    once.output_logprobs.extend(values)
    assert all(seen) and len(seen) > 50
    assert req.cumulative_logprob == once.cumulative_logprob == expected
    assert expected == pytest.approx(sum(values), abs=1e-9)


def test_output_kind_is_validated():
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="final")
