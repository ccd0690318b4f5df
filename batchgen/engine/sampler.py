"""Token sampling on the device, with no host synchronization.

Randomness is a counter-based hash of (seed, position, token id), not a global generator, so
a seeded request draws the same tokens whatever batch it shares and after a resume.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # lowbias32-style multiplier; products stay below 2**63 in int64


def hash_u32(x: torch.Tensor) -> torch.Tensor:
    """Elementwise 32-bit integer hash of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[S] int64 seeds (any non-negative int64) and positions -> [S] 32-bit keys."""
    key = hash_u32(seeds & _MASK32) ^ hash_u32((seeds >> 32) & _MASK32 ^ 0x9E3779B9)
    return hash_u32(hash_u32(key) ^ (positions & _MASK32))


def gumbel_noise(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """keys: [S], vocab_hash: [V] (hash_u32 of token ids) -> [S, V] float32 Gumbel(0, 1)."""
    bits = hash_u32(keys[:, None] ^ vocab_hash[None, :])
    u = (bits.to(torch.float64) + 0.5) / 2.0**32  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).to(torch.float32)


class Sampler:
    """Greedy where temperature == 0, else an exact draw from softmax(logits / temperature)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_hash = hash_u32(torch.arange(vocab_size, dtype=torch.int64, device=device))

    def __call__(
        self,
        logits: torch.Tensor,  # [S, V]
        temperatures: torch.Tensor,  # [S] float32, 0 = greedy
        seeds: torch.Tensor,  # [S] int64
        positions: torch.Tensor,  # [S] int64: position the new token will take
        any_random: bool,  # host knows whether any row samples; skips the noise otherwise
    ) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)  # in the logits' dtype: no float copy of [S, V]
        if not any_random:
            return greedy
        logits = logits.float()
        noise = gumbel_noise(row_keys(seeds, positions), self.vocab_hash[: logits.shape[-1]])
        scaled = logits / temperatures.clamp(min=1e-6)[:, None] + noise
        return torch.where(temperatures > 0, scaled.argmax(dim=-1), greedy)
