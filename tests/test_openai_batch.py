"""OpenAI Batch files: request lines in, output and error files out, every line parsed with the
`openai` package's own types; bad lines are error lines; an interrupted job resumes."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from batchgen import BatchgenError, Engine, EngineConfig, SamplingParams
from batchgen.cli import main
from batchgen.formats.openai_batch.builder import RequestBuilder
from batchgen.formats.openai_batch.requests import parse_request
from batchgen.formats.openai_batch.results import _chat_choice, _text_choice
from batchgen.job import run_job
from batchgen.prompts import PromptConfig
from batchgen.token_bytes import TokenBytes
from tests.helpers import stop_after
from tests.test_job import PARTS_STYLE, TOOL_TEMPLATE, spec_for, tool_turns, write_jsonl
from tests.test_token_bytes import sentencepiece_style

openai_types = pytest.importorskip("openai.types")
pydantic = pytest.importorskip("pydantic")
from openai.types import Completion, ErrorObject  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class Response(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    status_code: int
    request_id: str
    body: dict[str, Any]


class OutputLine(pydantic.BaseModel):
    """One line of an OpenAI Batch output or error file (the openai package has no type):
    a request's failure is its response, with a status code and an error body."""

    model_config = pydantic.ConfigDict(extra="forbid")
    id: str
    custom_id: str | None
    response: Response
    error: None


def request(custom_id: Any, url: str = CHAT, **body: Any) -> dict[str, Any]:
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"Hello {custom_id}"}])
    else:
        body.setdefault("prompt", f"Once upon a time {custom_id}")
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def read_lines(path: Path) -> list[OutputLine]:
    lines = [OutputLine.model_validate_json(x) for x in path.read_text().splitlines()]
    for line in lines:
        body = line.response.body
        if line.response.status_code != 200:
            assert set(body) == {"error"}
            line.response.body = ErrorObject.model_validate(body["error"])
            continue
        kind = ChatCompletion if body["object"] == "chat.completion" else Completion
        line.response.body = kind.model_validate(body)
    return lines


def err(line: OutputLine) -> ErrorObject:
    assert line.response.status_code in (400, 404)
    return line.response.body


def run(model: Path, inp: Path, out: Path, *sets: str, engine: Engine | None = None) -> Any:
    spec = spec_for(model, inp, out, "input.format='openai-batch'", *sets)
    return run_job(spec, engine=engine)


@pytest.fixture(scope="module")
def model(model_dir) -> Path:
    return model_dir("llama")


