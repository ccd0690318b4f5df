"""What Engine.generate is given: one prompt or many, params per prompt, ids, one call at a
time."""

from __future__ import annotations

import pytest

from batchgen import BatchgenError, Engine, EngineConfig, Prompt, SamplingParams

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


def test_a_list_of_params_pairs_one_with_each_prompt(engine: Engine) -> None:
    prompts = ["alpha beta", "gamma delta", "epsilon"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 4, 2)]
    outs = {o.request_id: o for o in _run(engine, prompts, params)}
    assert [len(outs[str(i)].output_token_ids) for i in range(3)] == [1, 4, 2]
    (alone,) = _run(engine, [prompts[1]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert outs["1"].output_token_ids == alone.output_token_ids
    (out,) = _run(engine, "epsilon", [params[2]])  # one prompt, one params in a list
    assert out.output_token_ids == outs["2"].output_token_ids
    overridden = [Prompt("epsilon", sampling={"max_new_tokens": 3}), "alpha beta"]
    outs = {o.request_id: o for o in _run(engine, overridden, params[:2])}
    assert [len(outs[k].output_token_ids) for k in "01"] == [3, 4]  # the dict overrides its own


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        (["a", "b"], [PARAMS], r"^2 prompts but 1 SamplingParams: give one per prompt"),
        ((p for p in ["a"]), [PARAMS], r"pairs with a list of prompts, not generator"),
        (["a"], [{"max_new_tokens": 3}], r"list of them \(one per prompt\), not a list holding"),
        (["a"], {"max_new_tokens": 3}, r"list of them \(one per prompt\), not dict$"),
    ],
)
def test_params_that_cannot_pair_are_refused(
    engine: Engine, prompts: object, params: object, message: str
) -> None:
    with pytest.raises(BatchgenError, match=message):
        _run(engine, prompts, params)
    assert not engine.has_unfinished()


def test_a_second_call_while_one_is_open_is_refused(engine: Engine) -> None:
    first = [
        Prompt("alpha one", request_id="a0", sampling={"max_new_tokens": 1}),
        Prompt("alpha two", request_id="a1", sampling={"max_new_tokens": 12}),
        Prompt("alpha three", request_id="a2", sampling={"max_new_tokens": 12}),
    ]
    alone = {o.request_id: o.output_token_ids for o in _run(engine, first)}
    calls = engine.generate(first, PARAMS)
    taken = [next(calls)]
    with pytest.raises(BatchgenError, match="previous generate call is still open"):
        _run(engine, ["beta one", "beta two"])
    taken += list(calls)  # the first call goes on, its results its own
    assert {o.request_id: o.output_token_ids for o in taken} == alone
    assert len(_run(engine, ["beta one", "beta two"])) == 2  # once it ended
    calls = engine.generate(first, PARAMS)
    next(calls)
    calls.close()  # ... or was closed
    assert len(_run(engine, ["beta one", "beta two"])) == 2
