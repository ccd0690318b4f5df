"""Greedy token parity with Hugging Face generate (float32, CPU, reference attention).

Comparison is token-for-token: the tiny models are initialised with a large initializer_range,
so argmax margins are far above float32 rounding and every position must match exactly.
"""

from __future__ import annotations

import pytest

from batchgen import Engine, EngineConfig, Prompt, SamplingParams
from tests.conftest import ARCHS
from tests.helpers import EagerPadding, hf_greedy, random_prompts

VOCAB_LOW = 1000  # prompt ids are drawn below this; the tiny vocab is at least this large


def engine_for(path, **overrides) -> Engine:
    return Engine(path, EngineConfig(dtype="float32", device="cpu", **overrides))


def run(engine: Engine, prompts, params: SamplingParams) -> dict[str, list[int]]:
    outs = {o.request_id: o for o in engine.generate(prompts, params, decode=False)}
    assert all(o.finish_reason != "error" for o in outs.values()), outs
    return {k: o.output_token_ids for k, o in outs.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_single_requests(model_dir, arch: str) -> None:
    path = model_dir(arch)
    engine = engine_for(path)
    for prompt in random_prompts(3, 1, 40, VOCAB_LOW, seed=1):
        got = run(engine, [prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))["0"]
        assert got == hf_greedy(path, prompt, 24)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_staggered(model_dir, arch: str, overlap: bool) -> None:
    """Requests of different lengths and limits: admitted, finished and refilled mid-run."""
    path = model_dir(arch)
    prompts = random_prompts(10, 2, 50, VOCAB_LOW, seed=7)
    limits = [5 + 3 * i for i in range(len(prompts))]
    engine = engine_for(path, max_num_seqs=4, max_num_batched_tokens=64, overlap=overlap)
    items = [
        Prompt(p, sampling={"max_new_tokens": n}) for p, n in zip(prompts, limits, strict=True)
    ]
    got = run(engine, items, SamplingParams(ignore_eos=True))
    for i, (prompt, n) in enumerate(zip(prompts, limits, strict=True)):
        assert got[str(i)] == hf_greedy(path, prompt, n), f"request {i}"


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(model_dir, arch: str) -> None:
    path = model_dir(arch)
    prompts = random_prompts(6, 30, 90, VOCAB_LOW, seed=3)
    engine = engine_for(path, max_num_seqs=8, max_num_batched_tokens=16)
    got = run(engine, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, 12), f"request {i}"


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_by_tiny_kv_cache(model_dir, arch: str, overlap: bool) -> None:
    path = model_dir(arch)
    prompts = random_prompts(8, 10, 40, VOCAB_LOW, seed=11)
    engine = engine_for(
        path,
        block_size=8,
        num_kv_blocks=14,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        overlap=overlap,
    )
    got = run(engine, prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, 40), f"request {i}"
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_batch_with_prefix_caching(model_dir, arch: str) -> None:
    """Prompts that share a system prompt, duplicate or prefix one another: what the prefix
    cache serves is what Hugging Face computes."""
    path = model_dir(arch)
    prefix = random_prompts(1, 35, 35, VOCAB_LOW, seed=13)[0]
    tails = random_prompts(5, 1, 12, VOCAB_LOW, seed=14)
    prompts = [prefix + t for t in tails] + [prefix, prefix[:16], prefix + tails[0]]
    engine = engine_for(path, block_size=8, max_num_seqs=4, max_num_batched_tokens=32)
    got = run(engine, prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert engine.cache_stats.cached_tokens >= 7 * 16
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, 10), f"request {i}"


def test_overlapped_and_synchronous_loops_agree_sampled(model_dir) -> None:
    path = model_dir("llama")
    prompts = random_prompts(9, 3, 30, VOCAB_LOW, seed=5)
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=123)
    a = run(engine_for(path, overlap=True, max_num_seqs=3), prompts, params)
    b = run(engine_for(path, overlap=False, max_num_seqs=5), prompts, params)
    assert a == b


def test_stop_token_ends_like_hf_eos(model_dir) -> None:
    """A stop token ends the request after emitting it, as HF generate does for EOS."""
    path = model_dir("llama")
    prompt = random_prompts(1, 8, 8, VOCAB_LOW, seed=2)[0]
    free_run = hf_greedy(path, prompt, 30)
    stop = free_run[10]
    expected = hf_greedy(path, prompt, 30, eos_token_id=stop)
    assert expected[-1] == stop and len(expected) <= 11
    engine = engine_for(path)
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=30, stop_token_ids=(stop,)))
    assert out.output_token_ids == expected and out.finish_reason == "stop"


