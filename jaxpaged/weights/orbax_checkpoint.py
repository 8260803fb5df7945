"""jaxpaged's own checkpoint: the Flax param tree in orbax, a model card, and the tokenizer.

``jaxpaged convert`` writes, from an HF directory or a GGUF::

    DIR/jaxpaged_model.json   model card: architecture, HF config, dtype, jaxpaged version,
                              every param's shape and dtype (written last: no card = incomplete)
    DIR/params/               orbax-checkpoint of the param tree (already fused, cast)
    DIR/tokenizer*.json ...   an HF tokenizer directory's files

Loading skips everything the other formats do on the host (dequantizing, renaming,
transposing, casting): orbax reads each array straight into its target sharding.
Before orbax reads any data the card is checked against the model of its own config and
against orbax's metadata, and every data file's size against its array's; orbax's own errors
are translated too: a corrupt or partial checkpoint fails with a ValueError saying what is wrong.
"""

from __future__ import annotations

import gc
import importlib.metadata
import itertools
import json
import math
import pathlib
import sys
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import transformers
from flax import traverse_util

from jaxpaged.math_utils import cdiv
from jaxpaged.models.params import param_shapes
from jaxpaged.models.registry import config_from_hf, supported_architectures
from jaxpaged.weights.resolve import MODEL_CARD, ORBAX_PARAMS_DIR, Checkpoint

FORMAT = "jaxpaged-orbax"
FORMAT_VERSION = 1
_CHUNK_BYTES = 32 * 2**20
_CARD_KEYS = ("format", "format_version", "architecture", "hf_config", "dtype", "params")


def _flat(tree: Any) -> dict[str, Any]:
    """``{"layers_0": {"qkv_proj": {"kernel": x}}}`` -> ``{"layers_0/qkv_proj/kernel": x}``."""
    return traverse_util.flatten_dict(tree, sep="/")


def _version() -> str:
    try:
        return importlib.metadata.version("jaxpaged")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------- the model card


def read_model_card(path: str | pathlib.Path) -> dict:
    """The checkpoint's model card, checked for form (not yet against the config or the files)."""
    file = pathlib.Path(path) / MODEL_CARD
    if not file.is_file():
        raise ValueError(
            f"{path} is not a complete jaxpaged orbax checkpoint: its model card {MODEL_CARD} is "
            "missing (an interrupted `jaxpaged convert`?). Convert the model again."
        )
    try:
        card = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: the model card is not valid JSON ({e}).") from None
    missing = [k for k in _CARD_KEYS if not isinstance(card, dict) or k not in card]
    if missing:
        raise ValueError(f"{file}: the model card lacks {missing}.")
    if card["format"] != FORMAT or card["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{file}: format {card['format']!r} version {card['format_version']!r}; this jaxpaged "
            f"reads {FORMAT!r} version {FORMAT_VERSION}."
        )
    return card


def _card_config(card: dict, where: pathlib.Path) -> transformers.PretrainedConfig:
    """The HF config the card holds, with the card's architecture (checked to be supported)."""
    arch = card["architecture"]
    if arch not in supported_architectures():
        raise ValueError(
            f"{where}: the model card names architecture {arch!r}, which this jaxpaged does not "
            f"support; supported: {supported_architectures()}."
        )
    try:
        config = transformers.AutoConfig.for_model(**card["hf_config"])
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(
            f"{where}: the model card's hf_config is not a valid transformers config ({e})."
        ) from None
    config.architectures = [arch]
    return config


