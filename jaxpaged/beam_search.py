"""Beam search: parameters, outputs (vLLM's shapes), and the per-request search state.

The search follows Hugging Face transformers' ``generate(num_beams=k, do_sample=False)``
(``GenerationMixin._beam_search`` in transformers 5.x) step for step, for one prompt:

- Each step every live beam's next-token log-probabilities (raw ``log_softmax``) are added to
  the beam's cumulative log-probability; the best ``2k`` continuations over all beams are kept,
  best first. The engine gets them from the sampler's top-N logprobs, computed on device:
  the ``2k`` best of each beam contain the ``2k`` best overall. The first step has one beam
  (HF starts beams 1..k-1 at -1e9, so only beam 0's continuations count).
- A continuation *hits a stop* if its token is EOS (unless ``ignore_eos``) or it reaches
  ``max_tokens``. The best ``k`` that do not hit a stop are the next step's beams.
- Those among the best ``k`` (by rank, not the backups ranked k..2k-1) that hit a stop are
  finished hypotheses, scored ``cum_logprob / generated_len ** length_penalty`` where the
  generated length includes the EOS token; the best ``k`` finished hypotheses are kept.
- The search stops when every continuation hits a stop (``max_tokens``), or once ``k``
  hypotheses are finished and: ``early_stopping=True``; or the best live beam's score,
  normalized by the current generated length (``early_stopping=False``) or, with
  ``early_stopping="never"`` and ``length_penalty > 0``, by ``max_tokens``, cannot beat the
  worst finished hypothesis.

With ``beam_width=1`` HF runs greedy search instead, which ends at the first EOS whatever
``early_stopping`` says; so does this. The result is the ``k`` finished hypotheses, best
score first. Pure Python, no jax.

``BeamSearches`` holds the engine's live searches: each live beam is a running sequence; once
every live beam of a prompt has its candidates, ``BeamSearches.step`` selects the next beams,
forking the sequences that continue more than once and finishing those that end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxpaged.request import CompletionOutput, Logprob, Request, RequestOutput, RequestStatus
from jaxpaged.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:  # annotations only: ``import jaxpaged`` reads this module and must stay light
    from jaxpaged.scheduler import Scheduler
    from jaxpaged.tokenizer import Tokenizer


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` plus HF's ``early_stopping`` (True, False or "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        limit = MAX_LOGPROBS // 2
        if (
            not isinstance(self.beam_width, int)
            or isinstance(self.beam_width, bool)
            or not 1 <= self.beam_width <= limit
        ):
            raise ValueError(
                f"beam_width must be an integer in [1, {limit}] (each step scores the best "
                f"2 x beam_width continuations of every beam), got {self.beam_width!r}."
            )
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if self.temperature != 0.0:
            raise ValueError(
                f"beam search is deterministic: temperature must be 0, got {self.temperature!r}."
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}.")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}.")


@dataclass
class BeamSearchSequence:
    """One finished beam (vLLM's shape): ``tokens`` include the prompt."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    score: float
    """``cum_logprob / len(output) ** length_penalty``, what the beams are ranked by."""
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The finished beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    return cum_logprob / (length**length_penalty)


@dataclass
class Hypothesis:
    """A finished beam: generated tokens (EOS included), their logprobs, and its score."""

    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float
    eos: bool


@dataclass
class Continuation:
    """Live beam ``beam`` extended by ``token``: what the engine turns into a running sequence."""

    beam: int
    token: int
    logprob: float
    cum_logprob: float


class BeamSearchState:
    """HF's beam search bookkeeping for one prompt; the engine owns the sequences.

    ``step`` takes, for each live beam, its cumulative logprob and its best continuations; it
    returns the continuations that become the next step's beams (empty once the search is done).
    """

    def __init__(self, params: BeamSearchParams, eos_token_id: int | None) -> None:
        self.params = params
        self.eos = None if params.ignore_eos else eos_token_id
        self.num_generated = 0
        self.finished: list[Hypothesis] = []
        self.done = False

    def step(
        self,
        beams: list[tuple[float, list[int], list[float]]],
        candidates: list[tuple[list[int], list[float]]],
    ) -> list[Continuation]:
        """``beams[i]`` = (cum logprob, generated tokens, their logprobs) of live beam ``i``;
        ``candidates[i]`` = (token ids, logprobs) of its best next tokens (at least 2k)."""
        k = self.params.beam_width
        lp = self.params.length_penalty
        cands = [
            Continuation(i, int(t), float(l), beams[i][0] + float(l))
            for i, (ids, lps) in enumerate(candidates)
            for t, l in zip(ids[: 2 * k], lps[: 2 * k])
        ]
        # Best first; ties keep HF's flattened (beam, token) order.
        cands.sort(key=lambda c: (-c.cum_logprob, c.beam, c.token))
        cands = cands[: 2 * k]
        g = self.num_generated + 1  # generated length after this step
        at_limit = g >= self.params.max_tokens
        hits = [at_limit or c.token == self.eos for c in cands]
        for c, hit in zip(cands[:k], hits[:k]):
            if hit:
                _, toks, lps = beams[c.beam]
                self.finished.append(
                    Hypothesis(
                        toks + [c.token],
                        lps + [c.logprob],
                        c.cum_logprob,
                        beam_score(c.cum_logprob, g, lp),
                        c.token == self.eos,
                    )
                )
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del self.finished[k:]
        running = [c for c, hit in zip(cands, hits) if not hit][:k]
        self.num_generated = g
        if all(hits) or not running:
            self.done = True
        elif k == 1 and self.finished:
            self.done = True  # HF's num_beams=1 is greedy search: it ends at the first EOS
        elif len(self.finished) == k:
            if self.params.early_stopping is True:
                self.done = True
            else:
                hyp_len = self.params.max_tokens if self.params.early_stopping == "never" and lp > 0.0 else g
                best_possible = running[0].cum_logprob / (hyp_len**lp)
                if best_possible <= self.finished[-1].score:
                    self.done = True
        return [] if self.done else running


@dataclass
class BeamSearch:
    """One beam search request: its HF-equivalent state and its live beams (sequences)."""

    root: Request
    params: BeamSearchParams
    state: BeamSearchState
    beams: list[Request]
    cum: dict[str, float] = field(default_factory=dict)
    pending: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    """Live beam id -> its best 2k next tokens and logprobs, once its step has run."""
    num_forks: int = 0

    def __post_init__(self) -> None:
        self.cum.setdefault(self.root.request_id, 0.0)


class BeamSearches:
    """The engine's live beam searches, by request id (``by_id``) and by live beam id (``of_beam``)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.by_id: dict[str, BeamSearch] = {}
        self.of_beam: dict[str, BeamSearch] = {}

    def add(self, root: Request, params: BeamSearchParams) -> None:
        """Queue ``root``, the search's first beam (made with greedy top-2k logprobs rows)."""
        root.reserved_seqs, root.multi_step = params.beam_width - 1, False
        self.scheduler.add_request(root)
        search = BeamSearch(root, params, BeamSearchState(params, self.tokenizer.eos_token_id), [root])
        self.by_id[root.request_id] = search
        self.of_beam[root.request_id] = search

    def abort(self, request_id: str) -> bool:
        """Abort the search ``request_id`` (all its beams); False if there is none."""
        search = self.by_id.pop(request_id, None)
        if search is None:
            return False
        for beam in search.beams:
            self.scheduler.abort_request(beam.request_id)
            self.of_beam.pop(beam.request_id, None)
        search.beams = []
        return True

    def step(self, search: BeamSearch) -> RequestOutput | None:
        """Select the next beams once every live beam has its candidates; the output when done."""
        if any(b.request_id not in search.pending for b in search.beams):
            return None
        beams = search.beams
        conts = search.state.step(
            [(search.cum[b.request_id], b.output_token_ids, b.output_logprobs) for b in beams],
            [search.pending[b.request_id] for b in beams],
        )
        search.pending.clear()
        search.root.reserved_seqs = 0
        for b in beams:
            b.waiting_for_group = False
        children: dict[int, list[Continuation]] = {}
        for c in conts:
            children.setdefault(c.beam, []).append(c)
        # Beams that do not continue free their blocks first (making room), then the rest fork.
        for i, b in enumerate(beams):
            if i not in children:
                self.scheduler.finish_request(b, RequestStatus.FINISHED_STOPPED)
                self.of_beam.pop(b.request_id, None)
        new_beams = []
        for i, b in enumerate(beams):
            for c in children.get(i, [])[1:]:
                search.num_forks += 1
                child = Request(
                    request_id=f"beam{search.num_forks}_{search.root.request_id}",
                    prompt_token_ids=b.prompt_token_ids,
                    sampling_params=b.sampling_params,
                    max_tokens=b.max_tokens,
                    seed=b.seed,
                    eos_token_id=b.eos_token_id,
                    cache_salt=b.cache_salt,
                    arrival_time=b.arrival_time,
                    priority=b.priority,
                    output_token_ids=b.output_token_ids + [c.token],
                    output_logprobs=b.output_logprobs + [c.logprob],
                    output_top_logprobs=[],
                )
                self.scheduler.fork_request(b, child)
                self.of_beam[child.request_id] = search
                search.cum[child.request_id] = c.cum_logprob
                new_beams.append(child)
            if i in children:
                c = children[i][0]
                b.output_token_ids.append(c.token)
                b.output_logprobs.append(c.logprob)
                search.cum[b.request_id] = c.cum_logprob
                new_beams.append(b)
        search.beams = new_beams
        if not search.state.done:
            return None
        del self.by_id[search.root.request_id]
        return self._output(search)

    def _output(self, search: BeamSearch) -> RequestOutput:
        root = search.root
        outs = [
            CompletionOutput(
                index=rank,
                text=self.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                token_ids=list(h.token_ids),
                cumulative_logprob=h.cum_logprob,
                logprobs=[{t: Logprob(l)} for t, l in zip(h.token_ids, h.logprobs)],
                finish_reason="stop" if h.eos else "length",
            )
            for rank, h in enumerate(search.state.finished)
        ]
        return RequestOutput(
            root.request_id,
            root.prompt,
            root.prompt_token_ids,
            outs,
            finished=True,
            metrics={"arrival_time": root.arrival_time, "finished_time": time.time()},
        )
