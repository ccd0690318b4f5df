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


def _errors(outs: list) -> list[tuple[str, str]]:
    return [(o.request_id, o.error) for o in outs if o.finish_reason == "error"]


def test_each_id_is_one_prompts_in_a_call(engine: Engine) -> None:
    """An id given to an earlier prompt of the call, finished or not, is an error result for
    the later one; so is a position that an earlier prompt was given as its request_id."""
    one = SamplingParams(max_new_tokens=1)
    outs = _run(engine, [Prompt("first", request_id="2"), "second", "third"], one)
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [
        ("1", "length"),
        ("2", "error"),
        ("2", "length"),
    ]
    ((_, error),) = _errors(outs)
    assert error.startswith("request 2: without a request_id its id is its position, '2', ")
    assert [o.prompt_token_ids for o in outs if o.error is None and o.request_id == "2"] == [
        engine.tokenizer("first").input_ids
    ]
    outs = _run(engine, ["zero", "one", Prompt("again", request_id="1")], one)
    assert _errors(outs) == [("1", "request 1: id '1' was given to an earlier prompt of this "
                              "call (a prompt without a request_id has its position as id): "
                              "ids must be unique")]  # fmt: skip
    # a later prompt with the id of one that finished long before: still refused
    later = [Prompt("a", request_id="x"), *[Prompt("b", request_id=f"y{i}") for i in range(9)]]
    outs = _run(engine, [*later, Prompt("c", request_id="x")], one)
    assert [rid for rid, _ in _errors(outs)] == ["x"]
    # the same ids in another call are that call's
    assert not _errors(_run(engine, [Prompt("c", request_id="x"), "d", "e"], one))


def test_call_ids_keep_numbered_ids_as_runs() -> None:
    from batchgen.engine.call_inputs import CallIds

    ids = CallIds()
    order = [5, 3, 4, 0, 1, 9, 2, 8, 7, 6]
    assert all(ids.claim(str(n), given=True) is None for n in order)
    assert (ids._starts, ids._ends, ids._names) == ([0], [10], set())
    assert all(ids.claim(str(n), given=False) is not None for n in order)
    for name in ("07", "+7", "7.0", " 7", "x", "1" * 30):  # not the number 7: ids of their own
        assert ids.claim(name, given=True) is None, name
        assert ids.claim(name, given=True) is not None, name
    many = CallIds()
    assert all(many.claim(str(n), given=False) is None for n in range(100_000))
    assert len(many._starts) == 1