def test_chat_and_completion_lines(model: Path, tmp_path: Path) -> None:
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [
            request("c1", model="m-1", max_tokens=5, n=2, temperature=0.8, seed=3),
            request("c2", max_completion_tokens=4, logprobs=True, top_logprobs=20, stop=["\n"]),
            request("c3", messages=[{"role": "user", "content": parts}], seed=None),
            request("t1", COMPLETIONS, max_tokens=6, logprobs=1, stop="zzz", temperature=0),
        ],
    )
    sets = ("sampling.ignore_eos=true", "output.format='jsonl'")
    names = "model.served_model_name=['served', 'm-1']"
    result = run(model, inp, tmp_path / "out", *sets, names)
    assert result.complete and result.summary.error_file.endswith("errors.jsonl")
    lines = read_lines(tmp_path / "out" / "results.jsonl")
    assert (tmp_path / "out" / "errors.jsonl").read_text() == ""
    assert [x.custom_id for x in lines] == ["c1", "c2", "c3", "t1"]
    assert all(x.response.status_code == 200 for x in lines)
    c1, c2, c3, t1 = (x.response.body for x in lines)
    assert isinstance(c1, ChatCompletion) and c1.model == "m-1" and c3.model == "served"
    assert [c.index for c in c1.choices] == [0, 1] and c1.usage.completion_tokens == 10
    assert c1.usage.total_tokens == c1.usage.prompt_tokens + 10
    assert c2.usage.completion_tokens == 4 and c3.usage.completion_tokens == 256
    tokens = c2.choices[0].logprobs.content
    assert len(tokens) == 4 and all(len(t.top_logprobs) == 20 for t in tokens)
    assert all(t.token == bytes(t.bytes).decode("utf-8", "backslashreplace") for t in tokens)
    every = [*tokens, *(top for t in tokens for top in t.top_logprobs)]
    partial = [t for t in every if not _is_utf8(bytes(t.bytes))]
    assert partial and all("\\x" in t.token and "\ufffd" not in t.token for t in partial)
    joined = b"".join(bytes(t.bytes) for t in tokens).decode("utf-8", "replace")
    assert joined.startswith(c2.choices[0].message.content)  # cut before its stop string
    assert isinstance(t1, Completion) and t1.object == "text_completion"
    assert len(t1.choices[0].logprobs.tokens) == 6
    engine = Engine(model, EngineConfig(device="cpu"))
    (ref,) = engine.generate(["Once upon a time t1"], SamplingParams(max_new_tokens=6))
    assert t1.choices[0].text == ref.text  # prompt as text, max_tokens -> max_new_tokens
    # each token as its own bytes show it (part of a character as \xNN escapes)
    token_bytes = TokenBytes(engine.tokenizer)
    assert t1.choices[0].logprobs.tokens == [token_bytes.text(i) for i in ref.output_token_ids]
    chat = [{"role": "user", "content": "Hi \nthere"}]  # text parts joined as vLLM joins them
    text = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert c3.usage.prompt_tokens == len(engine.tokenizer(text, add_special_tokens=False).input_ids)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_line_for_another_model_is_an_error_line(model: Path, tmp_path: Path) -> None:
    """Like vLLM's 404: a body.model that is neither the loaded model nor a declared name is
    not answered by the loaded model under that name."""
    rows = [
        request("mine", model=str(model), max_tokens=2),
        request("other", model="gpt-4o-mini", max_tokens=2),
        request("none", max_tokens=2),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(model, inp, tmp_path / "out").complete
    ok = read_lines(tmp_path / "out" / "results.jsonl")
    errors = read_lines(tmp_path / "out" / "errors.jsonl")
    assert [x.custom_id for x in ok] == ["mine", "none"]
    assert [x.response.body.model for x in ok] == [str(model), str(model)]
    assert [(x.custom_id, err(x).code, err(x).param) for x in errors] == [
        ("other", "model_not_found", "model")
    ]
    assert errors[0].response.status_code == 404 and "gpt-4o-mini" in err(errors[0]).message
    aliased = run(model, inp, tmp_path / "aliased", "model.served_model_name='gpt-4o-mini'")
    assert aliased.complete
    ok = read_lines(tmp_path / "aliased" / "results.jsonl")
    assert [x.custom_id for x in ok] == ["other", "none"]  # only declared names are served
    assert [x.response.body.model for x in ok] == ["gpt-4o-mini", "gpt-4o-mini"]


def test_bad_lines_become_error_lines(model: Path, tmp_path: Path) -> None:
    long = " ".join(["word"] * 300)
    rows = [
        request("ok-1", max_tokens=3),
        request("ok-1", max_tokens=3),
        request("emb", "/v1/embeddings"),
        request("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
        '{"custom_id": "broken", ',
        {**request("x"), "custom_id": None},
        {**request("get"), "method": "GET"},
        request("temp", temperature=-1),
        request("top", top_logprobs=3),
        request("both", max_tokens=2, max_completion_tokens=2),
        request("long", COMPLETIONS, prompt=long),
        request("big", max_tokens=60),  # fits not beside its prompt in 64 tokens: as vLLM, a 400
        request("mins", max_completion_tokens=2, min_tokens=5),  # a rule between two fields
        request("mins-job", min_tokens=300),  # and with the job's max_new_tokens (256)
        request(
            "image",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    ],
                }
            ],
        ),
        '{"custom_id": "cut", "method": "POST"',
        request("ok-2", COMPLETIONS, max_tokens=3),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    result = run(model, inp, tmp_path / "out", "runtime.max_model_len=64")
    assert result.complete
    ok = read_lines(tmp_path / "out" / "results.jsonl")
    errors = read_lines(tmp_path / "out" / "errors.jsonl")
    assert [x.custom_id for x in ok] == ["ok-1", "ok-2"]
    got = [(x.custom_id, err(x).code, err(x).param, err(x).line) for x in errors]
    assert got == [
        ("ok-1", "duplicate_custom_id", "custom_id", 2),
        ("emb", "invalid_url", "url", 3),
        ("tools", "unsupported_value", "tools", 4),
        (None, "invalid_json_line", None, 5),
        (None, "missing_required_parameter", "custom_id", 6),
        ("get", "invalid_method", "method", 7),
        ("temp", "invalid_value", "temperature", 8),
        ("top", "invalid_value", "top_logprobs", 9),
        ("both", "invalid_value", "max_tokens", 10),
        ("long", "invalid_request", None, 11),
        ("big", "invalid_value", "max_tokens", 12),
        ("mins", "invalid_value", "min_tokens", 13),
        ("mins-job", "invalid_value", "min_tokens", 14),
        ("image", "invalid_value", "messages", 15),
        (None, "invalid_json_line", None, 16),
    ]
    messages = [err(x).message for x in errors]
    assert all(m and "\n" not in m for m in messages)
    assert "tools=" in messages[2] and "not supported" in messages[2]
    assert "max_model_len" in messages[9]
    assert messages[10].startswith("max_tokens=60 is too large: the model's context is 64")
    # each line's own fields by the names it gave them; the job's by the job's
    assert messages[11] == "min_tokens=5 must be <= max_completion_tokens=2"
    assert messages[12] == "min_tokens=300 must be <= max_new_tokens=256"
    assert messages[13].startswith("message 0: content part 1 is a 'image_url' part: batchgen")
    assert messages[14].endswith("malformed JSON: Expecting ',' delimiter at column 38")
    assert len({x.id for x in ok + errors}) == len(rows), "one line per request, none dropped"


def test_interrupted_job_resumes(model: Path, tmp_path: Path) -> None:
    rows = [request(f"r{i}", COMPLETIONS if i % 3 else CHAT, max_tokens=4) for i in range(16)]
    rows.insert(5, request("r1"))  # a duplicate before the interruption point
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    sets = ("runtime.max_num_seqs=2", "output.shard_rows=2")
    engine = stop_after(Engine(model, EngineConfig(device="cpu", max_num_seqs=2)), 4)
    first = run(model, inp, tmp_path / "out", *sets, engine=engine)
    assert first.interrupted and not first.complete
    assert not (tmp_path / "out" / "results.jsonl").exists()
    second = run(model, inp, tmp_path / "out", *sets, engine=engine)
    assert second.complete and second.summary.resumed
    assert 0 < first.summary.rows_committed_total < len(rows)
    ok = read_lines(tmp_path / "out" / "results.jsonl")
    (dup,) = read_lines(tmp_path / "out" / "errors.jsonl")
    assert [x.custom_id for x in ok] == [f"r{i}" for i in range(16)]
    assert dup.custom_id == "r1" and err(dup).code == "duplicate_custom_id"
    whole = run(model, inp, tmp_path / "whole", *sets)
    assert whole.complete
    expected = read_lines(tmp_path / "whole" / "results.jsonl")
    assert [x.response.body.choices for x in ok] == [x.response.body.choices for x in expected]