def test_end_of_sequence_ids_come_from_generation_config_json_where_the_folder_has_one(
    model_dir, tmp_path
) -> None:
    """config.json's eos_token_id counts only where the folder has no generation_config.json
    (transformers then derives one from config.json); a generation_config.json that names no
    end-of-sequence id leaves the tokenizer's alone, as Hugging Face generate and vLLM stop."""
    import json
    import shutil

    path = model_dir("llama")
    prompt = random_prompts(1, 8, 8, VOCAB_LOW, seed=2)[0]
    free_run = hf_greedy(path, prompt, 20)
    other = free_run[5]  # config.json's end-of-sequence id below: not the tokenizer's
    params = SamplingParams(max_new_tokens=20)
    for name, generation_config in (("named-none", {"bos_token_id": 0}), ("absent", None)):
        folder = shutil.copytree(path, tmp_path / name)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": other}))
        (folder / "generation_config.json").unlink()
        if generation_config is not None:
            (folder / "generation_config.json").write_text(json.dumps(generation_config))
        (out,) = engine_for(folder).generate([prompt], params)
        expected = (
            free_run if generation_config is not None else free_run[: free_run.index(other) + 1]
        )
        assert out.output_token_ids == expected, name


def test_sliding_window_matches_hf(model_dir) -> None:
    path = model_dir("mistral", sliding_window=8)
    prompts = random_prompts(3, 5, 30, VOCAB_LOW, seed=9)
    got = run(
        engine_for(path, max_num_seqs=4, max_num_batched_tokens=16),
        prompts,
        SamplingParams(max_new_tokens=20, ignore_eos=True),
    )
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, 20), f"request {i}"


def test_padded_decode_steps_give_the_same_tokens(model_dir) -> None:
    """Graph-style padding rows (pad slot, scratch block) change nothing in the real rows."""
    path = model_dir("llama")
    prompts = random_prompts(7, 3, 30, VOCAB_LOW, seed=21)
    engine = engine_for(path, max_num_seqs=8, max_num_batched_tokens=32, block_size=8)
    engine.runner.graphs = EagerPadding(engine.runner, (2, 4, 8))
    got = run(engine, prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert len(engine.runner.graphs.replays) > 10
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, 16), f"request {i}"


def test_decode_steps_on_a_larger_graph_give_the_same_tokens(model_dir) -> None:
    """first_use: a decode size without its graph takes the padded shape of the largest one
    (up to 7 padding rows here) until its capture step: the real rows' tokens are unchanged,
    greedy (Hugging Face's) and sampled (an engine without padding)."""
    import collections

    from batchgen.engine.graphs import CAPTURE_AT_STEP
    from batchgen.engine.step_inputs import Pad

    path = model_dir("llama")
    prompts = random_prompts(7, 3, 30, VOCAB_LOW, seed=22)
    limits = [3 + 4 * i for i in range(len(prompts))]  # the batch shrinks to 4, 2, 1 rows
    settings = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8}
    greedy = [Prompt(p, sampling={"max_new_tokens": n, "ignore_eos": True})
              for p, n in zip(prompts, limits, strict=True)]  # fmt: skip
    sampled = [Prompt(p, sampling={"max_new_tokens": n, "ignore_eos": True, "temperature": 0.9,
                                   "top_p": 0.9, "seed": i})
               for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]  # fmt: skip
    unpadded = run(engine_for(path, **settings), sampled, SamplingParams())
    engine = engine_for(path, **settings)
    graphs = engine.runner.graphs = EagerPadding(engine.runner, (2, 4, 8))
    graphs.first_use, graphs.borrowed = True, collections.Counter()
    graphs.graphs, graphs.eager = {Pad(8, 8, 8): None}, set()  # the largest "captured"
    got = run(engine, greedy, SamplingParams())
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, limits[i]), f"request {i}"
    # sizes 4 and 2 took the largest's shape for CAPTURE_AT_STEP - 1 steps each, then their own
    assert graphs.borrowed[Pad(4, 4, 4)] > CAPTURE_AT_STEP < graphs.borrowed[Pad(2, 2, 2)]
    assert (4, 4, 4) in graphs.replays and (2, 2, 2) in graphs.replays
    assert graphs.replays.count((8, 8, 8)) >= 2 * (CAPTURE_AT_STEP - 1)
    assert run(engine, sampled, SamplingParams()) == unpadded


def test_steps_stopped_at_graph_sizes(model_dir) -> None:
    """A GPU engine with token graphs stops admitting prompts at a token size (step_target),
    cutting a prompt between two steps: the tokens stay Hugging Face's."""
    import functools

    from batchgen.engine.graphs import step_target

    path = model_dir("llama")
    prompts = random_prompts(12, 150, 300, VOCAB_LOW, seed=5)
    engine = engine_for(path, max_num_seqs=8, max_num_batched_tokens=4096)
    sizes = (1024, 1536, 2048, 3072, 4096)
    engine.scheduler.step_target = functools.partial(step_target, sizes)
    steps = []
    schedule = engine.scheduler.schedule

    def recorded():
        batch = schedule()
        steps.append(batch)
        return batch

    engine.scheduler.schedule = recorded
    got = run(engine, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    cut = [b for b in steps if b.num_tokens in sizes and not b.chunks[-1].samples]
    assert cut, "no step stopped inside a prompt at a token size"
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, 12), f"request {i}"
