"""Model shapes, workloads W1-W4 and the roofline bound of docs/architecture.md."""

from __future__ import annotations

import random
from dataclasses import dataclass

from batchgen.bench.roof import H200_REFERENCE, DeviceRoof

BYTES = 2  # bf16
FP8_BYTES = 1
FP8_PEAK_FACTOR = 2  # FP8 tensor-core FLOP/s over bf16 on Hopper (dense)


@dataclass(frozen=True)
class Precision:
    """What a run stores in FP8: the decoder layers' Linear weights, the KV cache."""

    weights_fp8: bool = False
    kv_fp8: bool = False


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def matmul_params(self) -> int:
        """Weights read per decode step: every layer, the final norm and the lm_head."""
        return self.layers * self.layer_params + self.hidden + self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES

    def weight_bytes(self, precision: Precision) -> int:
        """Bytes read per decode step: the layers' Linear weights in FP8 or bf16; norms and
        the lm_head always bf16."""
        if not precision.weights_fp8:
            return self.matmul_params * BYTES
        linear = self.layers * (self.layer_params - 2 * self.hidden)
        return linear * FP8_BYTES + (self.matmul_params - linear) * BYTES

    def kv_bytes(self, precision: Precision) -> int:
        return self.kv_bytes_per_token * (FP8_BYTES if precision.kv_fp8 else BYTES) // BYTES

    def llama_config(self) -> dict:
        return dict(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tied,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        )


SHAPES = {
    "8b": Shape("8b", 4096, 32, 32, 8, 14336, 128256, tied=False),
    "1b": Shape("1b", 2048, 16, 32, 8, 8192, 128256, tied=True),
}


@dataclass(frozen=True)
class Workload:
    name: str
    requests: int
    prompt_range: tuple[int, int]
    output_tokens: int
    shared_prefix: int = 0

    def prompts(self, vocab: int, seed: int = 0) -> list[list[int]]:
        """Seeded random prompt token ids (a shared prefix first where the workload has one)."""
        rng = random.Random(seed)
        low_id, high_id = 1000, vocab - 1000  # stay clear of special tokens
        prefix = [rng.randrange(low_id, high_id) for _ in range(self.shared_prefix)]
        out = []
        for _ in range(self.requests):
            n = rng.randint(*self.prompt_range)
            out.append(prefix + [rng.randrange(low_id, high_id) for _ in range(n)])
        return out


WORKLOADS = {
    "W1": Workload("W1", 256, (128, 512), 256),
    "W2": Workload("W2", 64, (128, 512), 2048),
    "W3": Workload("W3", 512, (1024, 4096), 32),
    "W4": Workload("W4", 1024, (64, 256), 128, shared_prefix=1024),
}


def roofline_seconds(
    shape: Shape,
    prompt_lens: list[int],
    output_tokens: int,
    shared_prefix: int = 0,
    precision: Precision = Precision(),
    roof: DeviceRoof = H200_REFERENCE,
) -> float:
    """Prefill as compute, then each decode step of all requests at once as
    max(bytes / bandwidth, flops / peak); bytes = weights + lm_head + the KV cache read.

    shared_prefix: the first tokens of every prompt are the same; their prefill is computed
    once (what prefix caching makes possible) and each prompt's own tokens attend to them.
    Decode still reads every request's whole context, the shared prefix included.
    FP8 (precision): weights and KV at their FP8 sizes; matmul FLOPs at the FP8 peak.
    roof: the device's copy bandwidth and bf16 matmul rate (the bench measures its own).
    """
    peak = roof.matmul_peak * (FP8_PEAK_FACTOR if precision.weights_fp8 else 1)
    return _prefill_seconds(shape, prompt_lens, shared_prefix, peak) + _decode_seconds(
        shape, prompt_lens, output_tokens, precision, peak, roof.copy_bandwidth
    )


def _attn_flops_per_pair(shape: Shape) -> int:
    return 4 * shape.heads * shape.head_dim * shape.layers  # q.k and p.v


def _prefill_seconds(
    shape: Shape, prompt_lens: list[int], shared_prefix: int, peak: float
) -> float:
    """Compute for P shared tokens once, then per prompt its s own tokens: 2 x params x s
    matmul flops and attention over s x P + s^2 / 2 (query, key) pairs."""
    pair = _attn_flops_per_pair(shape)
    shared = min([shared_prefix, *prompt_lens]) if prompt_lens else 0
    flops = 2 * shape.matmul_params * shared + pair * shared * shared / 2
    for p in prompt_lens:
        own = p - shared
        flops += 2 * shape.matmul_params * own + pair * (own * shared + own * own / 2)
    return flops / peak


def _decode_seconds(
    shape: Shape,
    prompt_lens: list[int],
    output_tokens: int,
    precision: Precision,
    peak: float,
    bandwidth: float,
) -> float:
    n = len(prompt_lens)
    pair = _attn_flops_per_pair(shape)
    total = 0.0
    ctx = sum(prompt_lens)
    for _ in range(output_tokens):
        ctx += n
        nbytes = shape.weight_bytes(precision) + ctx * shape.kv_bytes(precision)
        flops = 2 * shape.matmul_params * n + pair * ctx
        total += max(nbytes / bandwidth, flops / peak)
    return total
