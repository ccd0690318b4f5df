"""What a job does before its first step: its first tokenizer tasks are small (the engine waits
for one of them), and the prompt builder reads the vocabulary only for a prompt long enough to
need it."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from transformers import AutoTokenizer

from batchgen.engine.sampling_params import SamplingParams
from batchgen.io import RawRow
from batchgen.pipeline import FIRST_PREPARE_ROWS, PREPARE_ROWS, Producer
from batchgen.prompts import CHAR_SLACK, PromptBuilder, PromptConfig, RowPrompt


class RecordingPool:
    """A tokenizer pool that prepares rows at once and records each task's size."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def prepare(self, rows: list[tuple[RawRow, str | None]], hash_rows: bool) -> Future:
        self.sizes.append(len(rows))
        task: Future = Future()
        task.set_result([RowPrompt(r.index, str(r.index), [1], {}, {}, None) for r, _ in rows])
        return task


def test_the_first_tokenizer_tasks_are_small_then_grow_to_full_size() -> None:
    rows = [RawRow(i, {"prompt": "x"}, None) for i in range(1000)]
    batches = iter([rows[i : i + 300] for i in range(0, len(rows), 300)])
    pool = RecordingPool()
    producer = Producer(batches, pool, set(), None, 4096, threading.Event())
    producer.start()
    out = []
    while (row := producer.next_row(5.0)) is not None:
        out.append(row.index)
    producer.join()
    assert producer.error is None and out == list(range(1000)), "each row once, in order"
    ramp = [FIRST_PREPARE_ROWS * 2**i for i in range(4)]
    assert ramp[0] < PREPARE_ROWS and ramp[-1] == PREPARE_ROWS
    assert pool.sizes[: len(ramp)] == ramp
    assert max(pool.sizes) == PREPARE_ROWS and sum(pool.sizes) == 1000


class CountingTokenizer:
    """A tokenizer that counts how often its vocabulary is read."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner, self.vocab_reads = tokenizer, 0

    def get_vocab(self) -> dict[str, int]:
        self.vocab_reads += 1
        return self.inner.get_vocab()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def test_the_vocabulary_is_read_only_for_a_prompt_that_may_not_fit(model_dir) -> None:
    tok = CountingTokenizer(AutoTokenizer.from_pretrained(model_dir("llama")))
    max_tokens = 20
    config = PromptConfig(truncate="right")
    builder = PromptBuilder(config, tok, max_tokens, SamplingParams(max_new_tokens=4))
    short = "a" * (CHAR_SLACK * max_tokens)  # fits in characters whatever the tokens are
    (row,) = builder.build_many([(0, {"prompt": short})])
    assert row.error is None and tok.vocab_reads == 0
    longest = max(len(t) for t in tok.inner.get_vocab())
    bound = CHAR_SLACK * max_tokens * longest
    long = "word " * (bound // 5 + 10)
    rows = builder.build_many([(1, {"prompt": long}), (2, {"prompt": long})])
    assert tok.vocab_reads == 1, "read once, then kept"
    kept = max_tokens + 1 - 4  # the context (max_tokens + 1) less the new tokens
    assert all(r.error is None and len(r.prompt_ids) == kept for r in rows)
    assert builder.max_prompt_chars == bound
    cut = PromptBuilder(PromptConfig(), tok, max_tokens, SamplingParams(max_new_tokens=4))
    (err,) = cut.build_many([(3, {"prompt": long})])
    assert err.error is not None and "characters" in err.error
