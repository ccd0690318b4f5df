"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from batchgen.errors import BatchgenError, check_field

DTYPES = ("auto", "float32", "bfloat16", "float16")
GENERATION_CONFIGS = ("auto", "ignore")
QUANTIZATIONS = (None, "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


# bounds of settings past which an engine could not start (allocations, threads)
MAX_NUM_SEQS = 1 << 20
MAX_CPU_THREADS = 1024
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block where block_size is unset (and no FP8 cache)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Run-time values (KV blocks) are returned, not stored."""

    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    # "fp8": a 16-bit checkpoint's Linear layers (not the lm_head) quantized at load to FP8
    # E4M3 with per-output-channel weight scales and per-token activation scales. A
    # pre-quantized FP8 checkpoint runs in FP8 whatever this says (its config tells).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto" = the model's dtype; "fp8" = E4M3, per-tensor scales
    # tokens per KV-cache block; None = 64 for an FP8 cache on a GPU with TMA (compute
    # capability 9.0+: decode attention copies each block with one TMA load), else 16
    block_size: int | None = None
    num_kv_blocks: int | None = None  # None = sized from memory (kv_cache_memory_fraction / cpu)
    kv_cache_memory_fraction: float = 0.9  # of free GPU memory after the model loads
    cpu_kv_cache_gib: float = 1.0  # KV cache size on the CPU device when num_kv_blocks is None
    max_num_seqs: int = 256  # cap on running requests
    # token budget of one step (decodes + prefill chunks); None = 16,384 on a GPU of 70 GiB or
    # more other than an A100 (vLLM's offline defaults) where the memory left beside the
    # weights and KV cache holds twice such a step's estimated activations, else 8,192
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    # False: every prompt (and recompute after preemption) in one step; max_num_batched_tokens
    # must then hold max_model_len tokens
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes already computed
    overlap: bool = True  # launch step N+1 before post-processing N; False = synchronous oracle
    cuda_graphs: bool = True  # replay steps from CUDA graphs (CUDA only)
    cuda_graph_batch_sizes: tuple[int, ...] = field(
        default=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
    )
    # when decode graphs are captured: "first_use" = the largest size at start-up (its memory
    # pool serves all sizes), each other size at its 8th step, its steps before that padded to
    # a larger size's graph (a job's first rows come ~1-2 s sooner, and its whole run ends
    # sooner); "startup" = every size before the first step
    cuda_graph_capture: str = "first_use"
    # token counts that steps with prefill chunks are padded to and replayed at from CUDA
    # graphs (those above the token budget dropped); None = about 1.5x apart from 256 up to
    # the budget, and the budget; () = such steps run eagerly
    cuda_graph_token_sizes: tuple[int, ...] | None = None
    attention_backend: str = "auto"  # "auto" | "reference" | "triton"
    fused_ops: bool = True  # fused RMSNorm / rotary / SiLU-and-mul kernels with the triton backend
    seed: int = 0  # base of per-request seeds when a request gives none
    # "auto": the sampling defaults the model's generation config recommends (temperature,
    # top_p, top_k, min_p, repetition_penalty, max_new_tokens) stand in for batchgen's where
    # a call or a job sets none, as vLLM's generation_config="auto"; "ignore": batchgen's own
    generation_config: str = "auto"
    # torch's intra-op threads on the CPU device; None = the cores this process may use less
    # one (left to the job's tokenizer and writer threads), at least 1, unless OMP_NUM_THREADS
    # is set (then torch's own choice stands). Also the structured-output mask fill's threads
    # on any device (None: every core this process may use)
    cpu_threads: int | None = None
    # compare the engine with the model's own forward pass on a probe input at start-up, and
    # refuse a model it would run wrongly (off only for the engine's own tests)
    check_model: bool = True

    def __post_init__(self) -> None:
        check_field(
            isinstance(self.device, str) and _DEVICE.fullmatch(self.device) is not None,
            "device",
            self.device,
            "auto, cpu, cuda or cuda:N",
        )
        check_field(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        check_field(
            self.generation_config in GENERATION_CONFIGS,
            "generation_config",
            self.generation_config,
            " or ".join(GENERATION_CONFIGS),
        )
        check_field(
            self.quantization in QUANTIZATIONS, "quantization", self.quantization, "unset or fp8"
        )
        check_field(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            "auto or fp8",
        )
        check_field(
            self.block_size in (None, 8, 16, 32, 64, 128),
            "block_size",
            self.block_size,
            "8, 16, 32, 64 or 128",
        )
        if self.num_kv_blocks is not None:
            check_field(
                self.num_kv_blocks >= 1, "num_kv_blocks", self.num_kv_blocks, "an integer >= 1"
            )
        check_field(
            0.0 < self.kv_cache_memory_fraction <= 1.0,
            "kv_cache_memory_fraction",
            self.kv_cache_memory_fraction,
            "a number in (0, 1]",
        )
        check_field(self.cpu_kv_cache_gib > 0, "cpu_kv_cache_gib", self.cpu_kv_cache_gib, "> 0")
        check_field(
            1 <= self.max_num_seqs <= MAX_NUM_SEQS,
            "max_num_seqs",
            self.max_num_seqs,
            f"an integer in [1, {MAX_NUM_SEQS:,}]",
        )
        if self.max_num_batched_tokens is not None:
            check_field(
                self.max_num_batched_tokens >= self.max_num_seqs,
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f">= max_num_seqs ({self.max_num_seqs})",
            )
        if self.cpu_threads is not None:
            check_field(
                1 <= self.cpu_threads <= MAX_CPU_THREADS,
                "cpu_threads",
                self.cpu_threads,
                f"an integer in [1, {MAX_CPU_THREADS}]",
            )
        if self.max_model_len is not None:
            check_field(self.max_model_len >= 3, "max_model_len", self.max_model_len, ">= 3")
        check_field(
            self.attention_backend in ("auto", "reference", "triton"),
            "attention_backend",
            self.attention_backend,
            "auto, reference or triton",
        )
        check_field(
            self.cuda_graph_capture in ("first_use", "startup"),
            "cuda_graph_capture",
            self.cuda_graph_capture,
            "first_use or startup",
        )
        if self.cuda_graph_token_sizes is not None:
            check_field(
                all(t >= 1 for t in self.cuda_graph_token_sizes),
                "cuda_graph_token_sizes",
                self.cuda_graph_token_sizes,
                "positive token counts",
            )
        check_field(
            all(b >= 1 for b in self.cuda_graph_batch_sizes),
            "cuda_graph_batch_sizes",
            self.cuda_graph_batch_sizes,
            "positive batch sizes",
        )


def check_prefill_budget(config: EngineConfig, max_model_len: int) -> None:
    """Without chunked prefill a prompt, or a preempted request's recompute of its prompt and
    outputs, runs in one step: BatchgenError unless a step's token budget holds the longest
    one (max_model_len tokens), as vLLM requires."""
    budget = config.max_num_batched_tokens
    if config.enable_chunked_prefill or budget is None or budget >= max_model_len:
        return
    raise BatchgenError(
        f"enable_chunked_prefill=false needs max_num_batched_tokens ({budget:,}) >= "
        f"max_model_len ({max_model_len:,}): without chunking a whole sequence must fit one "
        "step; raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill"
    )
