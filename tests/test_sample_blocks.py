"""The n samples of a prompt under a small KV cache, with prefix caching on and off: samples
waiting for admission hold no blocks, so preemption and an early stop can always reclaim them.

Each run steps the engine by hand and checks the block manager's invariants after every step.
"""

from __future__ import annotations

import random

import pytest

from batchgen import Engine, EngineConfig, SamplingParams
from tests.helpers import run_checked

PARAMS = SamplingParams(max_new_tokens=15, ignore_eos=True, n=3)


def engine_for(path, caching: bool, **config) -> Engine:
    config.setdefault("num_kv_blocks", 128)
    cfg = EngineConfig(
        dtype="float32", device="cpu", check_model=False, enable_prefix_caching=caching, **config
    )
    return Engine(path, cfg)


def prompts_of(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_samples_fit_a_cache_with_room_for_one_at_a_time(model_dir, caching: bool) -> None:
    """A 59-token prompt, 3 samples of 15 tokens, 5 blocks of 16: one sample runs at a time
    (each needs all 5). Waiting samples holding the first one's prompt blocks left the head
    of the queue unable to start with nothing running."""
    path = model_dir("llama")
    (prompt,) = prompts_of(1, 59, seed=0)
    small = run_checked(
        engine_for(path, caching, block_size=16, num_kv_blocks=5, max_num_seqs=6),
        [prompt],
        PARAMS,
    )
    roomy = run_checked(engine_for(path, caching, block_size=16), [prompt], PARAMS)
    assert small == roomy and len(small) == 3


def test_samples_share_the_prompt_blocks_without_caching(model_dir) -> None:
    """With caching off the other samples still start from the first one's full prompt
    blocks (taken when they are admitted), all but the one holding the last prompt token."""
    engine = engine_for(model_dir("llama"), False, block_size=8, max_num_seqs=8)
    (prompt,) = prompts_of(1, 29, seed=1)
    assert engine.add_request(prompt, PARAMS, default_id="0") is None
    first = engine.scheduler.waiting[0]
    engine.step()  # prefills the prompt
    assert not engine.scheduler.waiting or all(not r.block_table for r in engine.scheduler.waiting)
    engine.step()  # forks and admits the other samples
    others = [r for r in engine.scheduler.running if r is not first]
    assert len(others) == 2
    for other in others:
        assert other.block_table[:3] == first.block_table[:3]  # (29 - 1) // 8 blocks
        assert other.block_table[3] != first.block_table[3]
    while engine.has_unfinished():
        engine.step()
    engine.blocks.check_released()
    assert engine.cache_stats.cached_tokens == 0


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_stopping_early_gives_every_block_back(model_dir, caching: bool) -> None:
    """A caller that stops reading while samples still wait leaves the engine usable."""
    engine = engine_for(model_dir("llama"), caching, block_size=16, num_kv_blocks=64,
                        max_num_seqs=2)  # fmt: skip
    prompts = prompts_of(3, 40, seed=2)
    params = PARAMS.replace(n=4, max_new_tokens=8)
    for _ in engine.generate(prompts, params):
        break
    engine.blocks.check_released()
    assert len(list(engine.generate(prompts, params))) == 12
    engine.close()


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_an_interrupt_while_samples_wait_reaches_the_caller(model_dir, caching: bool) -> None:
    """Ctrl-C during a step while forked samples wait: the interrupt itself comes out, not
    an error from dropping the unfinished requests, and every block is given back."""
    engine = engine_for(model_dir("llama"), caching, block_size=16, max_num_seqs=2)
    step = engine.step

    def interrupted() -> list:
        if any(r.sample_index > 0 for r in engine.scheduler.waiting):
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        list(engine.generate(prompts_of(3, 40, seed=3), PARAMS.replace(n=4)))
    engine.blocks.check_released()
    engine.close()


def test_an_error_is_not_hidden_by_the_cleanup_after_it(model_dir) -> None:
    """When a step fails and dropping the unfinished requests then fails too, the step's
    error is what the caller gets (the cleanup's failure noted on it), from generate and
    from the `with` block that closes the engine."""
    engine = engine_for(model_dir("llama"), False, block_size=16)
    schedule = engine.scheduler.schedule

    def failing():
        schedule()
        engine.blocks.check_released = _broken  # the cleanup will fail as well
        raise RuntimeError("scheduling failed")

    engine.scheduler.schedule = failing
    with pytest.raises(RuntimeError, match="scheduling failed") as caught, engine:
        list(engine.generate(prompts_of(2, 20, seed=4), PARAMS))
    assert [n for n in caught.value.__notes__ if "blocks are held" in n]
    assert engine.runner is None, "closed all the same"


def _broken() -> None:
    raise AssertionError("blocks are held after every request ended")


@pytest.mark.parametrize("seed", range(12))
def test_random_samples_under_small_caches(model_dir, seed: int) -> None:
    """Random prompt lengths, n, budgets and cache sizes down to one sequence's worth: the
    same tokens with caching on as off, and as with a cache that never preempts."""
    rng = random.Random(seed)
    block_size = rng.choice([8, 16])
    prompts = [
        prompts_of(1, rng.randint(1, 40), seed * 100 + i)[0] for i in range(rng.randint(1, 5))
    ]
    params = SamplingParams(
        max_new_tokens=rng.randint(1, 12), ignore_eos=True, temperature=0.9, seed=seed,
        n=rng.randint(2, 4),
    )  # fmt: skip
    longest = max(map(len, prompts)) + params.max_new_tokens
    config = dict(
        block_size=block_size,
        max_num_seqs=rng.randint(1, 8),
        overlap=rng.random() < 0.5,
        max_num_batched_tokens=rng.choice([64, rng.randint(8, 48)]),
    )
    if rng.random() < 0.3:  # whole prompts (and recomputes) in one step
        config.update(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    small = -(-longest // block_size) + rng.randint(0, 2)
    path = model_dir("llama")
    roomy = run_checked(engine_for(path, True, **config), prompts, params)
    for caching in (True, False):
        got = run_checked(engine_for(path, caching, num_kv_blocks=small, **config), prompts, params)
        assert got == roomy, (caching, config, small)
