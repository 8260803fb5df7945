"""jaxpaged: a PagedAttention LLM serving engine on JAX."""

import logging

# jaxpaged uses transformers for tokenizers and configs only, never its torch models, so transformers'
# warning on import that PyTorch was not found does not apply: drop that one record.
logging.getLogger("transformers").addFilter(lambda record: "PyTorch was not found" not in record.getMessage())

from jaxpaged.async_engine import AsyncLLMEngine
from jaxpaged.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.config import AsyncEngineArgs, EngineArgs
from jaxpaged.request import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.structured_outputs_params import StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "EngineArgs",
    "AsyncEngineArgs",
    "SamplingParams",
    "RequestOutput",
    "RequestOutputKind",
    "CompletionOutput",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "StructuredOutputsParams",
]


def __getattr__(name: str):
    # LLM and LLMEngine pull in JAX and transformers; import them only when asked for.
    if name == "LLM":
        from jaxpaged.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxpaged.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
