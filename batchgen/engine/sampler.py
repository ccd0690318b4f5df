"""Token sampling on the device, with no host synchronization.

Order (vLLM's): penalties -> bans (min_new_tokens) -> temperature -> min_p -> top_k -> top_p,
then an exact draw by the Gumbel-max trick. Randomness is a counter-based hash of (seed and
sample index, position, token id), not a global generator, so a seeded request draws the same
tokens whatever batch it shares and after a resume. Logprobs are those of the raw logits under
the structured-output token bitmask (as vLLM's): no penalty, ban, temperature or filter.
"""

from __future__ import annotations

import torch

from batchgen.engine.step_inputs import SamplingFlags
from batchgen.engine.step_layout import SamplingInputs

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # lowbias32-style multiplier; products stay below 2**63 in int64


def hash_u32(x: torch.Tensor) -> torch.Tensor:
    """Elementwise 32-bit integer hash of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[S] int64 keys (any non-negative int64) and positions -> [S] 32-bit keys, from both
    halves of the key and the position: keys that differ in one half only never share a
    position's key, others share one with chance 2**-32 at each position apart (folding the
    key to 32 bits first made some pair of rows among ~65k draw alike at every position)."""
    at = positions & _MASK32
    low = hash_u32(hash_u32(seeds & _MASK32) ^ at)
    high = hash_u32(hash_u32((seeds >> 32) & _MASK32 ^ 0x9E3779B9) ^ at)
    return hash_u32(low ^ hash_u32(high ^ 0x85EBCA6B))


def gumbel_noise(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """keys: [S], vocab_hash: [V] (hash_u32 of token ids) -> [S, V] float32 Gumbel(0, 1)."""
    bits = hash_u32(keys[:, None] ^ vocab_hash[None, :])
    u = (bits.to(torch.float64) + 0.5) / 2.0**32  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).to(torch.float32)


