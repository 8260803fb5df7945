"""The detokenizer of one sample: ``IncrementalDetokenizer``, or the variant for
``spaces_between_special_tokens=False``."""

from __future__ import annotations

from typing import Sequence

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.tokenizer import IncrementalDetokenizer, Tokenizer


class UnspacedSpecialsDetokenizer(IncrementalDetokenizer):
    """``spaces_between_special_tokens=False``: added tokens are decoded on their own and joined to
    the surrounding text with no separator, whatever spaces the tokenizer's decoder would put there."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._added = {i: t.content for i, t in tokenizer.hf.added_tokens_decoder.items()}
        super().__init__(tokenizer, prompt_token_ids, skip_special_tokens)

    def _decode(self, token_ids: list[int]) -> str:
        pieces, run = [], []
        for t in token_ids:
            if t not in self._added:
                run.append(t)
                continue
            if run:
                pieces.append(super()._decode(run))
                run = []
            if not (self._skip_special_tokens and t in self._tokenizer.all_special_ids):
                pieces.append(self._added[t])
        if run:
            pieces.append(super()._decode(run))
        return "".join(pieces)


def make_detokenizer(
    tokenizer: Tokenizer, sp: SamplingParams, prompt_token_ids: Sequence[int]
) -> IncrementalDetokenizer:
    kind = IncrementalDetokenizer if sp.spaces_between_special_tokens else UnspacedSpecialsDetokenizer
    return kind(tokenizer, prompt_token_ids, sp.skip_special_tokens)
