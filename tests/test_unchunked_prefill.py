"""enable_chunked_prefill=false: a whole prompt, or a preempted request's recompute of its prompt
and outputs, runs in one step, so a token budget below max_model_len is refused up front (one
line, before the start-up check or any output), and one that holds it runs through
preemption exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen import BatchgenError, Engine, EngineConfig, SamplingParams
from batchgen.cli import main
from batchgen.engine.probe import ModelRefused
from tests.helpers import hf_greedy, random_prompts


def _config(**overrides: object) -> EngineConfig:
    base = {"device": "cpu", "dtype": "float32", "enable_chunked_prefill": False}
    return EngineConfig(**{**base, "max_num_seqs": 2, **overrides})


@pytest.mark.parametrize("budget", [8, 40])
def test_unchunked_budget_below_the_context_is_refused(model_dir, budget: int) -> None:
    with pytest.raises(BatchgenError) as caught:
        Engine(model_dir(), _config(max_num_batched_tokens=budget))
    message = str(caught.value)
    assert not isinstance(caught.value, ModelRefused), message  # not the start-up check's
    assert "\n" not in message
    assert f"max_num_batched_tokens ({budget})" in message and "max_model_len (" in message
    with pytest.raises(BatchgenError, match=r"max_model_len \(41\)"):
        Engine(model_dir(), _config(max_num_batched_tokens=40, max_model_len=41))


def test_unchunked_budget_that_holds_the_context_runs_through_preemption(model_dir) -> None:
    path = model_dir()
    config = _config(
        max_num_batched_tokens=64, max_model_len=64, max_num_seqs=4, block_size=8,
        num_kv_blocks=12, enable_prefix_caching=False,
    )  # fmt: skip
    prompts = random_prompts(2, 36, 36, 1000, seed=3)
    with Engine(path, config) as engine:
        params = SamplingParams(max_new_tokens=27, ignore_eos=True)
        outs = {o.request_id: o for o in engine.generate(prompts, params, decode=False)}
        assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert outs[str(i)].output_token_ids == hf_greedy(path, prompt, 27), i


def test_the_cli_refuses_an_unchunked_budget_below_the_context(model_dir, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "hi"}) + "\n")
    sets = ["enable_chunked_prefill=false", "max_num_batched_tokens=48", "max_num_seqs=4"]
    args = ["run", "--model", str(model_dir()), "--input", str(inp)]
    args += ["--output", str(tmp_path / "out"), "--quiet"]
    for setting in sets:
        args += ["--set", f"runtime.{setting}"]
    result = CliRunner().invoke(main, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "max_num_batched_tokens (48)" in lines[0]
    assert not (tmp_path / "out").exists()


def test_an_unset_budget_holds_the_context_without_chunking(model_dir) -> None:
    """As vLLM: with chunked prefill off and no budget given, a step holds a whole sequence
    (the default budget, 8,192 on a CPU, is raised to a longer context), not refused."""
    long = model_dir("llama", max_position_embeddings=12288)
    engine = Engine(long, _config(num_kv_blocks=64))
    assert engine.config.max_num_batched_tokens == engine.max_model_len == 12288
    engine.close()
