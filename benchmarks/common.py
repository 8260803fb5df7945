"""Helpers shared by the benchmarks: results files, plots, percentiles, a tiny random model."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
COLD_BYTES = 96 << 20
"""What a benchmark cycles through to time an operand read from memory, as a model step reads it, rather
than from the last-level cache (3x the 32 MiB L3 of the largest one measured on)."""
UNDER_LOAD = (
    "timings measured on a shared 2-core CPU under load from other jobs: compare rows of one run, "
    "not runs of different days"
)


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
    return path


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, name: str) -> Path:
    import matplotlib.pyplot as plt

    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """``{"mean", "p50", "p90", ...}`` of ``values`` (linear interpolation); NaN when empty."""
    a = np.asarray(values, dtype=float)
    out = {"mean": float(a.mean()) if a.size else float("nan")}
    for p in ps:
        out[f"p{p:g}"] = float(np.percentile(a, p)) if a.size else float("nan")
    return out


def print_table(header: Sequence[str], rows: Sequence[Sequence], widths: Sequence[int] | None = None) -> None:
    """Right-aligned columns, one space apart even when a value overflows its width; floats with 3 decimals."""
    widths = widths or [max(10, len(h) + 2) for h in header]
    cell = lambda v, w: f"{v:>{w}.3f}" if isinstance(v, float) else f"{v!s:>{w}}"
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for row in rows:
        print(" ".join(cell(v, w) for v, w in zip(row, widths)))


def tiny_model_dir(
    vocab_size: int = 384, path: Path | None = None, max_positions: int = 512, **shape
) -> Path:
    """Save a random tiny Llama (2 layers, hidden 64, ``max_positions`` positions, ``LlamaConfig`` fields
    in ``shape`` overriding these) with the tests' byte-level BPE tokenizer, and return its directory.
    Needs torch (the ``test`` extra)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import save_tiny_llama, save_tokenizer

    path = Path(path or tempfile.mkdtemp(prefix="jaxpaged-tiny-"))
    tok, model = path / "tokenizer", path / "model"
    tok.mkdir(parents=True, exist_ok=True)
    model.mkdir(exist_ok=True)
    save_tokenizer(tok)
    save_tiny_llama(model, tok, vocab_size=vocab_size, max_position_embeddings=max_positions, **shape)
    return model


def resolve_model_arg(model: str, vocab_size: int = 384) -> str:
    """``tiny`` -> a freshly saved tiny random model's directory; anything else as given."""
    return str(tiny_model_dir(vocab_size)) if model == "tiny" else model
