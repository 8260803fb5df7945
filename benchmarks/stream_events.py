"""The server's cost of one streamed event: a choice's new text as a server-sent event.

A streamed request gets one event per engine output (per step, while the client keeps up): at 256
streams, 256 events per step on the server's event loop, which shares the two cores with the
device step. Most events carry only text; the server writes those from a per-choice template
(``server.event_stream.TextDeltaEvents``), the others (role, logprobs, finish) through the pydantic
chunk models (``sse(chunk)``). This times both ways on the same chunks, chat and completion,
alternating rounds in one process, over texts that real tokens give (SmolLM2's tokens decoded
one at a time: words, spaces, punctuation, non-ASCII). Median microseconds per event.

``python -m benchmarks.stream_events [--rounds 7] [--events 20000]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import UNDER_LOAD, print_table, write_json
from jaxpaged.server.event_stream import TextDeltaEvents, sse
from jaxpaged.server.response_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)

_ID = "chatcmpl-" + "0123456789abcdef" * 2
_MODEL = "smollm2-135m-instruct"
CHUNKS = {
    "chat": lambda j, text: ChatCompletionChunk(
        id=_ID,
        created=1764000000,
        model=_MODEL,
        choices=[ChatChunkChoice(index=j, delta=DeltaMessage(content=text))],
    ),
    "completion": lambda j, text: CompletionResponse(
        id=_ID, created=1764000000, model=_MODEL, choices=[CompletionChoice(index=j, text=text)]
    ),
}


def token_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` texts of random SmolLM2 tokens decoded one by one (what a streamed delta usually holds)."""
    from jaxpaged.config import DEFAULT_MODEL
    from jaxpaged.tokenizer import Tokenizer
    from jaxpaged.weights.resolve import resolve_model_path

    tok = Tokenizer.load(resolve_model_path(DEFAULT_MODEL))
    ids = np.random.default_rng(seed).integers(0, tok.vocab_size, n).tolist()
    return [tok.decode([i]) or " " for i in ids]


def per_event_us(make_event, texts: list[str]) -> float:
    t = time.perf_counter()
    for text in texts:
        make_event(text)
    return 1e6 * (time.perf_counter() - t) / len(texts)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds of each way")
    ap.add_argument("--events", type=int, default=20000, help="events per round")
    args = ap.parse_args(argv)
    texts = token_texts(args.events)
    rows, result = [], {"args": vars(args), "note": UNDER_LOAD, "us_per_event": {}}
    for api, chunk in CHUNKS.items():
        template = TextDeltaEvents(chunk)
        ways = {
            "template": lambda text: template.event(0, text),
            "pydantic": lambda text: sse(chunk(0, text)),
        }
        if any(ways["template"](t) != ways["pydantic"](t) for t in texts[:1000]):
            raise RuntimeError(f"the {api} template's events differ from the pydantic dump")
        times: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(args.rounds):
            for way, fn in ways.items():
                times[way].append(per_event_us(fn, texts))
        med = {w: statistics.median(ts) for w, ts in times.items()}
        result["us_per_event"][api] = med
        rows.append([api, med["template"], med["pydantic"], med["pydantic"] / med["template"]])
    print(
        f"median us per streamed text event ({args.rounds} alternating rounds of {args.events}; {UNDER_LOAD})"
    )
    print_table(["chunk", "template", "pydantic", "ratio"], rows, widths=[12, 10, 10, 8])
    write_json("stream_events", result)
    return result


if __name__ == "__main__":
    main()
