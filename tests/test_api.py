"""The datasets pipeline API: Dataset / IterableDataset / DatasetDict in and out, composition
with map and filter, one engine across calls, checkpoint resume."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import batchgen
from batchgen import BatchgenError, EngineConfig, Generator, SamplingParams
from tests.helpers import stop_after

datasets = pytest.importorskip("datasets")

PROMPTS = [f"Tell me about item {i} and the weather." for i in range(10)]
OUTPUTS = ["sample_index", "text", "finish_reason", "num_prompt_tokens", "num_generated_tokens"]
OUTPUTS += ["error"]


@pytest.fixture(scope="module")
def gen(model_dir) -> Iterator[Generator]:
    with Generator(model_dir("llama"), EngineConfig(device="cpu", max_num_seqs=4)) as g:
        yield g


@pytest.fixture(scope="module")
def expected(gen: Generator) -> dict[str, str]:
    """Engine texts for PROMPTS, greedy, 6 tokens (the oracle for every call below)."""
    outs = gen.engine.generate(PROMPTS, SamplingParams(max_new_tokens=6))
    return {PROMPTS[int(o.request_id)]: o.text for o in outs}


def table() -> Any:
    return datasets.Dataset.from_dict({"prompt": PROMPTS, "k": list(range(len(PROMPTS)))})


def test_dataset_gets_output_columns_in_input_order(gen: Generator, expected) -> None:
    out = gen(table(), sampling={"max_new_tokens": 6}, progress=False)
    assert isinstance(out, datasets.Dataset)
    assert out.column_names == ["prompt", "k", *OUTPUTS]
    assert out["k"] == list(range(10)) and out["sample_index"] == [0] * 10
    assert out["text"] == [expected[p] for p in PROMPTS]
    assert set(out["finish_reason"]) <= {"stop", "length"} and out["error"] == [None] * 10
    assert out.features["error"] == datasets.Value("string")


def test_an_empty_dataset_gets_the_output_columns(gen: Generator) -> None:
    nonempty = gen(table().select([0]), sampling={"max_new_tokens": 2}, progress=False)
    empty = table().select([])
    out = gen(empty, sampling={"max_new_tokens": 2}, progress=False, include_token_ids=True)
    assert len(out) == 0 and out.column_names == [
        "prompt",
        "k",
        *OUTPUTS,
        "prompt_token_ids",
        "token_ids",
    ]
    assert out.features["text"] == nonempty.features["text"] == datasets.Value("string")
    assert out.features["k"] == empty.features["k"]


def test_map_filter_compose_on_one_engine(gen: Generator, expected, monkeypatch) -> None:
    def no_new_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a call loaded a second engine")

    monkeypatch.setattr("batchgen.engine.engine.Engine", no_new_engine)
    ds = table().filter(lambda r: r["k"] % 2 == 0).map(lambda r: {"q": r["prompt"]})
    first = gen(ds, prompt_column="q", sampling={"max_new_tokens": 6}, progress=False)
    second = gen(ds, template="{q}", sampling={"max_new_tokens": 6}, progress=False)
    assert first["text"] == [expected[p] for p in PROMPTS[::2]]
    assert second["num_prompt_tokens"] == first["num_prompt_tokens"]
    after = first.map(lambda r: {"chars": len(r["text"])}).filter(lambda r: r["k"] < 5)
    assert after["k"] == [0, 2, 4] and after["chars"] == [len(t) for t in first["text"][:3]]


def test_iterable_dataset_is_streamed_lazily(gen: Generator, expected, tmp_path: Path) -> None:
    ds = table().to_iterable_dataset(num_shards=2).filter(lambda r: r["k"] != 3)
    out = gen(ds, sampling={"max_new_tokens": 6}, checkpoint_dir=tmp_path / "cp", progress=False)
    assert isinstance(out, datasets.IterableDataset)
    assert out.column_names == ["prompt", "k", *OUTPUTS]
    assert not (tmp_path / "cp").exists(), "nothing runs before the dataset is iterated"
    rows = list(out.map(lambda r: {"chars": len(r["text"])}))
    assert [r["k"] for r in rows] == [k for k in range(10) if k != 3]
    assert [r["text"] for r in rows] == [expected[r["prompt"]] for r in rows]
    assert all(r["chars"] == len(r["text"]) for r in rows)
    again = list(out.take(2))  # a second pass reads the finished checkpoint
    assert [r["text"] for r in again] == [r["text"] for r in rows[:2]]
    summary = json.loads((tmp_path / "cp" / "summary.json").read_text())
    assert summary["resumed"] and summary["run_rows_ok"] == 0


def test_dataset_dicts_run_each_split(gen: Generator, expected, tmp_path: Path) -> None:
    dd = datasets.DatasetDict({"train": table().select(range(3)), "test": table().select([7])})
    out = gen(dd, sampling={"max_new_tokens": 6}, checkpoint_dir=tmp_path, progress=False)
    assert isinstance(out, datasets.DatasetDict) and set(out) == {"train", "test"}
    assert out["test"]["text"] == [expected[PROMPTS[7]]]
    assert (tmp_path / "train" / "results.parquet").is_file()
    streamed = gen(
        datasets.IterableDatasetDict({"s": dd["train"].to_iterable_dataset()}),
        sampling={"max_new_tokens": 6},
        progress=False,
    )
    assert [r["text"] for r in streamed["s"]] == out["train"]["text"]


def test_the_splits_of_a_dataset_dict_draw_their_own_samples(gen: Generator) -> None:
    """An unseeded sampled row's seed follows its split and its position: the same prompts
    at the same positions of two splits draw apart (the splits are not copies of each
    other), and each split draws the same again when called again."""
    same = table().select(range(4))
    dd = datasets.DatasetDict({"a": same, "b": same})
    sampling = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    out = gen(dd, sampling=sampling, progress=False, include_token_ids=True)
    assert out["a"]["token_ids"] != out["b"]["token_ids"]
    assert all(x != y for x, y in zip(out["a"]["token_ids"], out["b"]["token_ids"], strict=True))
    again = gen(dd, sampling=sampling, progress=False, include_token_ids=True)
    assert again["a"]["token_ids"] == out["a"]["token_ids"]
    assert again["b"]["token_ids"] == out["b"]["token_ids"]
    alone = gen(same, sampling=sampling, progress=False, include_token_ids=True)
    assert alone["token_ids"] not in (out["a"]["token_ids"], out["b"]["token_ids"])


def test_n_samples_are_consecutive_rows(gen: Generator) -> None:
    ds = table().select(range(3))
    sampling = SamplingParams(max_new_tokens=5, n=3, temperature=1.0, seed=7, logprobs=2)
    out = gen(ds, sampling=sampling, progress=False, include_token_ids=True)
    assert out["k"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert out["sample_index"] == [0, 1, 2] * 3
    for row in out:
        assert len(row["logprobs"]) == len(row["token_ids"]) == row["num_generated_tokens"]
        assert [lp["token_id"] for lp in row["logprobs"]] == row["token_ids"]
        assert all(len(lp["top_logprobs"]) == 2 for lp in row["logprobs"])
    streamed = list(gen(ds.to_iterable_dataset(), sampling=sampling, include_token_ids=True))
    assert [r["token_ids"] for r in streamed] == out["token_ids"]


def test_a_bad_row_is_one_error_row_with_n_samples(gen: Generator) -> None:
    """As in a job's output: a row refused before generation is one row, sample_index 0."""
    ds = datasets.Dataset.from_dict({"prompt": ["a b", "", "c d"]})
    sampling = {"max_new_tokens": 2, "n": 3, "temperature": 1.0}
    out = gen(ds, sampling=sampling, progress=False)
    assert out["prompt"] == ["a b"] * 3 + [""] + ["c d"] * 3
    assert out["sample_index"] == [0, 1, 2, 0, 0, 1, 2]
    assert out["finish_reason"][3] == "error" and out["text"][3] is None
    streamed = list(gen(ds.to_iterable_dataset(), sampling=sampling, progress=False))
    assert [r["sample_index"] for r in streamed] == out["sample_index"]


