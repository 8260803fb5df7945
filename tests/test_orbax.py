"""Orbax checkpoints (``jaxpaged convert``): bit-identical params and outputs, bf16, errors on
corrupt or partial checkpoints, and a restore sharded over 4 (virtual CPU) devices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxpaged import LLM, SamplingParams
from jaxpaged.cli import main as cli
from jaxpaged.weights import MODEL_CARD, load_checkpoint, load_orbax, resolve_model_path, save_orbax
from jaxpaged.models import registry
from jaxpaged.models.params import init_params
from jaxpaged.models.registry import build_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "Paged attention splits", "naïve café"]
SMALL = dict(num_gpu_blocks_override=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """``(HF dir, float32 orbax dir, bfloat16 orbax dir)``, converted through the CLI."""
    src, _ = tiny
    out = tmp_path_factory.mktemp("orbax")
    for dtype in ("float32", "bfloat16"):
        assert cli(["convert", "--model", str(src), "--output", str(out / dtype), "--dtype", dtype]) == 0
    return src, out / "float32", out / "bfloat16"


def reference_params(src: Path, dtype) -> dict:
    ckpt = load_checkpoint(str(src))
    return build_model(ckpt.config, ckpt.tensors, jnp.dtype(dtype), "xla").params


def assert_trees_identical(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_convert_writes_card_params_and_tokenizer(converted):
    src, f32, _ = converted
    card = json.loads((f32 / MODEL_CARD).read_text())
    assert card["architecture"] == "LlamaForCausalLM" and card["dtype"] == "float32"
    assert card["hf_config"]["hidden_size"] == 64 and card["jaxpaged_version"]
    assert card["params"]["layers_1/qkv_proj/kernel"] == {"shape": [64, 128], "dtype": "float32"}
    assert (f32 / "params").is_dir() and (f32 / "tokenizer.json").is_file()
    assert resolve_model_path(str(f32)) == f32
    assert cli(["convert", "--model", str(src), "--output", str(f32)]) == 2  # refuses a non-empty output


def test_load_is_bit_identical(converted):
    src, f32, _ = converted
    ckpt = load_checkpoint(str(f32))
    assert ckpt.format == "orbax" and ckpt.tensors == {}
    assert ckpt.config.to_dict() == load_checkpoint(str(src)).config.to_dict()
    assert_trees_identical(ckpt.params, reference_params(src, "float32"))
    assert all(
        a.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
        for a in jax.tree.leaves(ckpt.params)
    )


def generate(model: Path, **kw):
    llm = LLM(str(model), **SMALL, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    return llm, [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def test_llm_outputs_and_logprobs_identical(converted):
    src, f32, _ = converted
    _, ref = generate(src)
    _, got = generate(f32)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert [{t: lp.logprob for t, lp in d.items()} for d in a.logprobs] == [
            {t: lp.logprob for t, lp in d.items()} for d in b.logprobs
        ]


def test_bf16_convert_loads_as_bf16(converted):
    src, _, bf16 = converted
    assert json.loads((bf16 / MODEL_CARD).read_text())["dtype"] == "bfloat16"
    assert_trees_identical(load_orbax(bf16).params, reference_params(src, "bfloat16"))
    # The engine's dtype decides: a float32 engine gets the bf16 values upcast while reading.
    up = load_orbax(bf16, dtype=jnp.float32).params
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(up))
    llm, got = generate(bf16, dtype="bfloat16")
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(llm.engine.runner.model.params))
    assert [o.token_ids for o in got] == [o.token_ids for o in generate(src, dtype="bfloat16")[1]]


@pytest.mark.parametrize(
    "config",
    [
        transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        transformers.OPTConfig(
            vocab_size=96,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=16,
            do_layer_norm_before=False,
        ),
    ],
    ids=["gpt2", "opt_project_post_ln"],
)
def test_other_families_round_trip(config, tmp_path):
    """Their configs (GPT-2's attribute aliases, OPT's projections) survive the card's JSON."""
    config.architectures = [{"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM"}[config.model_type]]
    params = init_params(registry.config_from_hf(config)[1], jnp.float32)
    ckpt = load_orbax(save_orbax(tmp_path, params, config))
    assert type(ckpt.config) is type(config) and ckpt.config.to_dict() == config.to_dict()
    assert_trees_identical(ckpt.params, params)


# ---------------------------------------------------------------- corrupt or partial checkpoints


def _edit_card(d: Path, edit) -> None:
    card = json.loads((d / MODEL_CARD).read_text())
    edit(card)
    (d / MODEL_CARD).write_text(json.dumps(card))


def _wrong_stored_shape(d: Path) -> None:
    """Replace params/ by a save whose down_proj has another shape than card and config say."""
    ckpt = load_orbax(d)
    ckpt.params["layers_0"]["down_proj"]["kernel"] = jnp.zeros((100, 64), jnp.float32)
    save_orbax(d / "other", ckpt.params, ckpt.config)
    shutil.rmtree(d / "params")
    (d / "other" / "params").rename(d / "params")


QKV_DATA = Path("params", "layers_0.qkv_proj.kernel", "0.0")  # the one chunk of that array


