"""The ``/v1/completions`` endpoint (``CompletionServing``): prompts -> engine requests -> a completion or
its server-sent events.

A completion with several prompts is one engine request per prompt; choice ``i * n + j`` is
prompt ``i``'s ``j``-th sample.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request as HTTPRequest

from jaxpaged.request import CompletionOutput, RequestOutput, TokenLogprobs
from jaxpaged.server.errors import APIError
from jaxpaged.server.event_stream import EventStream, TextDeltaEvents, framed, sse
from jaxpaged.server.request_models import CompletionRequest
from jaxpaged.server.response_models import CompletionChoice, CompletionLogprobs, CompletionResponse
from jaxpaged.server.serving_base import Job, ServingBase, random_id, run_until_disconnect


@dataclass
class _ChoiceState:
    """What has been sent of one choice so far."""

    started: bool = False
    text_offset: int = 0
    """Where the next token's text starts (the completions API's ``logprobs.text_offset``)."""


class CompletionServing(ServingBase):
    """``/v1/completions`` over the shared serving logic."""

    async def create_completion(
        self, body: CompletionRequest, raw: HTTPRequest
    ) -> CompletionResponse | EventStream:
        """The whole completion, or its event stream when ``body.stream``; the client leaving at any
        point, even while its prompts are tokenized or queued, aborts them all."""
        return await run_until_disconnect(raw, self._completion(body))

    async def _completion(self, body: CompletionRequest) -> CompletionResponse | EventStream:
        self.check_model(body.model)
        prompts = body.prompts
        if not prompts:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(
                400,
                "max_tokens may be 0 only with echo (to score the prompt); else at least 1.",
                param="max_tokens",
            )
        echo_logprobs = body.logprobs if body.echo else None
        # Echo only: one token is generated (the engine needs a step), then left out of the answer, as vLLM.
        sp = self._sampling_params(
            body,
            max_tokens=1 if body.echo_only else body.max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=echo_logprobs,
        )
        request_id = f"cmpl-{random_id()}"
        self._check_size(len(prompts), sp, body)
        requests = await self._off_loop(
            sum(map(len, prompts)), self._make_requests, request_id, prompts, sp, body, "prompt"
        )
        job = await self._submit(request_id, requests, sp)
        if body.stream:
            return EventStream(self._completion_events(job, body), functools.partial(self._end, job))
        await self._collect(job)
        choices = []
        for i in range(len(job.streams)):
            out = job.finals[i]
            for j, c in enumerate(out.outputs):
                text, logprobs = self._completion_piece(out, c, _ChoiceState(), body)
                choices.append(
                    CompletionChoice(
                        index=i * job.n + j,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    def _completion_events(self, job: Job, body: CompletionRequest) -> AsyncIterator[str]:
        created = int(time.time())
        usage = job.usage_chunk(body.include_usage_in_stream, created, CompletionResponse)
        return framed(self._completion_choices(job, body, created), usage)

    async def _completion_choices(
        self, job: Job, body: CompletionRequest, created: int
    ) -> AsyncIterator[str]:
        def chunk(
            index: int,
            text: str,
            logprobs: CompletionLogprobs | None = None,
            finish_reason: str | None = None,
            stop_reason: int | str | None = None,
        ) -> CompletionResponse:
            return CompletionResponse(
                id=job.request_id,
                created=created,
                model=job.model,
                choices=[
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                    )
                ],
                usage=job.usage if body.usage_on_every_chunk else None,
            )

        states: dict[int, _ChoiceState] = {}
        text_events = TextDeltaEvents(chunk)
        async with aclosing(self._merged(job)) as outputs:
            async for i, out in outputs:
                for j, c in enumerate(out.outputs):
                    index = i * job.n + j
                    text, logprobs = self._completion_piece(
                        out, c, states.setdefault(index, _ChoiceState()), body
                    )
                    if logprobs is None and c.finish_reason is None and not body.usage_on_every_chunk:
                        if text:
                            yield text_events.event(index, text)
                    elif text or (logprobs is not None and logprobs.tokens) or c.finish_reason is not None:
                        yield sse(chunk(index, text, logprobs, c.finish_reason, c.stop_reason))

    def _completion_piece(
        self, out: RequestOutput, c: CompletionOutput, state: _ChoiceState, body: CompletionRequest
    ) -> tuple[str, CompletionLogprobs | None]:
        """``c`` (a delta, or the whole output) as a choice's text and, if asked for, logprobs; the
        first piece starts with the prompt when ``echo``."""
        echo = body.echo and not state.started
        generated = not body.echo_only
        text = (self._prompt_text(out) if echo else "") + (c.text if generated else "")
        logprobs = None
        if body.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo:
                self._add_completion_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs, state)
            if generated:
                self._add_completion_logprobs(logprobs, c.token_ids, c.logprobs, state)
        state.started = True
        return text, logprobs

    def _add_completion_logprobs(
        self,
        logprobs: CompletionLogprobs,
        token_ids: Sequence[int],
        positions: Sequence[TokenLogprobs | None],
        state: _ChoiceState,
    ) -> None:
        """OpenAI's legacy format: per token its text, logprob, offset, and alternatives by text."""
        for token, entries in zip(token_ids, positions):
            if entries is None:  # the prompt's first token has no logprob
                text = self.engine.tokenizer.decode([token], skip_special_tokens=False)
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
            else:
                text = entries[token].decoded_token
                logprobs.token_logprobs.append(entries[token].logprob)
                top: dict[str, float] = {}
                for lp in sorted(entries.values(), key=lambda lp: lp.logprob, reverse=True):
                    top.setdefault(lp.decoded_token, lp.logprob)
                logprobs.top_logprobs.append(top)
            logprobs.tokens.append(text)
            logprobs.text_offset.append(state.text_offset)
            state.text_offset += len(text)

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.engine.tokenizer.decode(out.prompt_token_ids)
