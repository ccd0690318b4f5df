"""FP8 against bf16 on the same weights, teacher-forced: top-1 agreement and mean KL.

For each weight statistic (random: the default init; trained-like: heavy-tailed weights,
outlier channels in the norms, a peaked lm_head), the same random token sequences go through
the bf16 model, the FP8 model (Linear layers quantized as runtime.quantization='fp8' does) and
the FP8 model with keys and values rounded as an FP8 KV cache stores them (the reference the
engine's model check uses). KL(bf16 || fp8) is per position, in nats. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch

from batchgen.bench.systems import build_model
from batchgen.bench.workloads import SHAPES
from batchgen.engine.attention import attention_scope
from batchgen.engine.probe import fp8_kv_reference
from batchgen.engine.quant import quantize_model

OUTLIER_CHANNELS = 8  # per norm: channels whose gain makes activation outliers
OUTLIER_GAIN = 20.0
T_DOF = 4.0  # Student-t degrees of freedom of the trained-like weights
LOGIT_STD = 4.0  # the trained-like lm_head's logit spread on unit activations


@torch.no_grad()
def trained_like(model: torch.nn.Module, seed: int) -> None:
    """Heavy-tailed Linear weights (same std), outlier norm channels, a peaked lm_head."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.distributions.StudentT(torch.tensor(T_DOF, device="cuda"))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            sample = t.sample(w.shape).to(w.dtype)
            w.copy_(sample * (w.float().std() / sample.float().std()).to(w.dtype))
        elif name.endswith("norm") and hasattr(module, "weight"):
            idx = torch.randperm(module.weight.numel(), generator=gen, device="cuda")
            module.weight[idx[:OUTLIER_CHANNELS]] = OUTLIER_GAIN
    head = model.get_output_embeddings().weight
    head.mul_(LOGIT_STD / (head.float().std() * head.shape[1] ** 0.5))


@torch.no_grad()
def logprobs(model: torch.nn.Module, batches: list[torch.Tensor], attn: str) -> list[torch.Tensor]:
    out = []
    with attention_scope(model, attn):
        for ids in batches:
            out.append(model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1))
    return out


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    """-> (top-1 agreement, mean KL(ref || got) in nats) over all positions."""
    agree, kl, n = 0.0, 0.0, 0
    for a, b in zip(ref, got, strict=True):
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        kl += (a.exp() * (a - b)).sum(-1).sum().item()
        n += a.shape[0] * a.shape[1]
    return agree / n, kl / n


def run(shape: str, stats: str, sequences: int, length: int, seed: int) -> list[str]:
    model = build_model(SHAPES[shape], seed=seed)
    if stats == "trained-like":
        trained_like(model, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    vocab = SHAPES[shape].vocab
    batches = [
        torch.randint(1000, vocab - 1000, (4, length), generator=gen, device="cuda")
        for _ in range(sequences // 4)
    ]
    ref = logprobs(model, batches, "sdpa")
    quantize_model(model)
    rows = []
    for label, attn in (("fp8 weights", "sdpa"), ("fp8 weights + fp8 KV", fp8_kv_reference())):
        agree, kl = compare(ref, logprobs(model, batches, attn))
        rows.append(f"| {shape} | {stats} | {label} | {agree:.2%} | {kl:.4f} |")
        print(rows[-1], flush=True)
    del model, ref
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = ["| shape | weights | FP8 | top-1 agreement | mean KL (nats) |", "|---|---|---|---|---|"]
    for stats in ("random", "trained-like"):
        rows += run(args.shape, stats, args.sequences, args.length, args.seed)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