def _claim_compressed(d: Path) -> None:
    """The array's metadata says zstd, its data is raw: only orbax's read can find out."""
    zarray = d / QKV_DATA.parent / ".zarray"
    zarray.write_text(zarray.read_text().replace('"compressor":null', '"compressor":{"id":"zstd","level":1}'))


CORRUPTIONS = {
    "missing card": (lambda d: (d / MODEL_CARD).unlink(), "model card jaxpaged_model.json is missing"),
    "card not JSON": (lambda d: (d / MODEL_CARD).write_text("{"), "not valid JSON"),
    "missing params dir": (lambda d: shutil.rmtree(d / "params"), "params/ is missing"),
    "missing orbax metadata": (lambda d: (d / "params" / "_METADATA").unlink(), "no array metadata"),
    "missing data file": (
        lambda d: (d / QKV_DATA).unlink(),
        "data file layers_0.qkv_proj.kernel/0.0 is missing",
    ),
    "truncated data file": (
        lambda d: (d / QKV_DATA).write_bytes(b"\0" * 100),
        "data file layers_0.qkv_proj.kernel/0.0 is 100 bytes, expected 32768",
    ),
    "undecodable data file": (_claim_compressed, "restoring the params failed.*layers_0.qkv_proj.kernel/0.0"),
    "card shape vs config": (
        lambda d: _edit_card(d, lambda c: c["params"]["norm/weight"].update(shape=[65])),
        "'norm/weight' is float32\\[65\\] in the model card, but float32\\[64\\] in the Llama",
    ),
    "stored shape vs card": (
        _wrong_stored_shape,
        "'layers_0/down_proj/kernel' is float32\\[100, 64\\] in the "
        "orbax files, but float32\\[128, 64\\] in the model card",
    ),
    "config vs card shapes": (
        lambda d: _edit_card(d, lambda c: c["hf_config"].update(intermediate_size=96)),
        "'layers_0/.*' is .* in the model card, but .* model of its hf_config",
    ),
    "unsupported architecture": (
        lambda d: _edit_card(d, lambda c: c.update(architecture="FooForCausalLM")),
        "'FooForCausalLM', which this jaxpaged does not support",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_checkpoint_raises_clear_value_error(case, converted, tmp_path):
    corrupt, message = CORRUPTIONS[case]
    d = shutil.copytree(converted[1], tmp_path / "ckpt")
    corrupt(d)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(d))


def test_a_failed_restore_waits_for_orbaxs_stray_reads_by_the_clock(converted, tmp_path, monkeypatch):
    """After a failed restore the loader collects orbax's pending reads for up to 2 s of the clock, however
    slow each collection is (in a test session's large heap one took seconds, and 200 rounds took minutes)."""
    from jaxpaged.weights import orbax_checkpoint

    class Clock:
        now = 0.0

        def monotonic(self):
            self.now += 0.5  # every look at the clock: half a second later
            return self.now

        def sleep(self, seconds):
            pass

    collections = []
    monkeypatch.setattr(orbax_checkpoint, "time", Clock())
    monkeypatch.setattr(orbax_checkpoint.gc, "collect", lambda: collections.append(1))
    monkeypatch.setattr(orbax_checkpoint, "_is_orbax_read", lambda obj: True)  # never let go
    d = shutil.copytree(converted[1], tmp_path / "ckpt")
    _claim_compressed(d)
    with pytest.raises(ValueError, match="restoring the params failed"):
        load_checkpoint(str(d))
    assert 3 <= len(collections) <= 5  # 2 s of a clock that moves 0.5 s a look


def test_llm_reports_corrupt_checkpoint(converted, tmp_path):
    d = shutil.copytree(converted[1], tmp_path / "ckpt")
    (d / "params" / "_METADATA").unlink()
    with pytest.raises(ValueError, match="orbax checkpoint has no array metadata"):
        LLM(str(d), **SMALL)


# ---------------------------------------------------------------- sharded restore

SHARDED = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxpaged.weights import abstract_params, load_orbax

    path = sys.argv[1]
    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    def spec(a):   # kernels split on their last (output) axis, the embedding on its vocab rows
        if a.ndim == 1 or a.shape[-1] % 4:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P("tp", None) if a.ndim == 2 and a.shape[0] == 384 else
                             P(*[None] * (a.ndim - 1), "tp"))
    shardings = jax.tree.map(spec, abstract_params(path))
    sharded = load_orbax(path, shardings=shardings).params
    single = load_orbax(path).params
    for (k, a), b, s in zip(jax.tree_util.tree_leaves_with_path(sharded), jax.tree.leaves(single),
                            jax.tree.leaves(shardings)):
        assert a.sharding == s, k
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        want = tuple(d // 4 if p == "tp" else d for d, p in zip(a.shape, tuple(s.spec) + (None,) * a.ndim))
        assert len(a.addressable_shards) == 4
        assert all(sh.data.shape == want for sh in a.addressable_shards), (k, want)
    print(sharded["lm_head"]["kernel"].addressable_shards[0].data.shape,
          sharded["embed_tokens"]["embedding"].addressable_shards[0].data.shape,
          sharded["layers_0"]["qkv_proj"]["kernel"].addressable_shards[0].data.shape)
""")


def test_sharded_restore_on_4_devices(converted):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED, str(converted[1])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "(64, 96) (96, 64) (64, 32)"
