"""What ``LLMEngine`` and ``DataParallelEngine`` share: adding a request is making it, then queueing it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams


class EngineBase(ABC):
    """``add_request`` and ``add_prepared_request`` in terms of ``make_request`` and ``add_prepared_requests``."""

    @abstractmethod
    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate one request and build its state without queueing it (raises ``ValueError``).
        ``priority``: lower runs sooner, under the ``priority`` scheduling policy (vLLM's); else 0."""

    @abstractmethod
    def add_prepared_requests(self, reqs: Sequence[Request]) -> None:
        """Queue requests made by ``make_request``, the prompts of one API request, with all their
        samples, or none of them."""

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        req = self.make_request(request_id, prompt, sampling_params, arrival_time, cache_salt, priority)
        self.add_prepared_request(req)
        return req

    def add_prepared_request(self, req: Request) -> None:
        """Queue a request made by ``make_request`` with all its samples, or none of them."""
        self.add_prepared_requests([req])


def request_id_in_use(request_id: str) -> ValueError:
    """The error for a request id a live request (sample or beam search) already holds."""
    return ValueError(f"request id {request_id!r} is already in use; give each request a unique id.")
