"""Prefix caching in the engine: the same tokens with the cache on as off, on inputs that share
prefixes, under every scheduling path that touches KV blocks (float32, CPU, reference attention).

Each run steps the engine by hand and checks the block manager's invariants after every step.
"""

from __future__ import annotations

import random

import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.engine.prefix_cache import CacheStats
from tests.helpers import Outputs, run_checked

VOCAB_LOW = 1000


def shared_prefix_prompts(
    n: int, prefix_len: int, suffix: tuple[int, int], seed: int, which: list[int] | None = None
) -> list[list[int]]:
    """n prompts: a shared prefix (prefix number which[i]; default 0) + a random suffix each."""
    rng = random.Random(seed)
    which = which or [0] * n
    prefixes = [[rng.randrange(5, VOCAB_LOW) for _ in range(prefix_len)] for _ in set(which)]
    return [
        prefixes[which[i]] + [rng.randrange(5, VOCAB_LOW) for _ in range(rng.randint(*suffix))]
        for i in range(n)
    ]


def on_and_off(
    path, prompts: list[list[int]], params: SamplingParams, **config
) -> tuple[Outputs, Outputs, Engine]:
    """-> (outputs with caching, outputs without, the caching engine)."""
    results = []
    config.setdefault("num_kv_blocks", 128)  # not the CPU default's 1 GiB: tests stay fast
    for caching in (True, False):
        cfg = EngineConfig(
            dtype="float32", device="cpu", check_model=False, enable_prefix_caching=caching,
            **config,
        )  # fmt: skip
        engine = Engine(path, cfg)
        results.append((run_checked(engine, prompts, params), engine))
    (on, engine_on), (off, engine_off) = results
    assert engine_off.cache_stats.cached_tokens == 0
    assert engine_off.cache_stats.prompt_tokens == engine_on.cache_stats.prompt_tokens
    return on, off, engine_on


GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=7)
# penalties count the prompt's tokens, cached or not; top-k / top-p filter as always
FILTERED = SEEDED.replace(repetition_penalty=1.3, presence_penalty=0.5, top_k=20, top_p=0.9)


@pytest.mark.parametrize(
    "params", [GREEDY, SEEDED, FILTERED], ids=["greedy", "seeded", "penalties"]
)
@pytest.mark.parametrize("overlap", [True, False])
def test_shared_system_prompt(model_dir, params: SamplingParams, overlap: bool) -> None:
    prompts = shared_prefix_prompts(8, 37, (1, 20), seed=1)
    on, off, engine = on_and_off(
        model_dir("llama"), prompts, params, block_size=8, max_num_seqs=4, overlap=overlap
    )
    assert on == off
    stats = engine.cache_stats
    assert stats.prompt_tokens == sum(map(len, prompts))
    # the first request computes the prefix's 4 full blocks; the 7 others find them
    assert stats.cached_tokens == 7 * 32


def test_cached_tokens_cost_no_step_budget(model_dir) -> None:
    """All requests start in the first step, and the prefix is computed there once."""
    prompts = shared_prefix_prompts(4, 40, (3, 3), seed=2)
    cfg = EngineConfig(
        dtype="float32", device="cpu", check_model=False, block_size=8, num_kv_blocks=64
    )
    engine = Engine(model_dir("llama"), cfg)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, GREEDY, default_id=str(i))
    batch = engine.scheduler.schedule()
    assert [c.start for c in batch.chunks] == [0, 40, 40, 40]
    assert batch.num_tokens == 43 + 3 * 3
    assert engine.cache_stats == CacheStats(4 * 43, 3 * 40)


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_under_a_small_kv_cache(model_dir, overlap: bool) -> None:
    prompts = shared_prefix_prompts(8, 21, (2, 18), seed=3)
    on, off, engine = on_and_off(
        model_dir("llama"), prompts, SamplingParams(max_new_tokens=30, ignore_eos=True),
        block_size=8, num_kv_blocks=14, max_num_seqs=6, max_num_batched_tokens=48,
        overlap=overlap,
    )  # fmt: skip
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    assert engine.cache_stats.cached_tokens > 0
    assert on == off


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_n_samples_share_the_prompt_through_the_cache(model_dir, params: SamplingParams) -> None:
    prompts = shared_prefix_prompts(4, 19, (5, 14), seed=4)
    params = params.replace(n=3)
    on, off, engine = on_and_off(model_dir("llama"), prompts, params, block_size=8, max_num_seqs=8)
    assert on == off and len(on) == 12
    assert engine.cache_stats.prompt_tokens == 3 * sum(map(len, prompts))
    # every sample after the first finds at least the shared prefix's 2 full blocks
    assert engine.cache_stats.cached_tokens >= (12 - 1) * 16