def test_chat_messages_and_bad_rows(gen: Generator) -> None:
    ds = datasets.Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": "Hi!"}], "s": None},
            {"messages": [], "s": None},
            {"messages": [{"role": "user", "content": "Yo"}], "s": '{"temperature": -1}'},
        ]
    )
    out = gen(ds, messages_column="messages", sampling_column="s", progress=False)
    assert out["finish_reason"][0] in ("stop", "length") and out["error"][0] is None
    assert out["finish_reason"][1:] == ["error", "error"] and out["text"][1:] == [None, None]
    assert "non-empty list" in out["error"][1] and "temperature" in out["error"][2]
    assert "logprobs" in out.column_names  # a sampling column may ask for them


def test_chat_rendering_options_as_in_vllms_chat(gen: Generator) -> None:
    """continue_final_message (with add_generation_prompt=False) and chat_template_kwargs
    render as Hugging Face renders them; with a prompt column they are refused."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, it"}]
    ds = datasets.Dataset.from_list([{"messages": turns}])
    options = {"add_generation_prompt": False, "continue_final_message": True}
    out = gen(
        ds, messages_column="messages", include_token_ids=True, progress=False,
        sampling={"max_new_tokens": 2}, chat_template_kwargs={"style": "terse"}, **options,
    )  # fmt: skip
    tok = gen.engine.tokenizer
    text = tok.apply_chat_template(turns, tokenize=False, **options)
    assert out[0]["prompt_token_ids"] == tok(text, add_special_tokens=False).input_ids
    with pytest.raises(BatchgenError, match="continue_final_message apply to chat messages"):
        gen(table(), **options)


def test_a_chat_template_changed_between_calls_is_not_resumed(model_dir, tmp_path: Path) -> None:
    """A caller's tokenizer whose chat template is set between two calls on one checkpoint_dir:
    the second call refuses the rows rendered with the old template (no mixed results); without
    a checkpoint it renders with the new one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir("llama"))
    ds = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "Hello there"}]}])
    call = {"messages_column": "messages", "include_token_ids": True, "progress": False}
    call["sampling"] = {"max_new_tokens": 2}
    config = EngineConfig(device="cpu", max_num_seqs=4)
    with Generator(model_dir("llama"), config, tokenizer=tok) as g:
        g(ds, checkpoint_dir=tmp_path, **call)
        tok.chat_template = "{% for m in messages %}NEW {{ m['content'] }}\n{% endfor %}NEW:"
        with pytest.raises(BatchgenError, match=r"the model changed \(tokenizer differ\)"):
            g(ds, checkpoint_dir=tmp_path, **call)
        out = g(ds, **call)
    assert (
        tok.decode(out[0]["prompt_token_ids"], skip_special_tokens=True) == "NEW Hello there\nNEW:"
    )


