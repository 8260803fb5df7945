"""The ``/v1/chat/completions`` endpoint (``ChatServing``): a conversation -> an engine request -> a chat
completion or its server-sent events, with tool calls parsed out of the text when tools are given."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from fastapi import Request as HTTPRequest

from jaxpaged.request import CompletionOutput, Request
from jaxpaged.server.chat_tools import ChoiceTools
from jaxpaged.server.errors import APIError
from jaxpaged.server.event_stream import EventStream, TextDeltaEvents, framed, sse
from jaxpaged.server.request_models import ChatCompletionRequest
from jaxpaged.server.response_models import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from jaxpaged.server.serving_base import Job, ServingBase, random_id, run_until_disconnect, text_size


def _joined(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    """One delta saying what ``first`` then ``second`` say."""
    if first is None or second is None:
        return first or second
    content = (
        None
        if first.content is None and second.content is None
        else (first.content or "") + (second.content or "")
    )
    return DeltaMessage(
        content=content, tool_calls=(first.tool_calls or []) + (second.tool_calls or []) or None
    )


class ChatServing(ServingBase):
    """``/v1/chat/completions`` over the shared serving logic."""

    async def create_chat_completion(
        self, body: ChatCompletionRequest, raw: HTTPRequest
    ) -> ChatCompletionResponse | EventStream:
        """The whole chat completion, or its event stream when ``body.stream``; the client leaving at
        any point aborts it."""
        return await run_until_disconnect(raw, self._chat_completion(body))

    async def _chat_completion(self, body: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        self.check_model(body.model)
        if body.effective_tool_choice == "auto" and self.tool_parser is None:
            raise APIError(
                400,
                '"auto" tool choice (the default with tools) needs the server started with '
                '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "none", '
                '"required" or a named function.',
                param="tool_choice",
            )
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # The tool parser reads tags that some tokenizers mark special, so they stay in the text (vLLM's rule).
        keep_tags = body.effective_tool_choice == "auto" and body.skip_special_tokens is None
        sp = self._sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=body.num_logprobs,
            **({"skip_special_tokens": False} if keep_tags else {}),
        )
        request_id = f"chatcmpl-{random_id()}"
        self._check_size(1, sp, body)

        def make() -> list[Request]:
            prompt = self.chat_prompt(
                body.messages, body.add_generation_prompt, body.chat_template_kwargs, body.tools
            )
            return self._make_requests(request_id, [prompt], sp, body, "messages")

        requests = await self._off_loop(text_size(body.messages), make)
        job = await self._submit(request_id, requests, sp)
        if body.stream:
            return EventStream(self._chat_events(job, body), functools.partial(self._end, job))
        await self._collect(job)
        choices = []
        for j, c in enumerate(job.finals[0].outputs):
            text, logprobs = self._chat_piece(c, body)
            message, finish_reason = ChatResponseMessage(content=text), c.finish_reason
            if body.effective_tool_choice != "none":
                tools = ChoiceTools(body, self.tool_parser)
                answer = tools.whole(text)
                message = ChatResponseMessage(content=answer.content, tool_calls=answer.tool_calls)
                finish_reason = tools.finish_reason(c.finish_reason)
            choices.append(
                ChatChoice(
                    index=j,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    def _chat_events(self, job: Job, body: ChatCompletionRequest) -> AsyncIterator[str]:
        created = int(time.time())
        usage = job.usage_chunk(body.include_usage_in_stream, created, ChatCompletionChunk)
        return framed(self._chat_choices(job, body, created), usage)

    async def _chat_choices(self, job: Job, body: ChatCompletionRequest, created: int) -> AsyncIterator[str]:
        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=job.request_id,
                created=created,
                model=job.model,
                choices=[choice],
                usage=job.usage if body.usage_on_every_chunk else None,
            )

        text_events = TextDeltaEvents(
            lambda j, text: chunk(ChatChunkChoice(index=j, delta=DeltaMessage(content=text)))
        )
        for j in range(job.n):
            yield sse(chunk(ChatChunkChoice(index=j, delta=DeltaMessage(role="assistant", content=""))))
        if body.effective_tool_choice != "none":
            async for event in self._tool_chat_choices(job, body, chunk):
                yield event
            return
        async with aclosing(self._merged(job)) as outputs:
            async for _, out in outputs:
                for j, c in enumerate(out.outputs):
                    text, logprobs = self._chat_piece(c, body)
                    if logprobs is None and c.finish_reason is None and not body.usage_on_every_chunk:
                        if text:
                            yield text_events.event(j, text)
                    elif text or (logprobs is not None and logprobs.content) or c.finish_reason is not None:
                        yield sse(
                            chunk(
                                ChatChunkChoice(
                                    index=j,
                                    delta=DeltaMessage(content=text or None),
                                    logprobs=logprobs,
                                    finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason,
                                )
                            )
                        )

    async def _tool_chat_choices(
        self, job: Job, body: ChatCompletionRequest, chunk: Callable[[ChatChunkChoice], ChatCompletionChunk]
    ) -> AsyncIterator[str]:
        """The choices' events when the answer may call tools: each choice's text goes through its
        ``ChoiceTools``, which sends content and tool-call pieces as it can tell them apart."""
        tools = [ChoiceTools(body, self.tool_parser) for _ in range(job.n)]
        async with aclosing(self._merged(job)) as outputs:
            async for _, out in outputs:
                for j, c in enumerate(out.outputs):
                    text, logprobs = self._chat_piece(c, body)
                    delta = tools[j].delta(text)
                    if c.finish_reason is not None:
                        delta = _joined(delta, tools[j].finish())
                    if (
                        delta is not None
                        or c.finish_reason is not None
                        or body.usage_on_every_chunk
                        or (logprobs is not None and logprobs.content)
                    ):
                        yield sse(
                            chunk(
                                ChatChunkChoice(
                                    index=j,
                                    delta=delta or DeltaMessage(),
                                    logprobs=logprobs,
                                    finish_reason=tools[j].finish_reason(c.finish_reason),
                                    stop_reason=c.stop_reason,
                                )
                            )
                        )

    @staticmethod
    def _chat_piece(
        c: CompletionOutput, body: ChatCompletionRequest
    ) -> tuple[str, ChatChoiceLogprobs | None]:
        """``c`` (a delta, or the whole output) as text and, if asked for, logprobs in the chat
        format (each token with its ``top_logprobs`` most likely alternatives)."""
        text = c.text
        logprobs = None
        if body.logprobs:
            content = []
            for token, entries in zip(c.token_ids, c.logprobs):
                top = sorted(entries.values(), key=lambda lp: lp.logprob, reverse=True)[
                    : body.top_logprobs or 0
                ]
                chosen = entries[token]
                content.append(
                    ChatTokenLogprob(
                        token=chosen.decoded_token,
                        logprob=chosen.logprob,
                        bytes=list(chosen.decoded_token.encode()),
                        top_logprobs=[
                            TopLogprob(
                                token=lp.decoded_token,
                                logprob=lp.logprob,
                                bytes=list(lp.decoded_token.encode()),
                            )
                            for lp in top
                        ],
                    )
                )
            logprobs = ChatChoiceLogprobs(content=content)
        return text, logprobs