def test_chunk_boundaries_inside_the_prefix(model_dir) -> None:
    """A 13-token budget cuts prompts in chunks that end mid-block; ever longer pieces of one
    45-token prefix: each prompt finds part of it cached and computes the rest in chunks."""
    (prefix,) = shared_prefix_prompts(1, 45, (0, 0), seed=5)
    rng = random.Random(5)
    prompts = [
        prefix[:n] + [rng.randrange(5, VOCAB_LOW) for _ in range(rng.randint(1, 12))]
        for n in (13, 26, 45, 45, 30, 45, 20)
    ]
    on, off, engine = on_and_off(
        model_dir("llama"), prompts, GREEDY, block_size=8, max_num_seqs=4,
        max_num_batched_tokens=13,
    )  # fmt: skip
    # at least: 8 + 24 + 40 + 40 + 24 + 40 + 16 tokens of the prefix, after the first prompt
    assert engine.cache_stats.cached_tokens >= 8 + 24 + 40 + 24 + 40 + 16
    assert on == off


def test_prefixes_longer_than_the_cache_holds(model_dir) -> None:
    """Three 60-token prefixes, two prompts each in turn, then the first again; the cache holds
    one request at a time: blocks are found again, evicted, and nothing changes the tokens."""
    which = [0, 0, 1, 1, 2, 2, 0, 0, 1]
    prompts = shared_prefix_prompts(9, 60, (1, 10), seed=6, which=which)
    on, off, engine = on_and_off(
        model_dir("llama"), prompts, SamplingParams(max_new_tokens=16, ignore_eos=True),
        block_size=8, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=32,
    )  # fmt: skip
    assert on == off
    assert 0 < engine.cache_stats.cached_tokens < 6 * 56


def test_exact_duplicates_and_prompts_that_prefix_others(model_dir) -> None:
    rng = random.Random(8)
    base = [rng.randrange(5, VOCAB_LOW) for _ in range(40)]  # exactly 5 blocks of 8
    prompts = [
        base, list(base), base[:24], base[:29], base + base[:3], base[:7], base[:8],
        list(base[:8]), base[:33], base,
    ]  # fmt: skip
    for order in (prompts, prompts[::-1]):  # the longer one first, and the shorter one first
        on, off, engine = on_and_off(
            model_dir("llama"), order, SEEDED, block_size=8, max_num_seqs=3
        )
        assert on == off
        assert engine.cache_stats.cached_tokens > 0


def test_a_step_that_fails_to_launch_leaves_nothing_cached(model_dir) -> None:
    """Blocks are cached when their step is scheduled; if it never launches, none stays."""
    prompts = shared_prefix_prompts(3, 30, (2, 5), seed=9)
    cfg = EngineConfig(
        dtype="float32", device="cpu", check_model=False, block_size=8, num_kv_blocks=64
    )
    engine = Engine(model_dir("llama"), cfg)
    run_checked(engine, prompts[:1], GREEDY)
    assert engine.blocks.cache.num_pooled > 0

    def fail(batch):
        raise RuntimeError("device lost")

    engine.runner.launch = fail
    engine.add_request(prompts[1], GREEDY, default_id="late")
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.abort_all()  # checks the invariants: no free block is cached
    assert engine.blocks.cache.num_pooled == 0
    assert engine.blocks.num_free_blocks == engine.num_blocks


def test_the_start_up_probe_leaves_no_trace(model_dir) -> None:
    engine = Engine(
        model_dir("llama"), EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64)
    )
    assert engine.cache_stats == CacheStats()
    assert engine.blocks.cache.num_pooled == 0


def test_the_engine_hides_its_start_up_heap_from_the_collector_until_closed(model_dir) -> None:
    """Full collections during generation skip what start-up made (the model, torch's and
    transformers' objects); close() hands it back. Garbage made later is still collected."""
    import gc
    import weakref

    gc.unfreeze()
    engine = Engine(model_dir("llama"), EngineConfig(device="cpu"))
    try:
        assert gc.get_freeze_count() > 1000
        assert all(o is not engine.model for o in gc.get_objects(2))  # frozen: not in gen 2
        cycle = [SamplingParams()]
        cycle.append(cycle)
        alive = weakref.ref(cycle[0])
        del cycle
        gc.collect()
        assert alive() is None  # cyclic garbage made after start-up is still collected
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0