def test_a_system_prompt_applies_to_chat_lines_and_refuses_completion_lines(
    model: Path, tmp_path: Path
) -> None:
    user = [{"role": "user", "content": "Hi"}]
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [request("chat", max_tokens=3, messages=user), request("text", COMPLETIONS, max_tokens=3)],
    )
    sets = ("prompt.system_prompt='Be brief.'", "output.include_token_ids=true")
    assert run(model, inp, tmp_path / "out", *sets).complete
    (ok,) = read_lines(tmp_path / "out" / "results.jsonl")
    (bad,) = read_lines(tmp_path / "out" / "errors.jsonl")
    assert ok.custom_id == "chat" and bad.custom_id == "text"
    assert "system_prompt applies to /v1/chat/completions" in err(bad).message
    tokenizer = Engine(model, EngineConfig(device="cpu")).tokenizer
    chat = [{"role": "system", "content": "Be brief."}, *user]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    want = len(tokenizer(rendered, add_special_tokens=False).input_ids)
    assert ok.response.body.usage.prompt_tokens == want


def test_cli_format_flag_and_prompt_section(model: Path, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [request("a", max_tokens=2)])
    args = ["run", "--format", "openai-batch", "--input", str(inp), "--model", str(model)]
    args += ["--quiet", "--set", "runtime.device='cpu'"]
    done = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "out")])
    assert done.exit_code == 0, done.output
    assert [x.custom_id for x in read_lines(tmp_path / "out" / "results.jsonl")] == ["a"]
    bad = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "o2"), "--template", "{a}"])
    assert bad.exit_code == 2 and "[prompt] template does not apply" in bad.output
    with pytest.raises(BatchgenError, match="id_column does not apply"):
        run(model, inp, tmp_path / "o3", "prompt.id_column='custom_id'")
    plain = [a for a in args if a not in ("--format", "openai-batch")]
    missed = CliRunner().invoke(main, [*plain, "--output", str(tmp_path / "o4")])
    assert missed.exit_code == 2
    assert "OpenAI Batch requests: run it with --format openai-batch" in missed.output


def test_body_fields_map_onto_sampling() -> None:
    chat = parse_request(
        request("a", logprobs=True, top_logprobs=3, stop="x", max_completion_tokens=7, n=2), None, 1
    )
    assert chat["error_code"] is None and chat["messages"][0]["content"] == "Hello a"
    expected = {"logprobs": 3, "stop": ("x",), "max_new_tokens": 7, "n": 2}
    assert chat["sampling"] == expected
    plain = parse_request(request("b", logprobs=False, top_p=0.5, temperature=None), None, 2)
    assert plain["sampling"] == {"top_p": 0.5, "logprobs": None}  # off, whatever the job's
    text = parse_request(request("c", COMPLETIONS, logprobs=0, presence_penalty=0.5), None, 3)
    assert text["prompt"] == "Once upon a time c"
    assert text["sampling"] == {"logprobs": 0, "presence_penalty": 0.5}
    bad = parse_request(request("d", COMPLETIONS, logprobs=True), None, 4)
    assert (bad["error_code"], bad["error_param"]) == ("invalid_value", "logprobs")
    assert parse_request(request("e", COMPLETIONS, logprobs=21), None, 5)["error_code"]
    unknown = parse_request(request("f", COMPLETIONS, max_completion_tokens=3), None, 6)
    assert unknown["error_code"] == "unknown_parameter"
    assert parse_request(None, "x line 7: malformed JSON", 7)["error_message"].startswith(
        "x line 7"
    )
    long = parse_request(request("g", max_tokens=300, min_tokens=280, seed=-7), None, 8)
    assert long["error_code"] is None, long["error_message"]  # OpenAI's and vLLM's seeds: int64
    assert long["sampling"] == {"max_new_tokens": 300, "min_new_tokens": 280, "seed": -7}
    alone = parse_request(request("h", min_tokens=300), None, 9)  # the job's limit may be larger
    assert alone["error_code"] is None and alone["sampling"] == {"min_new_tokens": 300}
    assert parse_request(request("i", seed=2**63), None, 10)["error_param"] == "seed"


def test_harmless_fields_are_accepted_and_vllm_fields_honoured() -> None:
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    harmless |= {"stream": False, "stream_options": None, "parallel_tool_calls": True}
    harmless |= {"logit_bias": {}, "tools": [], "response_format": {"type": "text"}}
    line = parse_request(request("a", **harmless, seed=3), None, 1)
    assert line["error_code"] is None and line["sampling"]["seed"] == 3
    vllm = {"top_k": 5, "min_p": 0.1, "min_tokens": 2, "repetition_penalty": 1.2}
    vllm |= {"ignore_eos": True, "stop_token_ids": [7], "include_stop_str_in_output": True}
    line = parse_request(request("b", **vllm, skip_special_tokens=True), None, 2)
    assert line["error_code"] is None
    assert line["sampling"] == {
        "top_k": 5, "min_p": 0.1, "min_new_tokens": 2, "repetition_penalty": 1.2,
        "ignore_eos": True, "stop_token_ids": (7,), "include_stop_str_in_output": True,
    }  # fmt: skip
    for field, value in (
        ("stream", True),
        ("logit_bias", {"5": 10}),
        ("tool_choice", "auto"),
        ("skip_special_tokens", False),
    ):
        bad = parse_request(request("c", **{field: value}), None, 3)
        assert (bad["error_code"], bad["error_param"]) == ("unsupported_value", field), field
        assert "not supported by batchgen" in bad["error_message"]