class PenaltyState:
    """Per relay slot: which tokens the prompt holds and how often each was generated."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)

    def update_known(self, s: SamplingInputs) -> None:
        """Reset (re)admitted slots and mark the tokens the host knows."""
        if s.resets.numel():
            self.prompt[s.resets] = False
            self.counts[s.resets] = 0
        if s.prompt_marks.numel():
            self.prompt[s.prompt_marks[:, 0], s.prompt_marks[:, 1]] = True
        if s.output_counts.numel():
            ones = torch.ones_like(s.output_counts[:, 0], dtype=torch.int32)
            self.counts.index_put_(
                (s.output_counts[:, 0], s.output_counts[:, 1]), ones, accumulate=True
            )

    def count_sampled(self, s: SamplingInputs, tokens: torch.Tensor) -> None:
        """Add each tracked row's new token to its slot's counts (untracked rows add 0)."""
        self.counts.index_put_((s.slots, tokens), s.track.to(torch.int32), accumulate=True)

    def apply(self, logits: torch.Tensor, s: SamplingInputs) -> torch.Tensor:
        """vLLM's definitions: repetition over prompt and output tokens (divide positive
        logits, multiply negative ones); presence once and frequency per occurrence over the
        output. logits: [S, V] float32."""
        counts = self.counts[s.slots][:, : logits.shape[1]]
        seen = (counts > 0) | self.prompt[s.slots][:, : logits.shape[1]]
        rep = s.repetition.float()[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        logits = logits - s.frequency.float()[:, None] * counts
        return logits - s.presence.float()[:, None] * (counts > 0)


def filter_top_k_top_p_min_p(
    scaled: torch.Tensor, s: SamplingInputs, flags: SamplingFlags
) -> torch.Tensor:
    """scaled: [S, V] float32 logits / temperature; filtered entries become the dtype's min.

    In vLLM's order and as it defines them: min_p drops tokens less likely than min_p x the
    most likely one; top_k keeps every token at least as likely as the k-th (the two commute);
    top_p then keeps the smallest prefix of the most likely tokens left whose mass (over
    those left) reaches top_p (a tie at the cut is broken by position, lower token ids dropped
    first, as in Hugging Face and vLLM). A row that asks for no filter (top_k 0, top_p 1,
    min_p 0) comes back bit for bit, whatever its neighbours ask.
    """
    neg_inf = torch.finfo(scaled.dtype).min
    vocab = scaled.shape[-1]
    ordered, order = scaled.sort(dim=-1, stable=True)  # ascending
    if flags.any_top_p_min_p:
        probs = ordered.softmax(dim=-1)
        floor = probs[:, -1:] * s.min_p.float()[:, None]  # the most likely token's share
        drop = (probs < floor) & (s.min_p > 0.0)[:, None]
        scaled = scaled.masked_fill(drop.scatter(1, order, drop), neg_inf)
        ordered = ordered.masked_fill(drop, neg_inf)
    if flags.any_top_k:
        k = torch.where(s.top_k > 0, s.top_k, vocab).clamp(max=vocab)
        kth = ordered.gather(1, (vocab - k)[:, None])
        scaled = scaled.masked_fill(scaled < kth, neg_inf)
        ordered = ordered.masked_fill(ordered < kth, neg_inf)
    if flags.any_top_p_min_p:
        mass = ordered.softmax(dim=-1).cumsum(dim=-1)  # mass of this token and all less likely
        threshold = (1.0 - s.top_p).float()[:, None]  # 1 - top_p in float64, as HF does
        drop = (mass <= threshold) & (s.top_p < 1.0)[:, None]
        drop[:, -1] = False  # the most likely token always stays
        scaled = scaled.masked_fill(drop.scatter(1, order, drop), neg_inf)
    return scaled


class Sampler:
    """Greedy where temperature == 0, else an exact draw from the filtered distribution."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_hash = hash_u32(torch.arange(vocab_size, dtype=torch.int64, device=device))

    def __call__(
        self,
        logits: torch.Tensor,
        s: SamplingInputs,
        flags: SamplingFlags,
        penalties: PenaltyState | None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits: [S, V] -> (tokens [S] int64, logprob pack [S, 1 + 2k] float32 or None).

        mask: [S, ceil(V / 32)] int32 token bitmask of structured outputs (None = no row has
        one), applied after the bans: a disallowed token's logit is -inf, in the logprobs too
        (a row without structure has every bit set, so its logprobs stay the raw ones), and
        a disallowed token is never an alternative (its id in the pack is -1)."""
        raw, forbidden = logits, None
        if flags.any_penalty and penalties is not None:
            logits = penalties.apply(logits.float(), s)
        if s.bans.numel():
            logits = logits.float()
            logits = logits.index_put(
                (s.bans[:, 0], s.bans[:, 1]), logits.new_full((), float("-inf"))
            )
        if mask is not None:
            forbidden = ~token_bitmask_allowed(mask, logits.shape[-1])
            logits = logits.masked_fill(forbidden, float("-inf"))
            raw = raw.masked_fill(forbidden, float("-inf")) if flags.logprobs_k >= 0 else raw
        tokens = logits.argmax(dim=-1)  # in the logits' dtype: no float copy of [S, V]
        if flags.any_random:
            scaled = _tempered(logits.float(), s.temperature)
            if flags.any_top_k or flags.any_top_p_min_p:
                scaled = filter_top_k_top_p_min_p(scaled, s, flags)
            noise = gumbel_noise(
                row_keys(s.rng_keys, s.positions), self.vocab_hash[: scaled.shape[-1]]
            )
            tokens = torch.where(s.temperature > 0, (scaled + noise).argmax(dim=-1), tokens)
        if penalties is not None and flags.any_penalty:
            penalties.count_sampled(s, tokens)
        return tokens, _logprob_pack(raw, tokens, flags.logprobs_k, forbidden)


def _tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(logits - the row's largest) / T, float32: measured from the largest, a tiny T leaves
    the gaps between logits exact (logits / T alone would round them at ~1e7 and break ties
    toward low ids); a row whose every logit is -inf stays -inf, never NaN."""
    finfo = torch.finfo(torch.float32)
    top = logits.amax(dim=-1, keepdim=True).clamp(min=finfo.min)
    return (logits - top) / temperature.float().clamp(min=finfo.tiny)[:, None]


def token_bitmask_allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """mask: [S, W >= V / 32] int32, bit t of word w allows token 32 * w + t -> [S, V] bool.
    Device ops only: read as bytes (little-endian: bit k of byte b is token 8 * b + k), so the
    [S, 8 W] x 8 expansion is bytes, not words."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.view(torch.uint8)[:, :, None] >> shifts) & 1  # [S, 4 W, 8]
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()


def _logprob_pack(
    raw: torch.Tensor, tokens: torch.Tensor, k: int, forbidden: torch.Tensor | None = None
) -> torch.Tensor | None:
    """[S, 1 + 2k] float32: chosen logprob, top-k logprobs, top-k ids (exact below 2**24).
    forbidden: [S, V] bool or None; a forbidden top-k token (-inf, after every allowed one)
    has id -1: the host drops it."""
    if k < 0:
        return None
    logprobs = raw.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    top = logprobs.topk(k, dim=-1) if k else None
    if top is None:
        return chosen
    ids = top.indices
    if forbidden is not None:
        ids = ids.masked_fill(forbidden.gather(1, ids), -1)
    return torch.cat([chosen, top.values, ids.float()], dim=1)
