"""Before any real request: check that batchgen runs the model as the model itself would.

A model is refused, with one line naming its family and the reason, when
- a layer mixes tokens without going through transformers' attention interface (recurrent,
  convolutional or linear-attention layers: batchgen keeps no state for them),
- a layer asks attention for something batchgen does not implement (an argument it passes),
- or batchgen's log-probabilities on a probe input differ from the model's own forward pass
  (its eager attention, unfused modules) by more than the dtype's rounding.
FP8: the model's own forward pass runs the same FP8 Linear layers (quantization is part of the
model being checked, not an error of batchgen's), with activations unquantized during the
probe and the quantized product checked on its own (batchgen.engine.quant.check says why);
with an FP8 KV cache the check first sets the cache's per-layer scales (calibrate_kv_scales:
a layer whose keys or values on the probe prompts reach beyond half of E4M3's +-448 stores
them divided by the power of two that brings them there), then its eager attention sees keys
and values rounded as the cache stores them, and a model whose keys or values on the probe's
whole sequences still reach beyond the cache's range (stored saturated, so both passes would
agree on wrong values) is refused.
What FP8 costs against the 16-bit model is measured elsewhere (the benchmark's
agreement and KL), not here.
The probe: fixed random prompts prefilled together in one step, then decoded a few steps, so
the packed prefill, the paged cache and the decode path are all compared.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from batchgen.engine.attention import attention_audit, attention_scope
from batchgen.engine.model_loader import eval_mode
from batchgen.engine.probe_requests import (
    PROBE_LENGTHS,
    PROBE_NEW_TOKENS,
    check_probe_room,
    prompt_room,
)
from batchgen.engine.quant.check import fp8_probe_mode, fp8_product_error
from batchgen.engine.quant.convert import is_quantized
from batchgen.engine.quant.fp8 import FP8_DTYPE, FP8_MAX, round_to_fp8
from batchgen.engine.request import Prompt
from batchgen.engine.sampling_params import SamplingParams
from batchgen.errors import BatchgenError

if TYPE_CHECKING:
    from batchgen.engine.engine import Engine

PROBE_TOP = 5  # alternatives compared at each position
RELEVANT_LOGPROB = -12.0  # entries less likely than this are rounding noise in any dtype
TOLERANCE = {torch.float32: 2e-3, torch.float64: 1e-6}  # |logprob difference| allowed
TOLERANCE_16BIT = 0.6
FP8_KV_REFERENCE = "batchgen-fp8-kv-eager"  # the reference attention for an FP8 KV cache
KV_HEADROOM = 2.0  # a calibrated FP8 cache holds the probe's largest key or value at 448 / this
# while the check's reference pass runs over an FP8 cache: (largest |key| or |value|, what, layer)
_KV_PEAK: contextvars.ContextVar[list[tuple[float, str, int]] | None] = contextvars.ContextVar(
    "batchgen_kv_peak", default=None
)
# ... and the cache's (key scale, value scale) per layer, which its rounding divides by
_KV_SCALES: contextvars.ContextVar[list[tuple[float, float]] | None] = contextvars.ContextVar(
    "batchgen_kv_scales", default=None
)


class ModelRefused(BatchgenError):
    """batchgen would run this model wrongly; the message names the family and the reason."""


def check_model(engine: Engine) -> None:
    """Raise ModelRefused unless the engine reproduces the model's own forward pass, both in
    eval mode (a model in train mode is switched for the check, then given back so)."""
    family = getattr(engine.model.config.get_text_config(), "model_type", "this") or "this"
    fp8 = is_quantized(engine.model)
    if fp8 and (reason := fp8_product_error(engine.model, engine.dtype)) is not None:
        raise _refuse(family, reason)
    with (
        eval_mode(engine.model),  # the reference pass as the engine's: no dropout
        _eager_steps(engine),
        fp8_probe_mode() if fp8 else contextlib.nullcontext(),
    ):
        _compare(engine, family)


@contextlib.contextmanager
def _eager_steps(engine: Engine) -> Iterator[None]:
    """The probe's steps run eagerly, graphs set aside: the attention audit hears each layer
    call attention (a graph's replay calls no Python)."""
    runner = engine.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


def _compare(engine: Engine, family: str) -> None:
    """The probe requests through the engine against the model's own forward pass."""
    prompts = _probe_prompts(engine)
    _check_room(engine, prompts)
    with _own_pass(family):
        scales = calibrate_kv_scales(engine, prompts) if engine.kv_dtype == FP8_DTYPE else None
    params = SamplingParams(max_new_tokens=PROBE_NEW_TOKENS, ignore_eos=True, logprobs=PROBE_TOP)
    with attention_audit() as audit:
        try:
            outs = list(engine.generate(prompts, params, decode=False))
        except Exception as exc:  # the model's forward breaks under batchgen's attention
            raise _refuse(family, f"its forward pass fails under batchgen ({_line(exc)})") from exc
    if audit.unsupported:
        name, module = next(iter(audit.unsupported.items()))
        raise _refuse(
            family, f"{module} passes {name!r} to attention, which batchgen does not implement"
        )
    missing = sorted(set(range(engine.shape.num_layers)) - audit.layers)
    if missing:
        raise _refuse(
            family,
            f"layer(s) {missing} of {engine.shape.num_layers} mix tokens without attention "
            "(recurrent, convolutional or linear-attention layers: batchgen keeps no state "
            "for them)",
        )
    failed = [o for o in outs if o.error]
    if failed:
        raise _refuse(family, f"the probe request failed ({failed[0].error})")
    peaks: list[tuple[float, str, int]] = []
    tokens = _KV_PEAK.set(peaks), _KV_SCALES.set(scales)
    try:
        with _own_pass(family):
            worst = max(_difference(engine, prompt, out) for prompt, out in _paired(prompts, outs))
    finally:
        _KV_PEAK.reset(tokens[0])
        _KV_SCALES.reset(tokens[1])
    beyond = [(p, what, i) for p, what, i in peaks if p > FP8_MAX * _scale(scales, i, what)]
    if beyond:
        peak, what, layer = max(beyond)
        raise _refuse(
            family,
            f"with kv_cache_dtype='fp8' its {what} reach {peak:.4g} (layer {layer}), beyond the "
            f"FP8 cache's range there (+-{FP8_MAX:g} x its scale "
            f"{_scale(scales, layer, what):.4g}): use kv_cache_dtype='auto'",
        )
    limit = TOLERANCE.get(engine.dtype, TOLERANCE_16BIT)
    if worst > limit:
        raise _refuse(
            family,
            f"its outputs under batchgen differ from its own forward pass (log-probability off "
            f"by {worst:.3g}, more than {engine.dtype} rounding explains): it needs something "
            "batchgen's attention does not implement",
        )


@torch.inference_mode()
def calibrate_kv_scales(engine: Engine, prompts: list[Prompt]) -> list[tuple[float, float]]:
    """Set an FP8 cache's per-layer (key, value) scales from the model's own forward pass over
    the prompts -> them: a layer whose largest |key| (|value|) reaches beyond
    FP8_MAX / KV_HEADROOM stores keys (values) divided by the smallest power of two that
    brings them within it; the others keep 1 (stored as they are). What the probe does not
    see, a later prompt may exceed: such values are stored saturated."""
    layers = len(engine.runner.kv_cache.keys)
    peak = [[0.0, 0.0] for _ in range(layers)]
    found: list[tuple[float, str, int]] = []
    token = _KV_PEAK.set(found)
    try:
        for prompt in prompts:
            _reference_logprobs(engine, list(prompt.prompt))
    finally:
        _KV_PEAK.reset(token)
    for value, what, layer in found:
        if 0 <= layer < layers:
            side = what == "values"
            peak[layer][side] = max(peak[layer][side], value)
    scales = [(_power_of_two_scale(k), _power_of_two_scale(v)) for k, v in peak]
    engine.runner.kv_cache.set_scales(scales)
    return scales


def _power_of_two_scale(peak: float) -> float:
    """The smallest power of two that holds peak within FP8_MAX / KV_HEADROOM, at least 1:
    dividing by it and multiplying back are exact in float32 (the kernels and the reference
    then store and read the same values bit for bit)."""
    need = peak * KV_HEADROOM / FP8_MAX
    return 1.0 if need <= 1.0 else float(2 ** math.ceil(math.log2(need)))


def _probe_prompts(engine: Engine) -> list[Prompt]:
    room = prompt_room(engine.max_model_len)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.shape.vocab_size
    return [
        Prompt(torch.randint(0, vocab, (min(n, room),), generator=generator).tolist(), f"probe-{i}")
        for i, n in enumerate(PROBE_LENGTHS)
    ]


def _check_room(engine: Engine, prompts: list[Prompt]) -> None:
    tokens = max(len(p.prompt) for p in prompts) + PROBE_NEW_TOKENS
    check_probe_room(engine.num_blocks, engine.config.block_size, tokens)


def _paired(prompts: list[Prompt], outs: list[Any]) -> list[tuple[Prompt, Any]]:
    by_id = {o.request_id: o for o in outs}
    return [(p, by_id[p.request_id]) for p in prompts]


@torch.inference_mode()
def _difference(engine: Engine, prompt: Prompt, out: Any) -> float:
    """Largest |logprob| gap between batchgen and the model's own forward pass over the
    generated positions (chosen tokens and the top alternatives)."""
    sequence = [*prompt.prompt, *out.output_token_ids]
    reference = _reference_logprobs(engine, sequence)
    worst = 0.0
    for j, step in enumerate(out.logprobs):
        row = reference[len(prompt.prompt) + j - 1]
        for token, value in (
            (step.token_id, step.logprob),
            *zip(step.top_ids, step.top_logprobs, strict=True),
        ):
            expected = float(row[token])
            if max(expected, value) > RELEVANT_LOGPROB:
                worst = max(worst, abs(expected - value))
    return worst


def _reference_logprobs(engine: Engine, sequence: list[int]) -> torch.Tensor:
    """[len(sequence), vocab] float32 log-softmax of the model's own forward pass: its eager
    attention and its own (unfused) modules."""
    model = engine.model
    fusion = engine.runner.fusion
    if fusion is not None:
        fusion.off()
    try:
        with attention_scope(model, _reference_attention(engine)):
            ids = torch.tensor([sequence], device=engine.device)
            logits = model(input_ids=ids, use_cache=False).logits[0]
    finally:
        if fusion is not None:
            fusion.on()
    return logits.float().log_softmax(dim=-1).cpu()


def _reference_attention(engine: Engine) -> str:
    """The attention of the reference pass: the model's eager one, over FP8-rounded keys and
    values when the engine's cache is FP8."""
    return fp8_kv_reference() if engine.kv_dtype == FP8_DTYPE else "eager"


def fp8_kv_reference() -> str:
    """Register and name the attention implementation "the model's eager attention over keys
    and values rounded as an FP8 cache stores them" (what the engine computes with one)."""
    AttentionInterface.register(FP8_KV_REFERENCE, _fp8_kv_eager)
    AttentionMaskInterface.register(FP8_KV_REFERENCE, eager_mask)  # the masks eager adds
    return FP8_KV_REFERENCE


def _fp8_kv_eager(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    modeling = sys.modules.get(type(module).__module__)
    eager = getattr(modeling, "eager_attention_forward", None)
    if eager is None:  # a family without its own eager function: transformers' SDPA one
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as eager
    peaks = _KV_PEAK.get()
    layer = getattr(module, "layer_idx", -1)
    if peaks is not None:  # the start-up check: what the cache would have to hold
        peaks.extend(
            (float(t.abs().amax()), what, layer)
            for what, t in (("keys", key), ("values", value))
            if t.numel()
        )
    scales = _KV_SCALES.get()
    key = round_to_fp8(key, _scale(scales, layer, "keys"))
    value = round_to_fp8(value, _scale(scales, layer, "values"))
    return eager(module, query, key, value, *args, **kwargs)


def _scale(scales: list[tuple[float, float]] | None, layer: int, what: str) -> float:
    """A layer's key or value scale (1 without scales or for a layer not in the cache)."""
    if scales is None or not 0 <= layer < len(scales):
        return 1.0
    return scales[layer][what == "values"]


@contextlib.contextmanager
def _own_pass(family: str) -> Iterator[None]:
    """The model's own forward pass on the probe input: where it fails (a config its own
    attention cannot run), the model is refused in one line; running out of memory is not the
    model's fault and stays as it is."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        raise _refuse(
            family, f"its own forward pass fails on the probe input ({_line(exc)})"
        ) from exc


def _refuse(family: str, reason: str) -> ModelRefused:
    return ModelRefused(f"batchgen cannot run {family} models exactly: {reason}")


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
