"""LongRoPE (Phi-3/3.5 128k, Phi-4-mini): transformers picks short or long rotary factors from
the largest position of a whole forward pass, which batchgen's packed steps and prefill chunks
do not share with the model's own pass. Such a model is refused beyond
original_max_position_embeddings, and runs exactly (short factors only) within it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchgen import BatchgenError, Engine, EngineConfig, Prompt, SamplingParams
from tests.families import BASE, VOCAB
from tests.helpers import hf_greedy, random_prompts

ORIGINAL = 64  # original_max_position_embeddings of the tiny model
HALF = 8  # head_dim // 2 rotary factors


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("phi3-longrope")
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
        "long_factor": [2.0 + 0.5 * i for i in range(HALF)],
    }
    config = AutoConfig.for_model(
        "phi3",
        **{**BASE, "max_position_embeddings": 256, "original_max_position_embeddings": ORIGINAL},
        initializer_range=0.2,
        rope_scaling=rope,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _config(**overrides: object) -> EngineConfig:
    return EngineConfig(**{"device": "cpu", "dtype": "float32", **overrides})


def test_longrope_beyond_its_original_context_is_refused(longrope_dir: Path) -> None:
    with pytest.raises(BatchgenError) as caught:
        Engine(longrope_dir, _config())  # max_model_len: the model's 256
    message = str(caught.value)
    assert "\n" not in message and "cannot run phi3 models exactly" in message
    assert f"max_model_len (runtime.max_model_len) <= {ORIGINAL}" in message
    with pytest.raises(BatchgenError, match="LongRoPE"):
        Engine(longrope_dir, _config(max_model_len=ORIGINAL + 1))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4, "block_size": 8, "num_kv_blocks": 12}],
    ids=["packed", "chunked-preempted"],
)
def test_longrope_within_its_original_context_runs_exactly(longrope_dir: Path, overrides) -> None:
    """Requests of different lengths share steps (and, with a 16-token budget, prompts are
    chunked and preempted): each equals the model's own generate."""
    prompts = random_prompts(6, 3, 50, VOCAB, seed=1)
    limits = [min(12, ORIGINAL - 1 - len(p)) for p in prompts]  # up to the whole context
    engine = Engine(longrope_dir, _config(max_model_len=ORIGINAL, **overrides))
    rows = [
        Prompt(p, request_id=str(i), sampling={"max_new_tokens": n})
        for i, (p, n) in enumerate(zip(prompts, limits, strict=True))
    ]
    outs = {o.request_id: o for o in engine.generate(rows, SamplingParams(ignore_eos=True))}
    for i, prompt in enumerate(prompts):
        assert outs[str(i)].output_token_ids == hf_greedy(longrope_dir, prompt, limits[i]), i
    engine.close()


def test_a_caller_longrope_model_keeps_its_cache_between_calls(longrope_dir: Path) -> None:
    """LongRoPE writes its factors into inv_freq at every forward (a version bump, the same
    values): the next call still finds its prompts cached, under the same fingerprint."""
    model = AutoModelForCausalLM.from_pretrained(longrope_dir, dtype=torch.float32).eval()
    prompts = random_prompts(3, 40, 40, VOCAB, seed=2)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with Engine(model, _config(max_model_len=ORIGINAL, block_size=8)) as engine:
        first = {o.request_id: o.output_token_ids for o in engine.generate(prompts, params)}
        fingerprint, stats = engine.fingerprint, engine.cache_stats
        model(torch.tensor([prompts[0]]))  # the caller's own forward meanwhile
        assert {o.request_id: o.output_token_ids for o in engine.generate(prompts, params)} == first
        assert (engine.cache_stats - stats).cached_tokens == 4 * 8 * len(prompts)
        assert engine.fingerprint == fingerprint