def test_progress_false_prints_no_bar(model_dir, capfd) -> None:
    """progress=False: no bar of batchgen's, of transformers' weight loading or of datasets'
    flattening a shuffled dataset's indices; those libraries' own settings are kept."""
    ds = table().shuffle(seed=0)
    config, model = EngineConfig(device="cpu", max_num_seqs=4), model_dir("llama")
    capfd.readouterr()
    out = batchgen.generate(
        ds, model=model, engine_config=config, sampling={"max_new_tokens": 2},
        progress=False,
    )  # fmt: skip
    assert out["prompt"] == ds["prompt"]
    assert "%|" not in capfd.readouterr().err
    assert not datasets.are_progress_bars_disabled()


def test_checkpoint_resumes_after_an_interruption(
    gen: Generator, expected, tmp_path: Path, monkeypatch
) -> None:
    stop_after(gen.engine, 3)
    with pytest.raises(BatchgenError, match="call again to resume"):
        gen(table(), sampling={"max_new_tokens": 6}, checkpoint_dir=tmp_path, progress=False)
    first = json.loads((tmp_path / "summary.json").read_text())
    assert not first["complete"] and 0 < first["rows_committed_total"] < 10
    out = gen(table(), sampling={"max_new_tokens": 6}, checkpoint_dir=tmp_path, progress=False)
    assert out["text"] == [expected[p] for p in PROMPTS]
    second = json.loads((tmp_path / "summary.json").read_text())
    assert second["resumed"] and second["run_rows_ok"] == 10 - first["rows_committed_total"]
    with pytest.raises(BatchgenError, match="max_new_tokens changed"):
        gen(table(), sampling={"max_new_tokens": 7}, checkpoint_dir=tmp_path, progress=False)


