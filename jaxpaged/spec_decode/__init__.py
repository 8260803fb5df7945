"""Speculative decoding: proposers (``ngram_proposer``, ``draft_proposer``), the verification rule
(``rejection``), and the engine's per-request bookkeeping (``speculator``)."""
