"""Two concurrent token streams from one ``AsyncLLMEngine`` in a plain asyncio program (vLLM's async API).

    python examples/async_streams.py                       # SmolLM2-135M-Instruct, the default model
    python examples/async_streams.py --model DIR --max-tokens 32

Each stream prints its new text as it arrives, prefixed by its request id; the two interleave because
the engine batches them into the same steps.
"""

from __future__ import annotations

import argparse
import asyncio

from jaxpaged import AsyncEngineArgs, AsyncLLMEngine, RequestOutputKind, SamplingParams
from jaxpaged.config import DEFAULT_MODEL

PROMPTS = {"stream-a": "The three primary colors are", "stream-b": "A haiku about the sea:"}


async def stream(engine: AsyncLLMEngine, request_id: str, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    text = ""
    async for out in engine.generate(prompt, params, request_id):
        delta = out.outputs[0].text
        text += delta
        print(f"[{request_id}] {delta!r}", flush=True)
    return text


async def main(model: str, max_tokens: int) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, max_model_len=512))
    try:
        texts = await asyncio.gather(*(stream(engine, rid, p, max_tokens) for rid, p in PROMPTS.items()))
        for (rid, prompt), text in zip(PROMPTS.items(), texts):
            print(f"=== {rid}: {prompt!r} -> {text!r}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=24)
    ns = parser.parse_args()
    asyncio.run(main(ns.model, ns.max_tokens))