def test_user_errors_are_one_line(gen: Generator) -> None:
    with pytest.raises(BatchgenError, match="already has a column 'text': pass output_prefix"):
        gen(datasets.Dataset.from_dict({"text": ["a"]}), prompt_column="text")
    out = gen(
        datasets.Dataset.from_dict({"text": ["a b"]}),
        prompt_column="text",
        output_prefix="gen_",
        sampling={"max_new_tokens": 2},
        progress=False,
    )
    assert out.column_names == ["text", *(f"gen_{c}" for c in OUTPUTS)]
    clash = r"a column 'gen_sample_index' \(output_prefix='gen_'\): pass output_prefix='gen1_'"
    with pytest.raises(BatchgenError, match=clash):  # a prefix that is free
        gen(out, prompt_column="text", output_prefix="gen_")
    with pytest.raises(BatchgenError, match=r"unknown sampling field\(s\) \['temprature'\]"):
        gen(table(), sampling={"temprature": 1.0})
    with pytest.raises(BatchgenError, match="exactly one of"):
        gen(table(), prompt_column="prompt", template="{prompt}")
    with pytest.raises(BatchgenError, match="not list: wrap the data"):
        gen([{"prompt": "hi"}])
    with pytest.raises(BatchgenError, match="no column 'question'"):
        gen(table(), template="Q: {question}")
    with pytest.raises(BatchgenError, match="system_prompt applies to chat messages"):
        gen(table().to_iterable_dataset(), system_prompt="Be brief.")  # at the call, not later
    for sampling in ([SamplingParams()] * 2, "greedy"):  # one per row is sampling_column's job
        kind = type(sampling).__name__
        with pytest.raises(BatchgenError, match=rf"sampling must be a SamplingParams or a dict "
                           rf"of its fields, not {kind}: it applies to every row"):  # fmt: skip
            gen(table(), sampling=sampling)


def test_module_level_generate(model_dir) -> None:
    ds = datasets.Dataset.from_dict({"prompt": ["Hello there"]})
    out = batchgen.generate(
        ds,
        model=model_dir("llama"),
        engine_config=EngineConfig(device="cpu"),
        sampling={"max_new_tokens": 3, "ignore_eos": True},
        progress=False,
    )
    assert out["num_generated_tokens"] == [3] and out["prompt"] == ["Hello there"]


