"""``LLM``: the offline API (vLLM's ``LLM``): generate for a list of prompts, in input order."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from tqdm.auto import tqdm

from jaxpaged.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, beam_score
from jaxpaged.config import DEFAULT_MODEL, EngineArgs
from jaxpaged.engine import LLMEngine
from jaxpaged.prompts import PromptInput, parse_prompts
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.tokenizer import Tokenizer

Conversation = list[dict[str, str]]
_FAILED_SCORE = float("-inf")
"""The score of a beam whose search failed in the engine (finish reason "error"): below any real beam's."""


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

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` that ``generate`` and ``chat`` use when given none: vLLM's defaults, overridden
        by the model's generation_config.json (engine argument ``generation_config``), as in vLLM."""
        return self.engine.generation_defaults.sampling_params()

    def sharing_stats(self):
        """Blocks used vs. blocks without sharing, now (see ``LLMEngine.sharing_stats``)."""
        return self.engine.sharing_stats()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Prompts are strings, token-id lists or prompt dicts (``PromptInput``); returns one ``RequestOutput``
        per prompt, in order. Without ``sampling_params``, ``get_default_sampling_params()``.

        Every prompt is validated before any runs: one bad prompt raises ``ValueError``
        and nothing is generated.
        """
        prompts = parse_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                    "give one, or one per prompt."
                )
        # Only the final outputs are returned: the engine builds no per-step outputs (vLLM does the same).
        final = {id(sp): dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params}
        reqs = [
            self.engine.make_request(
                f"llm-{next(self._ids)}", p.prompt, final[id(sp)], cache_salt=p.cache_salt
            )
            for p, sp in zip(prompts, params)
        ]
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

    def beam_search(
        self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt (vLLM's ``LLM.beam_search``), with transformers' semantics for
        ``length_penalty`` and ``early_stopping``: one ``BeamSearchOutput`` per prompt, in order, each
        with ``beam_width`` sequences, best score first. Prompts are strings, token-id lists, or
        dicts with ``prompt`` / ``prompt_token_ids`` (and ``cache_salt``). The beams of a prompt share its KV blocks."""
        prompts = parse_prompts(prompts)
        added = []
        try:
            for p in prompts:
                added.append(
                    self.engine.add_beam_search_request(
                        f"llm-{next(self._ids)}", p.prompt, params, cache_salt=p.cache_salt
                    )
                )
        except ValueError:
            for r in added:
                self.engine.abort_request(r.request_id)
            raise
        results = []
        for out in self._run(added, use_tqdm):
            n = len(out.prompt_token_ids)
            results.append(
                BeamSearchOutput(
                    [
                        BeamSearchSequence(
                            tokens=out.prompt_token_ids + c.token_ids,
                            logprobs=c.logprobs,
                            cum_logprob=c.cumulative_logprob,
                            score=_FAILED_SCORE
                            if c.finish_reason == "error"
                            else beam_score(c.cumulative_logprob, len(c.token_ids), params.length_penalty),
                            text=c.text,
                            finish_reason=c.finish_reason,
                            num_prompt_tokens=n,
                        )
                        for c in out.outputs
                    ]
                )
            )
        return results

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (``chat_template``, Jinja text, as vLLM's; else the tokenizer's) to one
        conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(
                c, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            for c in convs
        ]
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
