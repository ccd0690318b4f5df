"""Every Hugging Face decoder family either runs exactly (greedy tokens equal to its own
`generate` with eager attention, through mixed prefill/decode steps, chunked prefill and
preemption) or is refused with one line before any output exists."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen import BatchgenError, Engine, EngineConfig, SamplingParams
from batchgen.engine.attention import hf_adapter
from tests.families import FAMILIES, VOCAB, build_family_model

# families whose layers batchgen cannot run exactly (with some transformers release, at
# least), and the reason each is refused for
REFUSED = {
    "mpt": "do not hand attention to transformers' attention interface",
    "bloom": "do not hand attention to transformers' attention interface",
    "mamba": "do not hand attention to transformers' attention interface",
    "falcon": "does not route attention through transformers' attention interface",
    "gpt_neo": "does not route attention through transformers' attention interface",
    "jamba": "mix tokens without attention",
    "lfm2": "mix tokens without attention",
    "qwen3_next": "mix tokens without attention",
}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("families")

    def build(family: str) -> Path:
        if family not in cache:
            cache[family] = build_family_model(family, root / family)
        return cache[family]

    return build


def probe_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, VOCAB) for _ in range(rng.randint(3, 80))] for _ in range(8)]


def engine_config(**overrides) -> EngineConfig:
    # a 64-token budget: prefill chunks and decodes share steps; 16 blocks of 16: preemption
    base = {"device": "cpu", "dtype": "float32", "max_num_seqs": 8}
    return EngineConfig(**{**base, "max_num_batched_tokens": 64, "num_kv_blocks": 16, **overrides})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_runs_exactly_or_is_refused(family_dir, family: str) -> None:
    path = family_dir(family)
    try:
        engine = Engine(path, engine_config())
    except BatchgenError as exc:
        message = str(exc)
        assert family in REFUSED, message
        assert "\n" not in message and f"cannot run {family.split('-')[0]} models" in message
        assert REFUSED[family] in message, message
        return
    # a family refused with one transformers release may run with another (falcon's layers
    # call the attention interface from 5.25 on): then it runs exactly like any other
    prompts = probe_prompts()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outs = {o.request_id: o for o in engine.generate(prompts, params, decode=False)}
    assert engine.scheduler.num_preemptions > 0, "the small cache forces preemption"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            ref = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert outs[str(i)].output_token_ids == ref, (family, i)


def test_a_refused_model_leaves_no_output(family_dir, tmp_path: Path) -> None:
    from tests.test_job import spec_for, write_jsonl

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    spec = spec_for(family_dir("jamba"), inp, tmp_path / "out")
    from batchgen.job import run_job

    with pytest.raises(BatchgenError, match="cannot run jamba models exactly"):
        run_job(spec)
    assert not (tmp_path / "out").exists()


def test_an_attention_argument_batchgen_ignores_is_refused(family_dir, monkeypatch) -> None:
    """The guard is general: any argument a layer passes that batchgen does not implement."""
    monkeypatch.setattr(hf_adapter, "HANDLED_KWARGS", hf_adapter.HANDLED_KWARGS - {"softcap"})
    with pytest.raises(BatchgenError, match="passes 'softcap' to attention"):
        Engine(family_dir("gemma2"), engine_config())


def test_a_wrong_attention_is_refused_by_the_probe(family_dir, monkeypatch) -> None:
    """Dropping a feature silently (here: the sinks) shows up as outputs that differ from the
    model's own forward pass."""
    real = hf_adapter.layer_spec

    def without_sinks(*args, **kwargs):
        return real(*args, **kwargs).__class__(**{**vars(real(*args, **kwargs)), "sinks": None})

    monkeypatch.setattr(hf_adapter, "layer_spec", without_sinks)
    with pytest.raises(BatchgenError, match="differ from its own forward pass"):
        Engine(family_dir("gpt_oss"), engine_config())


def test_the_cli_reports_a_refused_family_in_one_line(family_dir, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from batchgen.cli import main

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    args = ["run", "--model", str(family_dir("mamba")), "--input", str(inp)]
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "o"), "--quiet"])
    lines = [x for x in result.output.splitlines() if x.startswith("batchgen:")]
    assert result.exit_code == 2 and len(lines) == 1 and "cannot run mamba" in lines[0]


def test_a_forward_that_fails_midway_is_refused_for_failing(family_dir) -> None:
    """Layers the start-up shape probe never reached because the forward pass raised are
    reported as that failure, not as layers that mix tokens without attention."""
    model = AutoModelForCausalLM.from_pretrained(family_dir("llama")).eval()

    def broken(*args, **kwargs):
        raise RuntimeError("expert routing broke")

    model.model.layers[0].mlp.forward = broken  # after layer 0's attention, before layer 1's
    with pytest.raises(BatchgenError) as caught:
        Engine(model, engine_config())
    message = str(caught.value)
    assert "\n" not in message and "cannot run llama models exactly" in message
    assert "its forward pass fails (RuntimeError: expert routing broke)" in message, message


def test_a_forward_that_fails_before_any_attention_is_refused_for_failing(family_dir) -> None:
    """A model whose own forward pass fails before its first attention call (DBRX with its
    config's default clip_qkv=None) is refused for failing, not for attention it never reached."""
    model = AutoModelForCausalLM.from_pretrained(family_dir("llama")).eval()

    def broken(*args, **kwargs):
        raise RuntimeError("clamp needs min or max")

    model.model.layers[0].input_layernorm.forward = broken
    with pytest.raises(BatchgenError) as caught:
        Engine(model, engine_config())
    message = str(caught.value)
    assert "\n" not in message and "cannot run llama models exactly" in message
    assert "its own forward pass fails (RuntimeError: clamp needs min or max)" in message, message


def test_a_model_whose_own_pass_fails_on_the_probe_is_refused(family_dir, monkeypatch) -> None:
    """The probe's reference (the model's own eager attention) failing where batchgen's steps
    ran (an MLA config whose own attention cannot broadcast its heads, for one) is one line."""
    from transformers.models.llama import modeling_llama

    def broken(*args, **kwargs):
        raise RuntimeError("The size of tensor a (4) must match the size of tensor b (8)")

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", broken)
    with pytest.raises(BatchgenError) as caught:
        Engine(family_dir("llama"), engine_config())
    message = str(caught.value)
    assert "\n" not in message and "cannot run llama models exactly" in message
    assert "its own forward pass fails on the probe input (RuntimeError: The size" in message