def test_module_level_generate_closes_its_engine(model_dir, monkeypatch) -> None:
    """Closed before a Dataset is returned; a streamed result keeps it until it is dropped."""
    import gc

    from batchgen import Engine

    made: list[Engine] = []

    class Recorded(Engine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("batchgen.api.Engine", Recorded)
    ds = datasets.Dataset.from_dict({"prompt": ["Hello there"]})
    kw = {"engine_config": EngineConfig(device="cpu"), "sampling": {"max_new_tokens": 2}}
    out = batchgen.generate(ds, model=model_dir("llama"), progress=False, **kw)
    assert len(out) == 1 and made[0].runner is None
    streamed = batchgen.generate(ds.to_iterable_dataset(), model=model_dir("llama"), **kw)
    assert len(list(streamed)) == 1 and made[1].runner is not None
    del streamed
    gc.collect()
    assert made[1].runner is None


def test_iterable_dataset_is_read_once_and_joined_by_row(gen: Generator, expected) -> None:
    """A source whose order changes on every read: each output stays with its own row."""
    calls = [0]

    def rows() -> Iterator[dict[str, Any]]:
        calls[0] += 1
        order = list(range(10))
        random.Random(calls[0]).shuffle(order)
        for k in order:
            yield {"prompt": PROMPTS[k], "k": k}

    ds = datasets.IterableDataset.from_generator(rows)
    out = list(gen(ds, sampling={"max_new_tokens": 6}, progress=False))
    assert calls[0] == 1, "the input is read once"
    assert sorted(r["k"] for r in out) == list(range(10))
    assert all(r["text"] == expected[r["prompt"]] for r in out)


def test_taking_a_few_rows_generates_about_that_many(model_dir, tmp_path: Path) -> None:
    with Generator(model_dir("llama"), EngineConfig(device="cpu", max_num_seqs=64)) as g:
        prompts = [f"Row {i} of many." for i in range(60)]
        ds = datasets.Dataset.from_dict({"prompt": prompts}).to_iterable_dataset()
        out = g(ds, sampling={"max_new_tokens": 8}, checkpoint_dir=tmp_path, progress=False)
        taken = list(out.take(2))
        assert [r["prompt"] for r in taken] == prompts[:2]
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["rows_committed_total"] <= 8, summary
        assert not summary["complete"]
        rest = list(out)  # the next pass resumes from the checkpoint
        assert [r["prompt"] for r in rest] == prompts
        assert [r["text"] for r in rest[:2]] == [r["text"] for r in taken]


def test_a_changed_iterable_dataset_is_refused_on_resume(gen: Generator, tmp_path: Path) -> None:
    ds = table().to_iterable_dataset()
    list(gen(ds, sampling={"max_new_tokens": 4}, checkpoint_dir=tmp_path, progress=False))
    changed = datasets.Dataset.from_dict({"prompt": PROMPTS[::-1], "k": list(range(10))})
    again = gen(
        changed.to_iterable_dataset(),
        sampling={"max_new_tokens": 4},
        checkpoint_dir=tmp_path,
        progress=False,
    )
    with pytest.raises(BatchgenError, match="input row 0 is not the row the checkpoint holds"):
        list(again)


def test_a_callers_model_is_left_as_it_was(model_dir) -> None:
    """Generator(model) neither casts nor moves the model, and HF generate keeps working on it
    while the generator is open and after it is closed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tokenizer("Hello there").input_ids])

    def hf() -> list[int]:
        kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
        return model.generate(ids, **kwargs)[0].tolist()

    before = hf()
    with Generator(model, EngineConfig(device="cpu"), tokenizer=tokenizer) as g:
        out = g(table().select(range(2)), sampling={"max_new_tokens": 3}, progress=False)
        assert out["num_generated_tokens"] == [3, 3] or set(out["finish_reason"]) <= {"stop"}
        assert hf() == before
    assert hf() == before
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "sdpa"
    with pytest.raises(BatchgenError, match=r"passed in is torch.bfloat16|passed in is bfloat16"):
        Generator(model, EngineConfig(device="cpu", dtype="float32"), tokenizer=tokenizer)


def test_a_closed_engine_releases_its_memory_at_once(model_dir) -> None:
    import gc
    import weakref

    from batchgen import Engine

    config = EngineConfig(device="cpu", cpu_kv_cache_gib=0.05)
    engine = Engine(model_dir("llama"), config)
    list(engine.generate(["Hello"], SamplingParams(max_new_tokens=2)))
    blocks = engine.num_blocks
    cache = weakref.ref(engine.runner.kv_cache.keys[0])
    model = weakref.ref(engine.model)
    gc.collect()
    gc.disable()  # no reference cycle may hold them: freed when close() returns
    try:
        engine.close()
        assert cache() is None and model() is None
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="closed"):
        list(engine.generate(["Hello"]))
    assert Engine(model_dir("llama"), config).num_blocks == blocks


def test_a_changed_dataset_is_refused_on_resume(gen: Generator, tmp_path: Path) -> None:
    """Same length and columns, other content: the checkpoint does not answer it."""
    gen(table(), sampling={"max_new_tokens": 4}, checkpoint_dir=tmp_path, progress=False)
    changed = datasets.Dataset.from_dict({"prompt": PROMPTS[::-1], "k": list(range(10))})
    with pytest.raises(BatchgenError, match="the input changed"):
        gen(changed, sampling={"max_new_tokens": 4}, checkpoint_dir=tmp_path, progress=False)
    again = gen(table(), sampling={"max_new_tokens": 4}, checkpoint_dir=tmp_path, progress=False)
    assert again["prompt"] == PROMPTS


def test_a_stream_without_features_keeps_its_columns(gen: Generator, tmp_path: Path) -> None:
    """Without a schema the rows are checked as they are read: an input column an output column
    would overwrite is refused (on the first example before any model work), as is a first
    example without the prompt column."""
    rows = [{"prompt": PROMPTS[0], "text": "mine"}]
    mapped = datasets.Dataset.from_list(rows).to_iterable_dataset().map(lambda r: r)
    assert mapped.column_names is None
    out = gen(mapped, sampling={"max_new_tokens": 2}, checkpoint_dir=tmp_path / "cp")
    with pytest.raises(BatchgenError, match="already has a column 'text': pass output_prefix"):
        list(out)
    assert not (tmp_path / "cp").exists()

    def later() -> Iterator[dict[str, Any]]:
        yield {"prompt": PROMPTS[1]}
        yield {"prompt": PROMPTS[2], "error": "mine"}

    taken = []
    with pytest.raises(BatchgenError, match="already has a column 'error'"):
        for row in gen(datasets.IterableDataset.from_generator(later), progress=False):
            taken.append(row)
    assert [r["prompt"] for r in taken] in ([], [PROMPTS[1]])

    def no_prompt() -> Iterator[dict[str, Any]]:
        yield {"question": PROMPTS[0]}

    with pytest.raises(BatchgenError, match="no column 'prompt' \\(keys of its first example"):
        list(gen(datasets.IterableDataset.from_generator(no_prompt), progress=False))
    renamed = gen(mapped, output_prefix="gen_", sampling={"max_new_tokens": 2}, progress=False)
    assert [r["text"] for r in renamed] == ["mine"]


def test_a_transform_is_refused_and_formats_read_the_rows(gen: Generator) -> None:
    """The job reads the stored rows: a transform the caller sees them through is refused;
    a format (torch, numpy, arrow, pandas) changes nothing in what is generated."""
    ds = table().select(range(2))
    question = ds.with_transform(lambda b: {"prompt": [f"Q: {p}" for p in b["prompt"]]})
    with pytest.raises(BatchgenError, match=r"has a transform .*ds\.map\(transform"):
        gen(question, sampling={"max_new_tokens": 2})
    ds.set_transform(lambda b: b)
    with pytest.raises(BatchgenError, match="has a transform"):
        gen(ds, sampling={"max_new_tokens": 2})
    ds.reset_format()
    kw = {"sampling": {"max_new_tokens": 2}, "progress": False}
    want = gen(ds, **kw).to_list()
    for kind in ("torch", "numpy", "arrow", "pandas"):
        assert gen(ds.with_format(kind), **kw).with_format(None).to_list() == want, kind
        streamed = gen(ds.to_iterable_dataset().with_format(kind), **kw)
        assert list(streamed.with_format(None)) == want, kind


def test_a_held_stream_refuses_another_call_of_its_thread(gen: Generator, expected) -> None:
    """A streamed result holds the engine until it is exhausted or closed: another call of the
    thread that holds it is refused (it would wait for itself); another thread waits its turn."""
    import threading

    kw = {"sampling": {"max_new_tokens": 6}, "progress": False}
    splits = {"a": table().to_iterable_dataset(), "b": table().to_iterable_dataset()}
    out = gen(datasets.IterableDatasetDict(splits), **kw)
    side_by_side = iter(out["a"]), iter(out["b"])
    next(side_by_side[0])
    with pytest.raises(BatchgenError, match="still being iterated"):
        next(side_by_side[1])  # as zip(out["a"], out["b"]) does
    side_by_side[0].close()
    held = iter(gen(table().to_iterable_dataset(), **kw))
    first = next(held)
    with pytest.raises(BatchgenError, match="still being iterated: exhaust or close it first"):
        gen(table().select([0]), **kw)
    other: list[Any] = []
    waiting = threading.Thread(target=lambda: other.append(gen(table().select([1]), **kw)))
    waiting.start()
    rest = [first, *held]
    waiting.join()
    assert [r["text"] for r in rest] == [expected[p] for p in PROMPTS]
    assert other[0]["text"] == [expected[PROMPTS[1]]]
    again = iter(gen(table().to_iterable_dataset(), **kw))
    next(again)
    again.close()
    assert gen(table().select([2]), **kw)["text"] == [expected[PROMPTS[2]]]


def test_every_split_is_checked_before_any_split_runs(gen: Generator, tmp_path: Path) -> None:
    kw = {"sampling": {"max_new_tokens": 2}, "progress": False}
    train = table().select(range(2))
    clash = datasets.DatasetDict({"train": train, "test": train.add_column("text", ["a", "b"])})
    with pytest.raises(BatchgenError, match="split 'test': the dataset already has a column"):
        gen(clash, checkpoint_dir=tmp_path, **kw)
    assert not any(tmp_path.iterdir()), "split 'train' ran"
    lacking = datasets.DatasetDict({"train": train, "test": train.rename_column("prompt", "q")})
    with pytest.raises(BatchgenError, match="split 'test': input has no column 'prompt'"):
        gen(lacking, checkpoint_dir=tmp_path, **kw)
    transformed = datasets.DatasetDict({"train": train, "test": train.with_transform(dict)})
    with pytest.raises(BatchgenError, match="split 'test': the dataset has a transform"):
        gen(transformed, checkpoint_dir=tmp_path, **kw)
    assert not any(tmp_path.iterdir()), "split 'train' ran"
    streams = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in lacking.items()})
    with pytest.raises(BatchgenError, match="split 'test': input has no column 'prompt'"):
        gen(streams, **kw)  # at the call, not when the split is iterated


def test_a_refused_checkpoint_names_what_the_api_offers(gen: Generator, tmp_path: Path) -> None:
    """The API has no --force-resume: a refused checkpoint_dir names another one instead."""
    gen(table(), sampling={"max_new_tokens": 2}, checkpoint_dir=tmp_path, progress=False)
    changed = {"sampling": {"max_new_tokens": 3}, "checkpoint_dir": tmp_path, "progress": False}
    calls = [
        lambda: gen(table(), **changed),
        lambda: list(gen(table().to_iterable_dataset(), **changed)),
    ]
    for call in calls:
        with pytest.raises(BatchgenError, match="use another checkpoint_dir, or delete") as info:
            call()
        assert "--force-resume" not in str(info.value)
    (tmp_path / "job.json").unlink()
    with pytest.raises(
        BatchgenError, match=r"holds shards but no job\.json: use another checkpoint_dir"
    ):
        gen(table(), **changed)


def test_a_stream_keeps_nanoseconds_of_its_columns(gen: Generator) -> None:
    """Timestamps and durations in nanoseconds come back from a stream as the input gives them
    (datasets would cut them to microseconds when it encodes a stream with features), as
    they do from a Dataset."""
    import pyarrow as pa

    data = pa.table({
        "prompt": PROMPTS[:2],
        "ts": pa.array([1704067200000000123, 5], type=pa.timestamp("ns", tz="UTC")),
        "dur": pa.array([1_000_000_001, 7], type=pa.duration("ns")),
        "nested": pa.array([[{"t": 3}], []], type=pa.list_(pa.struct([("t", pa.duration("ns"))]))),
        "k": [1, 2],
    })  # fmt: skip
    ds = datasets.Dataset(data)
    given = list(ds.to_iterable_dataset())
    sampling = {"max_new_tokens": 2}
    streamed = list(gen(ds.to_iterable_dataset(), sampling=sampling, progress=False))
    stored = list(gen(ds, sampling=sampling, progress=False))
    for rows in (streamed, stored):
        for row, want in zip(rows, given, strict=True):
            assert {c: row[c] for c in want} == want
            assert row["ts"].nanosecond == want["ts"].nanosecond
    assert streamed[0]["ts"].nanosecond == 123 and streamed[0]["dur"].nanoseconds == 1
    plain = datasets.Dataset.from_dict({"prompt": PROMPTS[:2], "k": [1, 2]})
    features = gen(plain.to_iterable_dataset(), sampling=sampling).features
    assert features is not None and features["k"] == plain.features["k"]
