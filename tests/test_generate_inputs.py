"""What Engine.generate is given: one prompt or many, params per prompt, ids, one call at a
time."""

from __future__ import annotations

import pytest

from batchgen import Engine, EngineConfig, Prompt, SamplingParams

PARAMS = SamplingParams(max_new_tokens=3)


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(model_dir("llama"), EngineConfig(device="cpu", dtype="float32", max_num_seqs=4))


def _run(engine: Engine, prompts: object, params: object = PARAMS) -> list:
    return list(engine.generate(prompts, params))  # type: ignore[arg-type]


def test_a_single_prompt_is_one_request(engine: Engine) -> None:
    (text,) = _run(engine, ["Hello there"])
    (ids,) = _run(engine, [[5, 6, 7]])
    for one, expected in (
        ("Hello there", text),
        (Prompt("Hello there"), text),
        ([5, 6, 7], ids),
        ((5, 6, 7), ids),
        (Prompt([5, 6, 7]), ids),
    ):
        (out,) = _run(engine, one)
        assert out.finish_reason != "error", one
        assert out.request_id == "0"
        assert out.prompt_token_ids == expected.prompt_token_ids
        assert out.output_token_ids == expected.output_token_ids
    (named,) = _run(engine, Prompt("Hello there", request_id="mine"))
    assert named.request_id == "mine" and named.output_token_ids == text.output_token_ids
    (wrong,) = _run(engine, {"prompt": "Hello there"})  # not a prompt batchgen reads: one error
    assert wrong.finish_reason == "error" and "not dict" in wrong.error
    assert len(_run(engine, [[5, 6, 7], [8, 9]])) == 2  # a list of id lists: one per list
    assert _run(engine, []) == []
