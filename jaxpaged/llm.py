"""``LLM``: the offline API (vLLM's ``LLM``): generate for a list of prompts, in input order."""

from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from jaxpaged.config import DEFAULT_MODEL, EngineArgs
from jaxpaged.engine import LLMEngine
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.tokenizer import Tokenizer

PromptInput = str | Sequence[int]
Conversation = list[dict[str, str]]


class LLM:
    """Load a model once, then ``generate`` or ``chat`` over batches of prompts.

    Keyword arguments are the engine arguments of ``EngineArgs`` (``block_size``,
    ``max_num_seqs``, ``kv_cache_memory``, ``attention_backend``, ...).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts are strings or token-id lists; returns one ``RequestOutput`` per prompt, in order.

        Every prompt is validated before any runs: one bad prompt raises ``ValueError``
        and nothing is generated.
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                 "give one, or one per prompt.")
        reqs = [self.engine.make_request(f"llm-{next(self._ids)}", p, sp) for p, sp in zip(prompts, params)]
        added = []
        try:
            for r in reqs:
                self.engine.add_prepared_request(r)
                added.append(r)
        except ValueError:
            for r in added:
                self.engine.abort_request(r.request_id)
            raise
        return self._run(reqs, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, reqs, use_tqdm: bool) -> list[RequestOutput]:
        order = {r.request_id: i for i, r in enumerate(reqs)}
        results: list[RequestOutput | None] = [None] * len(reqs)
        with tqdm(total=len(reqs), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        return results