def expected_params(hf_config: Any, dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """Every param the model of ``hf_config`` has, flat, as shapes and dtypes (traced, nothing computed)."""
    cfg = config_from_hf(hf_config)[1]
    return _flat(param_shapes(cfg, dtype))


def _card_params(card: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name: (tuple(info["shape"]), info["dtype"]) for name, info in card["params"].items()}


def _match(where: pathlib.Path, have: dict, want: dict, have_is: str, want_is: str) -> None:
    """Two param lists (name -> (shape, dtype)) must agree; the first difference is the error."""
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise ValueError(
            f"{where}: the params {have_is} differ from those {want_is}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}."
        )
    for name, (shape, dtype) in want.items():
        if have[name] != (shape, dtype):
            raise ValueError(
                f"{where}: param {name!r} is {have[name][1]}{list(have[name][0])} {have_is}, but "
                f"{dtype}{list(shape)} {want_is}."
            )


def _check_card_params(card: dict, config: Any, where: pathlib.Path) -> None:
    """The card's param list against what the config's model needs: same names, shapes, dtype."""
    expected = expected_params(config, jnp.dtype(card["dtype"]))
    _match(
        where,
        _card_params(card),
        {k: (a.shape, card["dtype"]) for k, a in expected.items()},
        "in the model card",
        f"in the {card['architecture']} model of its hf_config",
    )


# ---------------------------------------------------------------- reading


def _reason(error: BaseException) -> str:
    """The innermost cause of an orbax error, which names the array and file (orbax's own message
    is a page of TensorStore spec), shortened."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    text = str(error).split(" See full TensorStore details")[0]
    return f"{type(error).__name__}: {text[:400]}"


def _orbax_tree(params_dir: pathlib.Path) -> dict[str, Any]:
    """The stored arrays' metadata (shape, dtype), flat, from orbax's own metadata files."""
    import orbax.checkpoint as ocp

    if not params_dir.is_dir():
        raise ValueError(
            f"{params_dir.parent}: the orbax params directory {ORBAX_PARAMS_DIR}/ is missing; "
            "the checkpoint is incomplete. Convert the model again."
        )
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = getattr(ckptr.metadata(params_dir).item_metadata, "tree", None)
    except Exception as e:  # orbax raises many kinds; the message says which checkpoint failed
        raise ValueError(
            f"{params_dir}: cannot read the orbax checkpoint's metadata ({_reason(e)}); "
            "the checkpoint is corrupt or incomplete. Convert the model again."
        ) from e
    if not isinstance(tree, dict):
        raise ValueError(
            f"{params_dir}: the orbax checkpoint has no array metadata (its _METADATA file or an "
            "array's .zarray is missing or damaged); the checkpoint is corrupt or incomplete. "
            "Convert the model again."
        )
    return _flat(tree)


def _check_stored(card: dict, stored: dict[str, Any], where: pathlib.Path) -> None:
    """What orbax holds against the card: same names, shapes and dtypes."""
    have = {
        k: (tuple(getattr(m, "shape", ())), str(jnp.dtype(getattr(m, "dtype", "float32"))))
        for k, m in stored.items()
    }
    _match(where, have, _card_params(card), "in the orbax files", "in the model card")


def _check_data_files(params_dir: pathlib.Path, names: list[str]) -> None:
    """Every chunk file of every array is there with its exact size (for uncompressed zarr arrays, as
    ``save_orbax`` writes them): a missing or truncated file is named before orbax reads anything."""
    for name in names:
        array_dir = params_dir / name.replace("/", ".")
        try:
            meta = json.loads((array_dir / ".zarray").read_text())
            chunks, shape, sep = meta["chunks"], meta["shape"], meta.get("dimension_separator", ".")
            nbytes = math.prod(chunks) * jnp.dtype(meta["dtype"]).itemsize
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a zarr array as we write them: the restore reports what is wrong
        if meta.get("compressor") is not None:
            continue
        for index in itertools.product(*(range(cdiv(n, c)) for n, c in zip(shape, chunks))):
            file = array_dir / (sep.join(map(str, index)) or "0")
            size = file.stat().st_size if file.is_file() else None
            if size != nbytes:
                raise ValueError(
                    f"{params_dir}: data file {file.relative_to(params_dir)} is "
                    f"{'missing' if size is None else f'{size} bytes, expected {nbytes}'}; the "
                    "checkpoint is corrupt or incomplete. Convert the model again."
                )


def abstract_params(path: str | pathlib.Path, shardings: Any = None, dtype: Any = None) -> Any:
    """The param tree of a checkpoint as ``jax.ShapeDtypeStruct`` leaves, from its model card.

    ``shardings``: None (one device), one ``jax.sharding.Sharding`` for every param, or a pytree
    of shardings with the param tree's structure. ``dtype``: None keeps the stored dtype.
    """
    card = read_model_card(path)
    flat = {
        name: jax.ShapeDtypeStruct(tuple(info["shape"]), jnp.dtype(dtype or info["dtype"]))
        for name, info in card["params"].items()
    }
    tree = traverse_util.unflatten_dict(flat, sep="/")
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings), tree)
    try:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
    except ValueError as e:
        raise ValueError(
            f"shardings must be one Sharding or a pytree matching the checkpoint's param tree "
            f"({', '.join(sorted(card['params']))[:300]}): {e}"
        ) from None


def _restore(params_dir: pathlib.Path, target: Any) -> Any:
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(params_dir, target)
    except Exception as e:  # a missing or truncated data file surfaces here, as a tensorstore error
        reason = _reason(e)
    # orbax leaves the failed restore's other reads as pending coroutines, each printing a traceback
    # when collected (once tensorstore lets go of them): drop them quietly, here, waiting up to 2 s. By the
    # clock, not by rounds: in a large heap one collection and scan takes seconds (200 rounds took minutes).
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: None if _is_orbax_read(u.object) else hook(u)
    deadline = time.monotonic() + 2.0
    try:
        while True:
            gc.collect()
            if not any(_is_orbax_read(o) for o in gc.get_objects()) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        sys.unraisablehook = hook
    raise ValueError(
        f"{params_dir}: restoring the params failed ({reason}); the checkpoint's data files are "
        "corrupt or incomplete. Convert the model again."
    )


def _is_orbax_read(obj: Any) -> bool:
    return type(obj) is types.CoroutineType and obj.__qualname__ == "_read_array_index_and_device_put"


def load_orbax(path: str | pathlib.Path, shardings: Any = None, dtype: Any = None) -> Checkpoint:
    """Restore a ``jaxpaged convert`` checkpoint: ``Checkpoint.params`` is our param tree of jax arrays.

    Each array is read by orbax directly into its target sharding (``shardings``: None = the first
    device, one ``Sharding`` for all, or a pytree of them matching the param tree, e.g. per-param
    ``NamedSharding``s for tensor parallelism); ``dtype`` casts while reading (None = as stored).
    ``Checkpoint.tensors`` is empty: there are no HF-named tensors to map.
    """
    path = pathlib.Path(path)
    card = read_model_card(path)
    config = _card_config(card, path)
    _check_card_params(card, config, path)
    params_dir = path / ORBAX_PARAMS_DIR
    _check_stored(card, _orbax_tree(params_dir), path)
    _check_data_files(params_dir, list(card["params"]))
    params = _restore(params_dir, abstract_params(path, shardings, dtype))
    return Checkpoint(config=config, tensors={}, path=path, format="orbax", params=params)


# ---------------------------------------------------------------- writing


def _param_card(params: Any) -> dict[str, dict]:
    return {
        name: {"shape": list(a.shape), "dtype": str(jnp.dtype(a.dtype))} for name, a in _flat(params).items()
    }


def save_orbax(output: str | pathlib.Path, params: Any, hf_config: Any, source: str = "") -> pathlib.Path:
    """Write ``params`` (our param tree for ``hf_config``'s model) as orbax + model card into ``output``.

    The card is written last, after orbax has committed: a directory without one is incomplete.
    """
    import orbax.checkpoint as ocp

    output = pathlib.Path(output)
    dtypes = {str(jnp.dtype(a.dtype)) for a in jax.tree.leaves(params)}
    if len(dtypes) != 1:
        raise ValueError(f"params must all have one dtype; got {sorted(dtypes)}.")
    output.mkdir(parents=True, exist_ok=True)
    # Uncompressed, one zarr array per param in chunks of at most 32 MiB (read in parallel; a shard
    # reads only the chunks it overlaps), no OCDBT database: restoring SmolLM2 (float32) took 0.6 s this
    # way, 0.8 s in one chunk per param, 4.8 s with orbax's defaults (zstd, OCDBT; 2/3 of the disk space).
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES), params)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False)) as ckptr:
        ckptr.save(
            (output / ORBAX_PARAMS_DIR).absolute(), args=ocp.args.PyTreeSave(params, save_args=save_args)
        )
    card = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": config_from_hf(hf_config)[0],
        "dtype": dtypes.pop(),
        "jaxpaged_version": _version(),
        "source": source,
        "hf_config": json.loads(hf_config.to_json_string(use_diff=False)),
        "params": _param_card(params),
    }
    (output / MODEL_CARD).write_text(json.dumps(card, indent=1) + "\n")
    return output