def test_openai_defaults_apply_to_lines_without_values(model: Path, tmp_path: Path) -> None:
    """As OpenAI: no temperature means 1.0, so n=2 gives two different choices (seeded from
    runtime.seed and the custom_id, so the same on a rerun); the job's own defaults do not
    turn lines greedy."""
    inp = write_jsonl(
        tmp_path / "in.jsonl", [request(f"r{i}", n=2, max_tokens=8) for i in range(4)]
    )
    assert run(model, inp, tmp_path / "out", "sampling.ignore_eos=true").complete
    lines = read_lines(tmp_path / "out" / "results.jsonl")
    pairs = [[c.message.content for c in x.response.body.choices] for x in lines]
    assert all(len(p) == 2 for p in pairs) and any(a != b for a, b in pairs)
    assert run(model, inp, tmp_path / "again", "sampling.ignore_eos=true").complete
    again = read_lines(tmp_path / "again" / "results.jsonl")
    assert [[c.message.content for c in x.response.body.choices] for x in again] == pairs


def test_the_jobs_sampling_applies_to_lines_that_give_no_value(model: Path, tmp_path: Path) -> None:
    """A value the job gives (even one equal to batchgen's own default) is every line's
    default in place of OpenAI's; a line's body still has the last word."""
    rows = [
        request("plain", n=2, max_tokens=6),
        request("hot", n=2, max_tokens=6, temperature=1.0, seed=5),
        request("stop", max_tokens=6),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    sets = ("sampling.ignore_eos=true", "sampling.temperature=0")
    assert run(model, inp, tmp_path / "out", *sets).complete
    plain, hot, _ = (x.response.body for x in read_lines(tmp_path / "out" / "results.jsonl"))
    a, b = (c.message.content for c in plain.choices)
    assert a == b, "temperature=0 from the job makes a line without one greedy"
    assert len({c.message.content for c in hot.choices}) == 2
    engine = Engine(model, EngineConfig(device="cpu"))
    tokenizer = engine.tokenizer
    chat = [{"role": "user", "content": "Hello stop"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    (free,) = engine.generate([ids], SamplingParams(max_new_tokens=6, ignore_eos=True))
    cut = tokenizer.decode(free.output_token_ids[2:4]).strip()
    sets = (*sets, f"sampling.stop=['{cut}']")
    assert cut and "'" not in cut
    assert run(model, inp, tmp_path / "stop", *sets).complete
    *_, stopped = (x.response.body for x in read_lines(tmp_path / "stop" / "results.jsonl"))
    assert cut not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"


def test_a_lines_response_format_replaces_the_jobs_structured_setting(
    model: Path, tmp_path: Path
) -> None:
    """The job's regex is the default for lines without a format of their own; text, a JSON
    object or a vLLM guided_* field on a line is that line's own."""
    pytest.importorskip("llguidance")
    pytest.importorskip("jsonschema")
    rows = [
        request("none", max_tokens=12),
        request("text", max_tokens=12, response_format={"type": "text"}),
        request("object", max_tokens=40, response_format={"type": "json_object"}),
        request("choice", max_tokens=12, guided_choice=["alpha", "beta"]),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    regex = "sampling.regex='[0-9]{4}'"
    assert run(model, inp, tmp_path / "out", regex, "sampling.temperature=1.0").complete
    lines = {x.custom_id: x for x in read_lines(tmp_path / "out" / "results.jsonl")}
    assert set(lines) == {"none", "text", "object", "choice"}, "no line is an error line"
    content = {k: x.response.body.choices[0].message.content for k, x in lines.items()}
    assert re.fullmatch("[0-9]{4}", content["none"])
    assert not re.fullmatch("[0-9]{4}", content["text"])
    assert content["choice"] in ("alpha", "beta")
    if lines["object"].response.body.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content["object"]), dict)


OPENAI_DOCS_EXAMPLE = [  # the request file of OpenAI's Batch guide, unchanged
    {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-3.5-turbo-0125", "messages": [
         {"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}},
    {"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-3.5-turbo-0125", "messages": [
         {"role": "system", "content": "You are an unhelpful assistant."},
         {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}},
]  # fmt: skip
VLLM_TEST_INPUT = [  # the chat lines of vLLM's run-batch tests, unchanged
    *({**line, "body": {**line["body"], "model": "hmellor/tiny-random-LlamaForCausalLM"}}
      for line in OPENAI_DOCS_EXAMPLE),
    {"custom_id": "request-3", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "NonExistModel", "messages": [
         {"role": "system", "content": "You are an unhelpful assistant."},
         {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}},
    {"custom_id": "request-4", "method": "POST", "url": "/bad_url",
     "body": {"model": "hmellor/tiny-random-LlamaForCausalLM", "messages": [
         {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}},
    {"custom_id": "request-5", "method": "POST", "url": "/v1/chat/completions",
     "body": {"stream": "True", "model": "hmellor/tiny-random-LlamaForCausalLM", "messages": [
         {"role": "user", "content": "Hello world!"}], "max_tokens": 1000}},
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "lines", "served", "ok", "failed"),
    [
        ("openai", OPENAI_DOCS_EXAMPLE, "gpt-3.5-turbo-0125", ["request-1", "request-2"], {}),
        (
            "vllm",
            VLLM_TEST_INPUT,
            "hmellor/tiny-random-LlamaForCausalLM",
            ["request-1", "request-2"],
            {"request-3": "model_not_found", "request-4": "invalid_url",
             "request-5": "unsupported_value"},
        ),
    ],
)  # fmt: skip
def test_published_batch_files_run_unchanged(
    model_dir, tmp_path: Path, name: str, lines: list, served: str, ok: list, failed: dict
) -> None:
    """Their max_tokens of 1000 fit beside the prompts in a context of 2,048 (the tiny random
    Llama of vLLM's tests has that context); in 512 they are error lines, as vLLM's are."""
    model = model_dir("llama", max_position_embeddings=2048)
    inp = write_jsonl(tmp_path / f"{name}.jsonl", lines)
    sets = ("sampling.max_new_tokens=8", f"model.served_model_name=['{served}']")
    assert run(model, inp, tmp_path / "out", *sets).complete
    results = read_lines(tmp_path / "out" / "results.jsonl")
    errors = read_lines(tmp_path / "out" / "errors.jsonl")
    assert [x.custom_id for x in results] == ok
    assert all(x.response.body.model == served for x in results)
    assert {x.custom_id: err(x).code for x in errors} == failed


def test_validate_reports_lines_that_cannot_run(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama", max_position_embeddings=2048)  # max_tokens 1000 fit
    inp = write_jsonl(tmp_path / "vllm.jsonl", VLLM_TEST_INPUT)
    args = ["validate", "--format", "openai-batch", "--input", str(inp), "--output", "o"]
    served = "model.served_model_name=['hmellor/tiny-random-LlamaForCausalLM']"
    result = CliRunner().invoke(main, [*args, "--model", str(model), "--set", served])
    assert result.exit_code == 0
    report = result.output.strip().splitlines()[-1]
    assert "5 lines, 3 invalid" in report and "1 model_not_found" in report
    assert "1 invalid_url" in report and "1 unsupported_value" in report


def _completion_top_logprobs(tokenizer: Any, ids: list[int]) -> dict[str, float]:
    """The top_logprobs dict of a completion choice whose one token has `ids` as its top."""
    top = [{"token_id": i, "logprob": -1.0 - n} for n, i in enumerate(ids)]
    row = {"text": "", "finish_reason": "length", "sample_index": 0}
    row["logprobs"] = [{"token_id": ids[0], "logprob": -1.0, "top_logprobs": top}]
    choice = _text_choice(row, TokenBytes(tokenizer))
    return choice["logprobs"]["top_logprobs"][0]


def test_completion_top_logprobs_keep_every_entry(model: Path, tmp_path: Path) -> None:
    """Special tokens show as their own strings, and two tokens of the same text (a
    byte-fallback token and the piece for that character) do not share one key."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    special = tokenizer.all_special_ids
    top = _completion_top_logprobs(tokenizer, [*special, 10])
    assert len(top) == len(special) + 1
    assert set(tokenizer.convert_ids_to_tokens(special)) <= set(top)
    pieces = sentencepiece_style(tmp_path)
    same = [pieces.convert_tokens_to_ids("l"), pieces.convert_tokens_to_ids("<0x6C>")]
    assert TokenBytes(pieces).text(same[0]) == TokenBytes(pieces).text(same[1]) == "l"
    top = _completion_top_logprobs(pieces, same)
    assert top == {"l": -1.0, f"token_id:{same[1]}": -2.0}  # the likelier one keeps the text


def test_completion_top_logprobs_hold_the_sampled_token(model: Path, tmp_path: Path) -> None:
    """Each position's top_logprobs dict holds the sampled token first, then the top k without
    it (k + 1 entries at most, as OpenAI's API and vLLM give them; just the sampled token with
    logprobs 0); text_offset is where each token's text starts in the choice's text."""
    lines = [
        request(f"k{k}", COMPLETIONS, max_tokens=8, logprobs=k, temperature=1.5, seed=3)
        for k in (0, 2)
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    run(model, inp, tmp_path / "out", "sampling.ignore_eos=true")
    bodies = [x.response.body for x in read_lines(tmp_path / "out" / "results.jsonl")]
    absent = 0
    for k, body in zip((0, 2), bodies, strict=True):
        choice = body.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 8
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert next(iter(top.items())) == (token, value)  # the sampled token comes first
            assert k <= len(top) <= k + 1
            others = list(top.values())[1:]
            assert others == sorted(others, reverse=True)
            absent += len(top) == k + 1 and k > 0
        assert lp.text_offset[0] == 0
        for i, token in enumerate(lp.tokens[:-1]):
            if "\\x" not in token:
                assert choice.text[lp.text_offset[i] :].startswith(token)
                assert lp.text_offset[i + 1] - lp.text_offset[i] == len(token)
    assert absent  # some sampled token was not among the top 2


def test_completion_text_offsets_count_characters(model: Path) -> None:
    """A character split over two tokens: both start where it does; a special token adds
    nothing (the text leaves it out)."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [*tokenizer("héllo wörld", add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    ids += tokenizer("!", add_special_tokens=False).input_ids
    entries = [{"token_id": i, "logprob": -1.0, "top_logprobs": []} for i in ids]
    row = {"text": "héllo wörld!", "finish_reason": "length", "logprobs": entries}
    lp = _text_choice(row, TokenBytes(tokenizer))["logprobs"]
    pieces = [TokenBytes(tokenizer)(i) for i in ids]
    assert pieces[1:3] == [b"\xc3", b"\xa9"]  # the test's premise: é is two tokens
    text = row["text"]
    for i, offset in enumerate(lp["text_offset"]):
        piece = pieces[i].decode("utf-8", "ignore")
        if piece and ids[i] != tokenizer.eos_token_id:
            assert text[offset:].startswith(piece), (i, offset)
    assert lp["text_offset"][1:3] == [1, 1] and lp["text_offset"][3] == 2
    assert lp["text_offset"][-2] == lp["text_offset"][-1] == len("héllo wörld")


def test_text_offsets_after_bytes_that_never_finish_a_character(model: Path) -> None:
    """A token whose bytes begin a character the next token does not finish is a replacement
    character of its own in the text: the next token starts after it."""
    tokens = TokenBytes(AutoTokenizer.from_pretrained(model))
    by_bytes = {tokens(i): i for i in range(len(tokens.tokenizer))}
    pieces = [b"\xc3", b"\xde", b"\xc3", b"\xa9", b"a", b"\xe2\x82", b"b"]
    ids = [by_bytes.get(p) for p in pieces]
    if None in ids:  # \xe2\x82 as one token is not in every vocabulary: then \xe2, \x82
        pieces[5:6] = [b"\xe2", b"\x82"]
        ids = [by_bytes[p] for p in pieces]
    text = b"".join(pieces).decode("utf-8", "replace")
    assert text == "\ufffd\ufffd\u00e9a\ufffdb"
    entries = [{"token_id": i, "logprob": -1.0, "top_logprobs": []} for i in ids]
    row = {"text": text, "finish_reason": "length", "logprobs": entries}
    offsets = _text_choice(row, tokens)["logprobs"]["text_offset"]
    assert offsets[:5] == [0, 1, 2, 2, 3]  # \xc3 | \xde | é over two tokens | a
    assert offsets[5:] == [4] * (len(ids) - 6) + [5]  # the unfinished € begun at 4, then b


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("shards", ["jsonl", "parquet"])
def test_minus_infinite_logprobs_are_written_as_openai_writes_them(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: str
) -> None:
    """A model whose logits leave only three tokens finite, five alternatives asked for: the
    other two are -inf, written -9999.0 (as OpenAI's API and vLLM write them), never as
    -Infinity or null, from either shard format."""
    from batchgen.engine.sampler import Sampler

    engine = Engine(model, EngineConfig(device="cpu"))
    original, kept = Sampler.__call__, [10, 20, 30]

    def call(self: Any, logits: Any, *args: Any, **kwargs: Any) -> Any:
        masked = torch.full_like(logits, float("-inf"))
        masked[:, kept] = logits[:, kept]
        return original(self, masked, *args, **kwargs)

    monkeypatch.setattr(Sampler, "__call__", call)
    lines = [
        request("c", COMPLETIONS, max_tokens=2, logprobs=5),
        request("h", max_tokens=2, logprobs=True, top_logprobs=5),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    run(model, inp, tmp_path / "out", f"output.format='{shards}'", engine=engine)
    text = (tmp_path / "out" / "results.jsonl").read_text()
    completion, chat = (_strict_json(x)["response"]["body"] for x in text.splitlines())
    read_lines(tmp_path / "out" / "results.jsonl")  # the openai package's types
    for top in completion["choices"][0]["logprobs"]["top_logprobs"]:
        assert sorted(top.values())[:2] == [-9999.0, -9999.0] and len(top) == 5
    for position in chat["choices"][0]["logprobs"]["content"]:
        values = [t["logprob"] for t in position["top_logprobs"]]
        assert values[3:] == [-9999.0, -9999.0] and max(values) > -9999.0


def test_unreadable_logprobs_are_the_lowest_number(model: Path) -> None:
    """A logprob a shard holds as null (JSON Lines shards write -inf and NaN so) or NaN is
    written -9999.0 in both formats, and a result line can hold no non-standard number."""
    tokenizer = TokenBytes(AutoTokenizer.from_pretrained(model))
    top = [{"token_id": 5, "logprob": None}, {"token_id": 6, "logprob": float("nan")}]
    entry = {"token_id": 7, "logprob": float("-inf"), "top_logprobs": top}
    row = {"text": "x", "finish_reason": "length", "logprobs": [entry]}
    text = _text_choice(row, tokenizer)["logprobs"]
    assert text["token_logprobs"] == [-9999.0]
    assert list(text["top_logprobs"][0].values()) == [-9999.0] * 3
    chat = _chat_choice(row, tokenizer)["logprobs"]["content"][0]
    assert [chat["logprob"], *(t["logprob"] for t in chat["top_logprobs"])] == [-9999.0] * 3


def _validate_codes(model: Path, inp: Path, *sets: str) -> collections.Counter[str]:
    """The error codes `batchgen validate` counts, from its report line."""
    args = ["validate", "--format", "openai-batch", "--input", str(inp), "--output", "o"]
    args += ["--model", str(model), *(a for s in sets for a in ("--set", s))]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = result.output.strip().splitlines()[-1]
    return collections.Counter(
        {code: int(n) for n, code in re.findall(r"(\d+) ([a-z_]+) \(e\.g\. line", report)}
    )


def test_validate_finds_every_line_the_run_refuses(model: Path, tmp_path: Path) -> None:
    """validate builds each line as the run does: rules between fields and the job's values,
    the context, the system prompt, duplicated custom_ids."""
    rows = [
        request("a", max_tokens=3),
        request("a", max_tokens=3),
        request("both", guided_choice=["x"], guided_regex="y"),
        request("minmax", max_tokens=2, min_tokens=5),
        request("big", max_tokens=60),
        request("mct", max_completion_tokens=60),
        request("long", prompt=" ".join(["word"] * 300), url=COMPLETIONS),
        request("other", model="other-model"),
        request("emb", "/v1/embeddings"),
        '{"custom_id": "broken", ',
        request("comp", COMPLETIONS, max_tokens=3),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    for n, sets in enumerate([(), ("prompt.system_prompt='Be brief.'",)]):
        sets = ("runtime.max_model_len=64", "runtime.device='cpu'", *sets)
        assert run(model, inp, tmp_path / f"out{n}", *sets).complete
        errors = read_lines(tmp_path / f"out{n}" / "errors.jsonl")
        ran = collections.Counter(err(x).code for x in errors)
        assert ran["duplicate_custom_id"] == 1 and ran["invalid_request"] == 1 - n
        assert _validate_codes(model, inp, *sets) == ran


def test_a_lines_explicit_value_wins_over_the_jobs(model: Path) -> None:
    """A value a line gives, an "off" one included (chat `logprobs: false`, `ignore_eos:
    false`, `stop: []`), replaces the job's; a field it leaves out or gives as null takes the
    job's."""
    job = SamplingParams(
        logprobs=2, ignore_eos=True, include_stop_str_in_output=True, stop=("x",), seed=4,
        stop_token_ids=(5,), top_k=3, min_new_tokens=1, repetition_penalty=1.2,
    )  # fmt: skip
    builder = RequestBuilder(PromptConfig(), AutoTokenizer.from_pretrained(model), 511, job, ())

    def params(url: str = CHAT, **body: Any) -> SamplingParams:
        values = parse_request(request("a", url, max_tokens=4, **body), None, 1)
        built = builder.build(0, values)
        assert built.error is None, built.error
        return job.replace(**built.overrides)

    off = {"ignore_eos": False, "include_stop_str_in_output": False, "stop": []}
    off |= {"stop_token_ids": [], "top_k": -1, "min_tokens": 0, "repetition_penalty": 1}
    got = params(logprobs=False, **off)
    assert got.logprobs is None and not got.ignore_eos and not got.include_stop_str_in_output
    assert got.stop == () and got.stop_token_ids == () and got.top_k == 0
    assert got.min_new_tokens == 0 and got.repetition_penalty == 1
    assert params(logprobs=True).logprobs == 0
    assert params(logprobs=True, top_logprobs=0).logprobs == 0
    assert params(COMPLETIONS, logprobs=0).logprobs == 0
    kept = params(logprobs=None, seed=None, stop=None)  # null: as if left out
    assert (kept.logprobs, kept.seed, kept.stop) == (2, 4, ("x",))
    assert params(COMPLETIONS, logprobs=None).logprobs == 2


def test_a_line_takes_one_structured_constraint() -> None:
    """Two constraints on a line are refused naming both: neither silently wins."""
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string"}}}
    given = {
        "guided_json": {"type": "object"},
        "guided_regex": "[0-9]+",
        "guided_choice": ["a", "b"],
        "response_format": schema,
    }
    names = list(given)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            body = {first: given[first], second: given[second]}
            line = parse_request(request("a", **body), None, 1)
            assert (line["error_code"], line["error_param"]) == ("invalid_value", second), body
            assert f"{first} and {second} are both given" in line["error_message"]
        both = {first: given[first], "response_format": {"type": "json_object"}}
        if first != "response_format":
            assert parse_request(request("b", **both), None, 2)["error_param"] == "response_format"
            text = {first: given[first], "response_format": {"type": "text"}}
            assert parse_request(request("c", **text), None, 3)["error_code"] is None


def test_an_empty_structured_constraint_is_refused(model: Path, tmp_path: Path) -> None:
    """An empty choice would constrain nothing (and switch off the job's setting): refused;
    an empty regex too; an empty schema is any JSON, honoured."""
    empty = parse_request(request("d", guided_choice=[]), None, 4)
    assert (empty["error_code"], empty["error_param"]) == ("invalid_value", "guided_choice")
    assert parse_request(request("e", guided_regex=""), None, 5)["error_param"] == "guided_regex"
    assert parse_request(request("f", guided_json={}), None, 6)["sampling"] == {"json_schema": {}}
    rows = [request("empty", guided_choice=[], max_tokens=4), request("job", max_tokens=4)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(model, inp, tmp_path / "out", "sampling.regex='[0-9]{4}'").complete
    (bad,) = read_lines(tmp_path / "out" / "errors.jsonl")
    assert bad.custom_id == "empty" and err(bad).param == "guided_choice"
    (ok,) = read_lines(tmp_path / "out" / "results.jsonl")
    assert re.fullmatch("[0-9]{4}", ok.response.body.choices[0].message.content)


def test_token_ids_are_written_as_vllms_fields(model: Path, tmp_path: Path) -> None:
    """output.include_token_ids: a chat completion's prompt ids in its body, a completion's in
    each choice, and each choice's generated ids, as vLLM's return_token_ids writes them."""
    rows = [request("c", n=2, max_tokens=3), request("t", COMPLETIONS, max_tokens=4)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(model, inp, tmp_path / "out", "output.include_token_ids=true").complete
    chat, text = (json.loads(x) for x in (tmp_path / "out" / "results.jsonl").open())
    tokenizer = AutoTokenizer.from_pretrained(model)
    body = chat["response"]["body"]
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    messages = rows[0]["body"]["messages"]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert body["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert [len(c["token_ids"]) for c in body["choices"]] == [3, 3]
    assert all(tokenizer.decode(c["token_ids"]) for c in body["choices"])
    (choice,) = text["response"]["body"]["choices"]
    assert choice["prompt_token_ids"] == tokenizer("Once upon a time t").input_ids
    assert len(choice["token_ids"]) == 4
    assert "prompt_token_ids" not in text["response"]["body"]


def test_a_token_limit_over_the_context_names_the_field_the_line_used(
    model: Path, tmp_path: Path
) -> None:
    rows = [request("mt", max_tokens=60), request("mct", max_completion_tokens=60)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run(model, inp, tmp_path / "out", "runtime.max_model_len=64").complete
    errors = {x.custom_id: err(x) for x in read_lines(tmp_path / "out" / "errors.jsonl")}
    for custom_id, field in (("mt", "max_tokens"), ("mct", "max_completion_tokens")):
        error = errors[custom_id]
        assert (error.code, error.param) == ("invalid_value", field)
        assert error.message.startswith(f"{field}=60 is too large")
        assert error.message.endswith(f"lower {field}")


def test_tool_call_arguments_are_parsed_as_the_job_path_parses_them(model: Path) -> None:
    """One owner for chat messages: a chat line's tool call arguments reach the template as the
    job's rows' do; arguments that are not JSON make the line an invalid_value error line."""
    from batchgen.prompts import PromptBuilder

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TOOL_TEMPLATE
    builder = RequestBuilder(PromptConfig(), tokenizer, 500, SamplingParams(), ())
    line = parse_request(request("a", messages=tool_turns('{"city": "Paris"}'), tools=[]), None, 1)
    rows = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
    job = rows.build(0, {"m": tool_turns('{"city": "Paris"}')})
    assert builder.build(0, line).prompt_ids == job.prompt_ids
    assert '"arguments": {"city": "Paris"}}' in tokenizer.decode(job.prompt_ids)
    broken = parse_request(request("b", messages=tool_turns("{city")), None, 2)
    assert (broken["error_code"], broken["error_param"]) == ("invalid_value", "messages")
    assert broken["error_message"].startswith(
        "message 1: tool_calls[0].function.arguments is not valid JSON: "
    )


def test_text_parts_follow_the_templates_content_format_as_in_job_rows(model: Path) -> None:
    """A chat line's text parts reach a template that loops over content as a list, and one
    that renders content as text joined by newlines, as job rows' do."""
    from batchgen.prompts import PromptBuilder

    tokenizer = AutoTokenizer.from_pretrained(model)
    parts = [{"type": "text", "text": "Look:"}, {"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": parts}]
    for template in (None, PARTS_STYLE):  # the model's own template first
        if template is not None:
            tokenizer.chat_template = template
        builder = RequestBuilder(PromptConfig(), tokenizer, 500, SamplingParams(), ())
        line = builder.build(0, parse_request(request("a", messages=messages), None, 1))
        rows = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
        assert line.prompt_ids == rows.build(0, {"m": messages}).prompt_ids
        text = tokenizer.decode(line.prompt_ids)
        assert ("[Look:][What?]" if template else "Look:\nWhat?") in text


THINKING_STYLE = (  # reads a template variable, as Qwen3's enable_thinking
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


def test_a_chat_lines_rendering_fields_are_vllms(model: Path) -> None:
    """vLLM's chat fields: chat_template_kwargs (over the job's, key by key),
    add_generation_prompt and continue_final_message render as Hugging Face renders them;
    continue_final_message without add_generation_prompt: false is an invalid_value line, as
    vLLM answers it; a refusal part is text. None of them on a completion line."""
    from batchgen.prompts import PromptBuilder

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = THINKING_STYLE
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, it"}]
    job = PromptConfig(chat_template_kwargs={"enable_thinking": True, "style": "terse"})
    builder = RequestBuilder(job, tokenizer, 500, SamplingParams(), ())

    def ids(**kwargs: Any) -> list[int]:
        text = tokenizer.apply_chat_template(prefill, tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False).input_ids

    cases = [
        ({}, ids(add_generation_prompt=True, enable_thinking=True)),
        ({"chat_template_kwargs": {"enable_thinking": False}}, ids(add_generation_prompt=True,
                                                                    enable_thinking=False)),
        ({"add_generation_prompt": False}, ids(add_generation_prompt=False)),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            ids(add_generation_prompt=False, continue_final_message=True),
        ),
    ]  # fmt: skip
    for i, (fields, want) in enumerate(cases):
        line = parse_request(request(str(i), messages=prefill, **fields), None, i + 1)
        built = builder.build(i, line)
        assert built.error is None and built.prompt_ids == want, (fields, built.error)
    assert tokenizer.decode(cases[3][1]).endswith("assistant\nSure, it")
    failing = parse_request(request("f", messages=prefill, chat_template_kwargs={"n": 1}), None, 8)
    tokenizer.chat_template = "{{ 'x' + n }}"  # the template itself fails on the line
    failed = RequestBuilder(job, tokenizer, 500, SamplingParams(), ()).build(0, failing)
    assert failed.error.startswith("chat template failed on the request's messages: ")
    assert (failed.passthrough["error_code"], failed.passthrough["error_param"]) == (
        "invalid_value", "messages"
    )  # fmt: skip
    tokenizer.chat_template = THINKING_STYLE
    assert "<think></think>" in tokenizer.decode(cases[1][1])
    both = parse_request(request("x", messages=prefill, continue_final_message=True), None, 9)
    assert both["error_code"] == "invalid_value"
    assert "set add_generation_prompt = false with it" in both["error_message"]
    reserved = parse_request(
        request("y", chat_template_kwargs={"add_generation_prompt": False}), None, 10
    )
    assert reserved["error_code"] == "invalid_value"
    assert reserved["error_param"] == "chat_template_kwargs"
    text_line = parse_request(request("z", COMPLETIONS, add_generation_prompt=True), None, 11)
    assert text_line["error_code"] == "unknown_parameter"
    refusal = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
               {"role": "user", "content": "Please?"}]  # fmt: skip
    as_text = [*refusal[:1], {"role": "assistant", "content": "No."}, *refusal[2:]]
    line = builder.build(0, parse_request(request("r", messages=refusal), None, 12))
    rows = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
    assert line.error is None and line.prompt_ids == rows.build(0, {"m": as_text}).prompt_ids
    no_text = [refusal[0], {"role": "assistant", "content": [{"type": "refusal"}]}]
    bad = parse_request(request("s", messages=no_text), None, 13)
    assert (
        bad["error_message"]
        == "message 1: content part 0 is a 'refusal' part without a string 'refusal'"
    )
    assert "assistant\nNo.<|im_end|>" in tokenizer.decode(line.prompt_ids)


def test_a_bad_value_is_named_as_the_line_gave_it() -> None:
    """A value out of range names the body's field and its value as JSON writes it, not the
    engine's field or Python's repr."""
    for body, message in (
        ({"max_tokens": 0}, "max_tokens=0 must be an integer in [1, "),
        ({"max_completion_tokens": 0}, "max_completion_tokens=0 must be an integer in [1, "),
        ({"stop": [""]}, 'stop=[""] must be a string or a list of at most 64 non-empty'),
    ):
        line = parse_request(request("a", **body), None, 1)
        assert line["error_code"] == "invalid_value" and line["error_message"].startswith(message)
        assert (
            line["error_param"] == next(iter(body))
            and "max_new_tokens" not in line["error_message"]
        )
