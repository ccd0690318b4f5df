"""Llama-4's attention temperature tuning scales a NoPE layer's queries by each token's
position: inside batchgen's packed steps (several sequences, prompts in chunks, no cache) the
scale comes from the tokens' real positions, as in the model's own generate."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen import Engine, EngineConfig, Prompt, SamplingParams
from tests.families import BASE, FAMILIES, VOCAB
from tests.helpers import assert_greedy_or_near_tie, random_prompts

FLOOR = 64  # floor_scale: the scale first changes at position 63


@pytest.fixture(scope="module")
def tuned_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama4-tuned")
    extra = {"floor_scale": FLOOR, "attn_scale": 4.0, "attn_temperature_tuning": True}
    config = AutoConfig.for_model(
        "llama4_text", **{**BASE, **FAMILIES["llama4_text"], **extra, "initializer_range": 0.3}
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


@functools.cache
def _model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _generate(path: Path, prompt: list[int], n: int) -> list[int]:
    model = _model(path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"max_num_batched_tokens": 32, "max_num_seqs": 4}],
    ids=["whole-prompts", "chunked"],
)
def test_temperature_tuning_counts_real_positions(tuned_dir: Path, overrides) -> None:
    """A 100-token prompt, short prompts packed past index 64 of one step, and a prompt that
    decodes across position 64: each equals the model's own generate."""
    prompts = random_prompts(1, 100, 100, VOCAB, seed=2) + random_prompts(6, 20, 30, VOCAB, 3)
    prompts += random_prompts(1, 56, 56, VOCAB, seed=4)
    limits = [10] * 7 + [20]
    config = EngineConfig(device="cpu", dtype="float32", **overrides)
    rows = [Prompt(p, request_id=str(i), sampling={"max_new_tokens": n})
            for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]  # fmt: skip
    with Engine(tuned_dir, config) as engine:
        outs = {o.request_id: o for o in engine.generate(rows, SamplingParams(ignore_eos=True))}
    for i, prompt in enumerate(prompts):
        assert outs[str(i)].output_token_ids == _generate(tuned_dir, prompt, limits[i]), i


@pytest.mark.gpu
def test_temperature_tuning_on_the_gpu_path(tuned_dir: Path) -> None:
    """The same on the GPU: Triton attention, fused ops and CUDA graphs (decode steps replay
    graphs whose position buffer the stand-in cache reads), against the model's own generate
    on the GPU in float32: equal, or diverging only where its top two logits are a rounding
    apart."""
    prompts = random_prompts(1, 100, 100, VOCAB, seed=2) + random_prompts(6, 20, 30, VOCAB, 3)
    config = EngineConfig(device="cuda", dtype="float32", num_kv_blocks=512)
    with Engine(tuned_dir, config) as engine:
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        outs = {o.request_id: o.output_token_ids for o in engine.generate(prompts, params)}
    model = AutoModelForCausalLM.from_pretrained(tuned_dir, attn_implementation="eager")
    model = model.cuda().eval()
    for i, prompt in enumerate(prompts):
        assert_greedy_or_near_tie(model, prompt, outs[str(i)], i)


def test_a_callers_own_forward_is_kept_and_rope_layers_are_left_alone(tuned_dir: Path) -> None:
    """A caller's model whose attention modules carry a forward of their own (a hook set on
    the instance, as accelerate sets): the engine's steps still run through it, and closing
    the engine gives it back; layers that apply rotary embeddings (no tuning) are not wrapped."""
    model = AutoModelForCausalLM.from_pretrained(tuned_dir, attn_implementation="eager").eval()
    layers = [m for m in model.modules() if hasattr(m, "attn_temperature_tuning")]
    calls: list[str] = []
    hooks = {}
    for i, module in enumerate(layers):
        own = module.forward

        def hooked(*args, _own=own, _i=i, **kwargs):
            calls.append(str(_i))
            return _own(*args, **kwargs)

        module.forward = hooks[i] = hooked
    prompt = random_prompts(1, 70, 70, VOCAB, seed=5)[0]
    config = EngineConfig(device="cpu", dtype="float32")
    with Engine(model, config) as engine:
        tuned = [m for m in layers if m.__dict__.get("forward") is not hooks[layers.index(m)]]
        assert tuned and all(not m.use_rope for m in tuned)  # only the NoPE layers are wrapped
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        (out,) = engine.generate([prompt], params)
    assert set(calls) == {str(i) for i in range(len(layers))}  # every hook ran inside steps
    assert all(m.__dict__.get("forward") is hooks[i] for i, m in enumerate(layers))
    for module in layers:
        del module.forward
    assert out.output_token_ids == _generate(tuned_dir, prompt, 8)
