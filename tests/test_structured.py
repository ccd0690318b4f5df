"""Structured outputs on the tiny random-weight model, whose free text is gibberish: every row
under a schema, regex or choice must still match it."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

import batchgen.engine.grammar as grammar_module
import batchgen.engine.output_check as output_check
from batchgen import BatchgenError, Engine, EngineConfig, SamplingParams
from batchgen.engine.grammar import (
    ALL_ALLOWED,
    EXAMPLE_SCHEMA,
    EXAMPLE_VALUE,
    Grammars,
    GrammarSpec,
    GrammarState,
    grammar_spec,
)
from batchgen.engine.output_check import OutputCheck, output_problem, spec_problem
from batchgen.engine.request import Prompt
from batchgen.formats.openai_batch.requests import parse_request
from batchgen.job import run_job
from batchgen.token_bytes import TokenBytes
from tests.helpers import apply_token_bitmask, hf_model
from tests.test_job import read_rows, spec_for, write_jsonl

jsonschema = pytest.importorskip("jsonschema")
Draft202012Validator = jsonschema.Draft202012Validator
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ("yes", "no", 'it "depends"')
BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
LIMIT = 160  # tokens: the example schema's longest document fits
NEVER = "'never' is a required property"


@pytest.fixture(scope="module")
def engines(model_dir) -> dict[bool, Engine]:
    """overlap -> engine (the synchronous loop is the oracle)."""
    path = model_dir("llama")
    made = {o: Engine(path, EngineConfig(device="cpu", overlap=o, max_num_seqs=6)) for o in (1, 0)}
    yield {bool(k): v for k, v in made.items()}
    for engine in made.values():
        engine.close()


def _mixed_prompts() -> list[Prompt]:
    """Schema rows (greedy, seeded, n=2), regex, choice, json_object, plain and bad ones."""
    schema = {"json_schema": EXAMPLE_SCHEMA}
    rows = [
        ("s-greedy", schema),
        ("s-seeded", {**schema, "temperature": 1.0, "seed": 3, "n": 2}),
        ("s-topk", {**schema, "temperature": 0.9, "top_k": 20, "seed": 4}),
        ("regex", {"regex": REGEX, "temperature": 1.0, "seed": 5}),
        ("choice", {"choice": CHOICES, "temperature": 1.0, "seed": 6}),
        # free JSON keys run long on this model: a draw that closes its object within LIMIT
        ("object", {"json_object": True, "temperature": 1.5, "seed": 4}),
        ("plain", {"temperature": 1.0, "seed": 8, "max_new_tokens": 20}),
        ("bad-schema", {"json_schema": BAD_SCHEMA}),
        ("bad-regex", {"regex": "(unclosed"}),
    ]
    return [Prompt(f"Row {name} says", name, sampling) for name, sampling in rows]


def _run(engine: Engine, prompts: list[Prompt]) -> dict[tuple[str, int], object]:
    params = SamplingParams(max_new_tokens=LIMIT)
    return {(o.request_id, o.sample_index): o for o in engine.generate(prompts, params)}


def _check_mixed(out: dict) -> None:
    for key in [("s-greedy", 0), ("s-seeded", 0), ("s-seeded", 1), ("s-topk", 0)]:
        assert out[key].finish_reason == "stop", (key, out[key].text)
        jsonschema.validate(json.loads(out[key].text), EXAMPLE_SCHEMA)
    assert out["s-seeded", 0].text != out["s-seeded", 1].text  # each sample its own draw
    assert re.fullmatch(REGEX, out["regex", 0].text), out["regex", 0].text
    assert out["choice", 0].text in CHOICES
    assert out["object", 0].finish_reason == "stop"
    assert isinstance(json.loads(out["object", 0].text), dict)
    for name, what in (("bad-schema", "json_schema"), ("bad-regex", "regex")):
        bad = out[name, 0]
        assert bad.finish_reason == "error" and f"{what} cannot be compiled" in bad.error
        assert "\n" not in bad.error


def test_every_structured_row_matches_and_overlap_equals_sync(engines) -> None:
    overlapped, synchronous = _run(engines[True], _mixed_prompts()), None
    _check_mixed(overlapped)
    synchronous = _run(engines[False], _mixed_prompts())
    assert {k: o.text for k, o in overlapped.items()} == {k: o.text for k, o in synchronous.items()}
    free = overlapped["plain", 0].text  # the model's own text would not match anything
    assert not re.fullmatch(REGEX, free) and free not in CHOICES


def test_seeded_rows_repeat_at_any_batch_composition(engines) -> None:
    engine = engines[True]
    alone = _run(engine, [p for p in _mixed_prompts() if p.request_id == "s-seeded"])
    crowd = _run(engine, _mixed_prompts()[::-1])
    assert alone["s-seeded", 1].text == crowd["s-seeded", 1].text
    again = _run(engine, _mixed_prompts())
    assert again["s-greedy", 0].text == crowd["s-greedy", 0].text


def test_preempted_structured_rows_equal_the_synchronous_ones(model_dir, engines) -> None:
    """A KV cache too small for the batch: samples are preempted and recomputed while their
    next tokens are in flight, and each matcher still consumes every output token once."""
    config = EngineConfig(device="cpu", max_num_seqs=6, block_size=8, num_kv_blocks=40)
    with Engine(model_dir("llama"), config) as engine:
        squeezed = _run(engine, _mixed_prompts())
        assert engine.scheduler.num_preemptions > 0
    _check_mixed(squeezed)
    synchronous = _run(engines[False], _mixed_prompts())
    assert {k: o.text for k, o in squeezed.items()} == {k: o.text for k, o in synchronous.items()}


def test_a_failing_step_leaves_no_fill_running(model_dir, monkeypatch) -> None:
    """The fill thread runs beside the step's forward: when queuing the forward fails, the
    error comes out, the fill is waited for, and the GIL switch interval is restored."""
    switch = sys.getswitchinterval()
    config = EngineConfig(device="cpu", max_num_seqs=4, check_model=False)
    with Engine(model_dir("llama"), config) as engine:
        begin, calls = engine.runner.begin, []

        def failing(batch):
            calls.append(batch)
            if len(calls) == 5:
                raise RuntimeError("device lost")
            return begin(batch)

        monkeypatch.setattr(engine.runner, "begin", failing)
        prompts = [Prompt(f"Row {i}", str(i), {"json_schema": EXAMPLE_SCHEMA}) for i in range(3)]
        with pytest.raises(RuntimeError, match="device lost"):
            _run(engine, prompts)
        assert sys.getswitchinterval() == switch
        assert not engine.grammars._filler._work_queue.qsize()
    assert sys.getswitchinterval() == switch


def test_a_cut_output_ends_length_not_stop(engines) -> None:
    prompt = Prompt("Cut short", "cut", {"json_schema": EXAMPLE_SCHEMA, "max_new_tokens": 5})
    (out,) = _run(engines[True], [prompt]).values()
    assert out.finish_reason == "length" and len(out.output_token_ids) == 5


def _allowed_steps(engine: Engine, params: SamplingParams, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] bool: the tokens the grammar allows before each output token, from a
    fresh llguidance matcher fed the output one token at a time."""
    llg_torch = pytest.importorskip("llguidance.torch")
    matcher = engine.grammars.submit(grammar_spec(params)).result().lanes[0].deep_copy()
    width = engine.grammars.host_mask.shape[1]
    masks = torch.zeros(len(tokens), width, dtype=torch.int32)
    for step, token in enumerate(tokens):
        llg_torch.fill_next_token_bitmask(matcher, masks, step)
        assert matcher.consume_token(token)
    shifts = torch.arange(32, dtype=torch.int32)
    return ((masks[:, :, None] >> shifts) & 1).view(len(tokens), -1)[:, : len(engine.tokenizer)]


def _reference_logprobs(path: Path, out, allowed: torch.Tensor | None) -> torch.Tensor:
    """The model's own log_softmax at each output position, over the allowed tokens only."""
    ids = torch.tensor([out.prompt_token_ids + out.output_token_ids])
    with torch.inference_mode():
        logits = hf_model(path)(ids).logits[0, len(out.prompt_token_ids) - 1 : -1].float()
    if allowed is not None:
        padded = torch.zeros_like(logits, dtype=torch.bool)  # tokens past the tokenizer: never
        padded[:, : allowed.shape[1]] = allowed.bool()
        logits = logits.masked_fill(~padded, float("-inf"))
    return logits.log_softmax(-1)


def test_a_schema_that_admits_no_value_is_named_on_its_row(engines) -> None:
    """A self-referring $ref compiles, but its grammar allows only the end of the output: the
    row's error says the schema admits no value, not that an empty output is bad JSON."""
    loop = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}
    prompts = [Prompt("Row", "r", {"json_schema": loop, "max_new_tokens": 8})]
    (out,) = engines[True].generate(prompts, SamplingParams())
    assert out.finish_reason == "error" and "its json_schema admits no value" in out.error, out


def test_a_regex_no_text_matches_is_an_error_not_an_empty_row(engines) -> None:
    """A regex of an empty class matches nothing: each row is an error naming it, never an
    empty text under finish_reason stop; a regex with a live branch still runs."""
    regexes = [r"[^\s\S]", r"ab[^\s\S]", r"[a&&b]", r"a(b[^\s\S]|c)"]
    prompts = [
        Prompt("Row", str(i), {"regex": r, "max_new_tokens": 8}) for i, r in enumerate(regexes)
    ]
    outs = {o.request_id: o for o in engines[True].generate(prompts, SamplingParams())}
    for i in range(3):
        assert outs[str(i)].finish_reason == "error" and outs[str(i)].text is None
        assert "matches no text at all: fix it" in outs[str(i)].error
    assert outs["3"].finish_reason == "stop" and outs["3"].text == "ac"


def test_one_of_runs_as_any_of_and_the_check_enforces_one(engines) -> None:
    """oneOf (pydantic's discriminated unions) is generated as anyOf; an output valid under
    two branches is an error row, one valid under exactly one is kept."""
    small = {"type": "integer", "minimum": 0, "maximum": 99}
    union = {"oneOf": [{**small, "multipleOf": 2}, {**small, "multipleOf": 3}]}
    prompts = [
        Prompt(
            "Row",
            str(i),
            {"json_schema": union, "max_new_tokens": 6, "temperature": 1.0, "seed": i},
        )
        for i in range(12)
    ]
    outs = list(engines[True].generate(prompts, SamplingParams()))
    for out in outs:
        if out.finish_reason == "stop":
            value = int(out.text)
            assert (value % 2 == 0) != (value % 3 == 0), out.text
        elif out.finish_reason == "error":
            assert "is valid under each of" in out.error, out.error
    assert any(out.finish_reason == "stop" for out in outs)


def test_a_grammar_engine_failure_on_an_output_is_its_error_row(model_dir, monkeypatch) -> None:
    """A matcher that fails on a token (past a limit of the grammar engine's) ends its sample
    as an error row naming the failure; the step and the other rows go on."""
    engine = Engine(model_dir("llama"), EngineConfig(device="cpu", max_num_seqs=6, overlap=0))
    refused = engine.tokenizer.encode("zz", add_special_tokens=False)[0]
    fill = Grammars._fill

    def failing(self: Grammars, executor: object, known: list, *rest: object) -> None:
        known = [  # the regex sample's first token, as if the mask had let through one its
            # matcher then refuses (llguidance's limits: "Too many items")
            (state, refused if state.spec.kind == "regex" and not state.accepted - 1 else tok)
            for state, tok in known
        ]
        return fill(self, executor, known, *rest)

    monkeypatch.setattr(Grammars, "_fill", failing)
    prompts = [
        Prompt("Row", "failed", {"regex": "[0-9]{3}", "max_new_tokens": 8}),
        Prompt("Row", "ok", {"json_object": True, "max_new_tokens": 40}),
    ]
    with engine:
        outs = {o.request_id: o for o in engine.generate(prompts, SamplingParams())}
    assert outs["failed"].finish_reason == "error" and outs["failed"].text is None
    assert outs["failed"].error.startswith(
        "request failed: the grammar engine failed on this output (Parser Error: token "
    ) and outs["failed"].error.endswith("): simplify the regex")
    assert outs["ok"].finish_reason in ("stop", "length") and outs["ok"].error is None


def test_structured_logprobs_are_under_the_grammar_mask(model_dir, engines) -> None:
    """As vLLM's: a structured row's logprobs are the raw logits' log_softmax over the tokens
    its grammar allows at that step (no temperature or filter), a forbidden token is never an
    alternative, and an unstructured row of the same batch keeps the model's own logprobs."""
    engine, path, k = engines[True], model_dir("llama"), 3
    rows = {
        "choice": {"choice": ("yes", "no"), "temperature": 1.0, "seed": 2},
        "regex": {"regex": REGEX, "temperature": 0.7, "top_k": 5, "seed": 5},
        "schema": {"json_schema": EXAMPLE_SCHEMA},
        "plain": {"temperature": 1.0, "seed": 8, "max_new_tokens": 12},
    }
    prompts = [Prompt(f"Row {name} says", name, {**v, "logprobs": k}) for name, v in rows.items()]
    out = _run(engine, prompts)
    tb = TokenBytes(engine.tokenizer)
    firsts = {t for t in range(len(engine.tokenizer)) if tb(t) and t not in tb.special}
    firsts = {t for t in firsts if any(c.encode().startswith(tb(t)) for c in ("yes", "no"))}
    for name, sampling in rows.items():
        o = out[name, 0]
        assert o.finish_reason in ("stop", "length") and len(o.logprobs) == len(o.output_token_ids)
        params = SamplingParams(**{f: v for f, v in sampling.items() if f in ("choice", "regex")})
        if name == "schema":
            params = SamplingParams(json_schema=EXAMPLE_SCHEMA)
        allowed = None if name == "plain" else _allowed_steps(engine, params, o.output_token_ids)
        if name == "choice":
            assert set(allowed[0].nonzero().view(-1).tolist()) == firsts
        reference = _reference_logprobs(path, o, allowed)
        for step, lp in enumerate(o.logprobs):
            assert lp.logprob == pytest.approx(reference[step, lp.token_id].item(), abs=1e-4)
            top = reference[step].topk(k)
            kept = top.values.isfinite() if allowed is not None else slice(None)
            assert lp.top_ids == top.indices[kept].tolist(), (name, step)
            assert lp.top_logprobs == pytest.approx(top.values[kept].tolist(), abs=1e-4)
            if allowed is not None:
                assert all(allowed[step, t] for t in lp.top_ids), (name, step)
    assert len(out["choice", 0].logprobs[0].top_ids) == len(firsts) < k  # no forbidden filler
    assert all(len(lp.top_ids) == k for lp in out["plain", 0].logprobs)


def test_bitmask_bit_order_matches_llguidance() -> None:
    llg_torch = pytest.importorskip("llguidance.torch")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int32)
    expected = logits.clone()
    llg_torch.apply_token_bitmask_inplace(expected, mask)
    assert torch.equal(apply_token_bitmask(logits, mask), expected)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": "[1]"}, "json_schema='[1]' must be a JSON object"),
        ({"regex": "a", "choice": ["b"]}, "regex and choice are given"),
        ({"choice": ["ok", ""]}, "choice=('ok', '') must be a list"),
        ({"json_object": True, "min_new_tokens": 2}, "cannot be combined with json_object"),
        ({"regex": "a", "ignore_eos": True}, "ignore_eos cannot be combined with regex"),
    ],
)
def test_bad_structured_settings_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**fields)


def test_schema_object_or_text_is_one_setting() -> None:
    text = json.dumps(EXAMPLE_SCHEMA)
    assert SamplingParams(json_schema=EXAMPLE_SCHEMA) == SamplingParams(json_schema=text)


def test_openai_response_format_maps_onto_sampling() -> None:
    def line(**body: object) -> dict:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
        obj = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
        return parse_request(obj, None, 1)

    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": EXAMPLE_SCHEMA}}
    assert line(response_format=fmt)["sampling"]["json_schema"] == EXAMPLE_SCHEMA
    assert line(response_format={"type": "json_object"})["sampling"]["json_object"] is True
    assert line(response_format={"type": "text"})["sampling"]["json_object"] is False
    assert line(guided_choice=["a", "b"])["sampling"]["choice"] == ("a", "b")
    for bad in ({"type": "yaml"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        row = line(response_format=bad)
        assert (row["error_code"], row["error_param"]) == ("invalid_value", "response_format")


def test_job_schema_column_and_bad_schemas(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama")
    rows = [{"prompt": f"Item {i}", "schema": EXAMPLE_SCHEMA} for i in range(3)]
    rows.append({"prompt": "Broken", "schema": json.dumps(BAD_SCHEMA)})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    limit = f"sampling.max_new_tokens={LIMIT}"
    run_job(spec_for(model, inp, tmp_path / "out", "prompt.json_schema_column='schema'", limit))
    out = read_rows(tmp_path / "out")
    for row in out[:3]:
        assert row["finish_reason"] == "stop"
        jsonschema.validate(json.loads(row["text"]), EXAMPLE_SCHEMA)
    assert out[3]["finish_reason"] == "error" and "cannot be compiled" in out[3]["error"]
    job_wide = f"sampling.json_schema={json.dumps(json.dumps(BAD_SCHEMA))}"
    with pytest.raises(BatchgenError, match=r"^\[sampling\] json_schema cannot be compiled"):
        run_job(spec_for(model, inp, tmp_path / "out2", job_wide))


def test_schemas_stored_as_arrow_structs_are_refused(model_dir, tmp_path: Path) -> None:
    """Arrow gives each row's struct the keys of all rows: {"k": {}} would read back as
    {"k": {"const": None}}, a schema that allows only null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    one = {"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"]}
    one["additionalProperties"] = False
    two = {"type": "object", "properties": {"k": {}}, "required": ["k"]}
    rows = [{"prompt": "A", "schema": one}, {"prompt": "B", "schema": two}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "structs.parquet")
    texts = [{**row, "schema": json.dumps(row["schema"])} for row in rows]
    pq.write_table(pa.Table.from_pylist(texts), tmp_path / "texts.parquet")
    sampled = [{"prompt": r["prompt"], "s": {"json_schema": r["schema"]}} for r in rows]
    pq.write_table(pa.Table.from_pylist(sampled), tmp_path / "sampled.parquet")
    model, limit = model_dir("llama"), f"sampling.max_new_tokens={LIMIT}"
    for name, column in (("structs", "json_schema_column"), ("sampled", "sampling_column")):
        key = "schema" if column == "json_schema_column" else "s"
        spec = spec_for(
            model, tmp_path / f"{name}.parquet", tmp_path / name, f"prompt.{column}={key!r}"
        )
        with pytest.raises(BatchgenError, match=r"as an Arrow struct.*store each schema as JSON"):
            run_job(spec)
        assert not (tmp_path / name).exists()
    spec = spec_for(
        model,
        tmp_path / "texts.parquet",
        tmp_path / "t",
        "prompt.json_schema_column='schema'",
        limit,
    )
    assert run_job(spec).complete
    got = read_rows(tmp_path / "t")
    assert [r["finish_reason"] for r in got] == ["stop", "stop"], got
    assert json.loads(got[0]["text"]) == {"k": "fixed"}


def test_a_complete_output_is_checked_against_its_spec() -> None:
    """What the grammar engine cannot promise is checked on the parsed value: a repeated key
    keeps its last value (so an object may hold fewer properties than the grammar counted),
    the schema's other semantics, the choices."""
    schema = GrammarSpec("json_schema", json.dumps(EXAMPLE_SCHEMA))
    assert spec_problem(schema, json.dumps(EXAMPLE_VALUE, separators=(",", ":"))) is None
    two = GrammarSpec("json_schema", json.dumps({"type": "object", "minProperties": 2}))
    assert spec_problem(two, '{"a":1,"b":2}') is None
    assert spec_problem(two, '{"a":1,"a":2}') == (
        "the output breaks its json_schema at the top level: {'a': 2} does not have enough "
        "properties"
    )
    free = GrammarSpec("json_schema", json.dumps({"type": "object"}))
    assert spec_problem(free, '{"a":1,"a":2}') is None  # valid as parsed
    bad = json.dumps({**EXAMPLE_VALUE, "rating": 9})
    assert spec_problem(schema, bad).startswith("the output breaks its json_schema at rating:")
    assert "not valid JSON" in spec_problem(schema, '{"title":')
    anything = GrammarSpec("json_object", json.dumps({"type": "object"}))
    assert spec_problem(anything, "[1]") == "the output is not a JSON object"
    assert spec_problem(anything, '{"k":[1,{"k":2}]}') is None


def test_an_output_whose_number_cannot_be_read_is_an_error_not_a_crash() -> None:
    """A model may write a number whose exponent no Decimal holds: its row is an error row
    (the check cannot run), never an exception that stops the job's writer."""
    huge = "9945029375001E0378773218673200780895350087350035050"
    for spec in (
        GrammarSpec("json_schema", "{}"),
        GrammarSpec("json_object", json.dumps({"type": "object"})),
    ):
        problem = spec_problem(spec, f'{{"a":{huge}}}')
        assert problem is not None and "could not be checked" in problem
    long = "1" * 5000  # valid JSON past Python's digit limit for int(): not "invalid JSON"
    problem = spec_problem(GrammarSpec("json_schema", "{}"), f'{{"a":{long}}}')
    assert problem == "the output holds a number too large to be read, so it could not be checked"
    choice = GrammarSpec("choice", json.dumps(list(CHOICES)))
    assert spec_problem(choice, CHOICES[2]) is None
    assert spec_problem(choice, "maybe") == "the output is not one of the choices"


def test_integer_bounds_beyond_64_bits_are_refused_before_any_output() -> None:
    """The grammar engine enforces integers of 64 bits: a range past them would be clamped
    and written outside (every row an error row, or a wrong number); refused up front, at any
    depth, while bounds within 64 bits (and huge bounds of plain numbers) are taken."""
    for bounds in ({"minimum": 10**19, "maximum": 10**19 + 5}, {"exclusiveMaximum": -(2**63) - 1}):
        schema = {"type": "object", "properties": {"n": {"type": ["integer", "null"], **bounds}}}
        problem = output_check.unchecked_problem(GrammarSpec("json_schema", json.dumps(schema)))
        assert problem is not None
        assert problem.startswith("its integer bound ") and "64-bit integers" in problem
    fine = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    number = {"type": "number", "maximum": 1e300}
    for schema in (fine, number):
        assert (
            output_check.unchecked_problem(GrammarSpec("json_schema", json.dumps(schema))) is None
        )


def test_a_schema_its_draft_does_not_allow_is_refused_before_any_output(
    model_dir, tmp_path: Path, engines
) -> None:
    """A draft-07 list of item schemas (or a draft-04 boolean exclusiveMaximum) without
    $schema: the grammar engine compiles it, but the check reads it as 2020-12, where it is no
    valid schema, and would fail on every output. Refused as an error row, or by validate and
    run before any output; with $schema naming its draft it runs, every output checked."""
    from batchgen.job import check_model_before_load

    pair = {"type": "array", "items": [{"type": "integer"}, {"type": "boolean"}], "minItems": 2}
    capped = {"type": "integer", "maximum": 5, "exclusiveMaximum": True}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **pair}
    prompts = [Prompt("Row p", "p", {"json_schema": pair, "max_new_tokens": 40})]
    prompts += [Prompt("Row c", "c", {"json_schema": capped})]
    prompts += [Prompt("Row 7", "7", {"json_schema": draft7, "max_new_tokens": 40})]
    out = {o.request_id: o for o in engines[True].generate(prompts, SamplingParams())}
    for key in ("p", "c"):
        assert out[key].finish_reason == "error" and not out[key].output_token_ids
        assert "is not a valid schema of its JSON Schema draft" in out[key].error, out[key].error
    assert "not a valid schema" not in (out["7"].error or ""), out["7"]  # its draft takes it
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Item"}])
    job_wide = f"sampling.json_schema={json.dumps(json.dumps(pair))}"
    spec = spec_for(model_dir("llama"), inp, tmp_path / "out", job_wide)
    with pytest.raises(
        BatchgenError, match=r"\(\[\{'type': 'integer'\}, \{'type': 'boolean'\}\] is not"
    ):
        check_model_before_load(spec)
    with pytest.raises(BatchgenError, match="is not a valid schema of its JSON Schema draft"):
        run_job(spec)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "pattern",
    [
        "^(?<area>[0-9]{3})-[0-9]{4}$",  # ECMA-262's named group: Python's re refuses it
        "^\\p{Lu}[a-z]+$",  # a Unicode class
        "^[[:digit:]]{2}$",  # a POSIX class: Python reads a nested set
        "a\\z",
    ],
)
def test_a_pattern_the_check_cannot_read_is_refused_before_any_output(
    model_dir, tmp_path: Path, engines, pattern: str
) -> None:
    """The grammar engine reads these patterns, Python's re (the check) does not, or reads
    them otherwise: refused as an error row, or before the job starts, never a crash or a
    right output turned into an error row."""
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": pattern}},
        "patternProperties": {"^x-": {"type": "integer"}},
        "required": ["code"],
    }
    nested = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}
    prompts = [Prompt("Row plain", "plain", {"max_new_tokens": 3})]
    prompts += [Prompt("Row s", "s", {"json_schema": schema})]
    prompts += [Prompt("Row n", "n", {"json_schema": nested})]
    out = {o.request_id: o for o in engines[True].generate(prompts, SamplingParams())}
    assert out["plain"].finish_reason == "length"
    for key in ("s", "n"):
        assert out[key].finish_reason == "error"
        assert "cannot be checked with Python's re" in out[key].error, out[key].error
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Item"}])
    job_wide = f"sampling.json_schema={json.dumps(json.dumps(schema))}"
    with pytest.raises(BatchgenError, match="cannot be checked with Python's re"):
        run_job(spec_for(model_dir("llama"), inp, tmp_path / "out", job_wide))
    assert not (tmp_path / "out" / "results.jsonl").exists()
    const = {"type": "object", "properties": {"a": {"const": {"pattern": "(?<x>y)"}}}}
    assert output_check.unchecked_problem(GrammarSpec("json_schema", json.dumps(const))) is None


def test_the_pattern_check_leaves_the_warning_filters_alone(monkeypatch) -> None:
    """It runs on the compile thread beside the engine's: changing warnings' filters (the
    whole process's) would turn other threads' warnings into exceptions."""
    import warnings

    def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError("the pattern check changed the process's warning filters")

    for name in ("catch_warnings", "simplefilter", "filterwarnings", "resetwarnings"):
        monkeypatch.setattr(warnings, name, touched)
    for pattern, refused in (("^[[:digit:]]{2}$", True), ("[a-z--b]", True), ("^[a-z]+$", False)):
        spec = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": pattern}))
        assert (output_check.unchecked_problem(spec) is not None) is refused, pattern


def test_numbers_are_checked_exactly() -> None:
    """4.94 is a multiple of 0.01 (4.94 / 0.01 is 494.00000000000006 in binary floats)."""
    cents = GrammarSpec("json_schema", json.dumps({"type": "number", "multipleOf": 0.01}))
    for text in ("4.94", "0.07", "1234.56", "3", "1e-2", "-0.29"):
        assert spec_problem(cents, text) is None, text
    assert spec_problem(cents, "4.945").startswith("the output breaks its json_schema")
    whole = GrammarSpec("json_schema", json.dumps({"type": "integer", "enum": [100, 2]}))
    assert spec_problem(whole, "1e2") is None and spec_problem(whole, "100") is None
    assert spec_problem(whole, "2.5") is not None
    tenth = GrammarSpec("json_schema", json.dumps({"enum": [0.1, "x"], "maximum": 0.3}))
    assert spec_problem(tenth, "0.1") is None
    assert spec_problem(tenth, "0.30000000000000004") is not None


def test_an_output_the_grammar_let_through_is_an_error_row(
    model_dir, tmp_path: Path, monkeypatch, engines
) -> None:
    """A grammar gap (simulated: the check holds every schema output to a key the grammar
    never writes) makes the row an error in every way out, never a silently wrong row; rows
    cut by max_new_tokens are incomplete by definition and are not checked."""
    impossible = Draft202012Validator({"type": "object", "required": ["never"]})
    monkeypatch.setattr(output_check, "_schema_validator", lambda source: impossible)
    prompts = [Prompt("Row s", "s", {"json_schema": EXAMPLE_SCHEMA})]
    prompts.append(Prompt("Row cut", "cut", {"json_schema": EXAMPLE_SCHEMA, "max_new_tokens": 4}))
    prompts.append(Prompt("Row c", "c", {"choice": CHOICES, "temperature": 1.0, "seed": 6}))
    for decode in (True, False):
        params = SamplingParams(max_new_tokens=LIMIT)
        out = {o.request_id: o for o in engines[True].generate(prompts, params, decode=decode)}
        assert out["s"].finish_reason == "error" and out["s"].text is None
        assert out["s"].error.startswith("request s: the output breaks its json_schema at ")
        assert out["s"].error.endswith(NEVER)
        assert out["cut"].finish_reason == "length" and out["cut"].error is None
        assert out["c"].finish_reason == "stop" and out["c"].error is None
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Item {i}"} for i in range(2)])
    schema = f"sampling.json_schema={json.dumps(json.dumps(EXAMPLE_SCHEMA))}"
    run_job(
        spec_for(
            model_dir("llama"), inp, tmp_path / "out", schema, f"sampling.max_new_tokens={LIMIT}"
        )
    )
    for row in read_rows(tmp_path / "out"):
        assert row["finish_reason"] == "error" and row["text"] is None
        assert row["error"] == "the output breaks its json_schema at the top level: " + NEVER


@pytest.mark.gpu
def test_structured_rows_on_the_gpu_overlap_equals_sync(model_dir) -> None:
    """The pinned mask buffer, its copy and CUDA graphs; draws differ from the CPU's, so only
    what holds for any draw is asserted."""
    path = model_dir("llama")
    texts = {}
    for overlap in (True, False):
        config = EngineConfig(device="cuda", overlap=overlap, max_num_seqs=6)
        with Engine(path, config) as engine:
            prompts = [p for p in _mixed_prompts() if not p.request_id.startswith("bad")]
            params = SamplingParams(max_new_tokens=400)
            out = {(o.request_id, o.sample_index): o for o in engine.generate(prompts, params)}
        texts[overlap] = {k: o.text for k, o in out.items()}
        for key, o in out.items():
            assert o.finish_reason in ("stop", "length"), key
            if key[0].startswith("s-") and o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), EXAMPLE_SCHEMA)
        assert re.fullmatch(REGEX, out["regex", 0].text)
        assert out["choice", 0].text in CHOICES
    assert texts[True] == texts[False]


def _grammars(tokenizer, threads: int) -> Grammars:
    eos = frozenset([tokenizer.eos_token_id])
    return Grammars(tokenizer, len(tokenizer), eos, 16, torch.device("cpu"), threads)


def test_parallel_fill_equals_one_thread_and_keeps_lanes_whole(model_dir) -> None:
    """Samples of one grammar spread over a lane per fill thread, and each step's work list
    holds each lane's rows contiguously (the executor splits it into contiguous ranges; copies
    of a lane share its lexer's lock); the masks equal one matcher's, filled one at a time."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    spec = GrammarSpec("json_schema", SamplingParams(json_schema=EXAMPLE_SCHEMA).json_schema)
    runs = {1: _grammars(tokenizer, 1), 3: _grammars(tokenizer, 3)}
    rows = {}
    for threads, grammars in runs.items():
        compiled = grammars.submit(spec).result()
        rows[threads] = [_row(grammars.matcher(compiled)) for _ in range(2)]
        assert len(compiled.lanes) == 1 and compiled.widened is not None  # a second use
        compiled.widened.result()
        rows[threads] += [_row(grammars.matcher(compiled)) for _ in range(5)]
    runs[3].prepare(GrammarSpec("regex", REGEX))  # a job-wide grammar: every lane at once
    assert len(runs[3].submit(GrammarSpec("regex", REGEX)).result().lanes) == 3
    assert [len({r.grammar.lexer for r in rows[t]}) for t in runs] == [1, 3]
    lexer_of = {id(r.grammar.matcher): r.grammar.lexer for r in rows[3]}
    orders = []  # per fill call on 3 threads: the lexers along its consume and work lists
    fill = runs[3]._fill

    def recorded(executor, known: list, pending: list, work: list, *rest) -> None:
        lexers = [
            [lexer_of[id(getattr(x, "matcher", x))] for x, _ in pairs] for pairs in (known, work)
        ]
        orders.extend(lexers)  # known holds samples' states, work their matchers
        return fill(executor, known, pending, work, *rest)

    runs[3]._fill = recorded
    llg_torch = pytest.importorskip("llguidance.torch")
    plain = [runs[1].submit(spec).result().lanes[0].deep_copy() for _ in range(7)]
    expected = torch.full((9, runs[1].host_mask.shape[1]), ALL_ALLOWED, dtype=torch.int32)
    rng, shifts = random.Random(0), torch.arange(32, dtype=torch.int32)
    quotes = {t for t in range(len(tokenizer)) if '"' in tokenizer.decode([t])}
    for _ in range(30):  # strings, between keys, the enum, the integer, the array
        masks = {t: g.fill(rows[t], 9).clone() for t, g in runs.items()}
        for row, matcher in enumerate(plain):  # llguidance itself, one matcher at a time
            llg_torch.fill_next_token_bitmask(matcher, expected, row)
        assert torch.equal(masks[1], expected) and torch.equal(masks[3], expected)
        assert (masks[3][7:] == ALL_ALLOWED).all()  # padding rows
        for row in range(7):
            allowed = ((masks[1][row][:, None] >> shifts) & 1).view(-1).nonzero().view(-1)
            ending = [t for t in allowed.tolist() if t in quotes]  # leave strings sooner
            pick = ending if ending and rng.random() < 0.3 else allowed.tolist()
            token = pick[rng.randrange(len(pick))]
            for t in runs:
                rows[t][row].output_token_ids.append(token)
            assert plain[row].consume_token(token)
    assert len(orders) == 2 * 30 and all(len(o) == 7 for o in orders[1::2])
    assert all(_runs(o) == len(set(o)) for o in orders) and len(set(orders[1])) == 3
    for grammars in runs.values():
        grammars.close()


def test_overlapping_fills_of_two_engines_restore_the_switch_interval(model_dir) -> None:
    """The GIL switch interval is shortened while any fill runs and restored by the last one
    to finish, whichever engine started first."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    spec = GrammarSpec("regex", REGEX)
    first, second = _grammars(tokenizer, 1), _grammars(tokenizer, 1)
    rows = {g: [_row(g.matcher(g.submit(spec).result()))] for g in (first, second)}
    before = sys.getswitchinterval()
    jobs = {g: g.start(rows[g], None) for g in (first, second)}
    first.finish(jobs[first], 1)
    assert sys.getswitchinterval() == pytest.approx(grammar_module.FILL_SWITCH_S) != before
    second.finish(jobs[second], 1)
    assert sys.getswitchinterval() == before
    for grammars in (first, second):
        grammars.close()


def _runs(lexers: list[int]) -> int:
    """Runs of equal neighbours in lexers: its number of distinct values iff each is contiguous."""
    return sum(1 for i, lexer in enumerate(lexers) if i == 0 or lexers[i - 1] != lexer)


def _row(state: GrammarState) -> SimpleNamespace:
    """What Grammars.fill reads of a request."""
    return SimpleNamespace(grammar=state, finish_reason=None, output_token_ids=[])


def test_a_structured_output_cut_by_a_stop_is_checked_as_cut() -> None:
    """Ended by a stop string or stop token before its grammar was complete: it passes only
    where its text as cut still matches its spec; a regex's never does (it is not checked)."""
    schema = GrammarSpec("json_schema", json.dumps({"type": "integer"}))
    early = "a stop string or stop token ended it before its json_schema was complete"
    assert output_problem(OutputCheck(schema, False), "12") is None
    problem = output_problem(OutputCheck(schema, False), '{"a":')
    assert problem.startswith(f"{early}: the output is not valid JSON"), problem
    assert output_problem(OutputCheck(schema, True), "12") is None
    regex = GrammarSpec("regex", REGEX)
    assert output_problem(OutputCheck(regex, True), "ab-12") is None
    assert output_problem(OutputCheck(regex, False), "ab-12") == (
        "a stop string or stop token ended it before its regex was complete, so it may not "
        "match the regex"
    )
    choice = GrammarSpec("choice", json.dumps(list(CHOICES)))
    assert output_problem(OutputCheck(choice, False), "yes") is None
    assert "not one of the choices" in output_problem(OutputCheck(choice, False), "ye")


def test_a_stop_string_that_cuts_a_structured_output_makes_an_error_row(
    engines, model_dir, tmp_path: Path
) -> None:
    """A stop string inside a JSON output cuts it to text that is not JSON: an error row
    naming why, in Engine.generate and in a job, never a row that ends `stop` with broken
    JSON; a stop string the output never holds changes nothing."""
    engine = engines[True]
    schema = {"json_schema": EXAMPLE_SCHEMA}
    (whole,) = _run(engine, [Prompt("Row s-greedy says", "whole", schema)]).values()
    assert whole.finish_reason == "stop" and whole.text.startswith('{"'), whole.text
    rows = {
        "cut": {**schema, "stop": (":",)},
        "regex-cut": {"regex": REGEX, "temperature": 1.0, "seed": 5, "stop": ("-",)},
        "never": {**schema, "stop": ("\u2603",)},
    }
    out = _run(engine, [Prompt("Row s-greedy says", name, v) for name, v in rows.items()])
    early = "a stop string or stop token ended it before its"
    for name in ("cut", "regex-cut"):
        o = out[name, 0]
        assert o.finish_reason == "error" and early in o.error and o.text is None, o
    assert out["never", 0].finish_reason == "stop" and out["never", 0].text == whole.text
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Row s-greedy says"}])
    sets = (
        f"sampling.json_schema={json.dumps(json.dumps(EXAMPLE_SCHEMA))}",
        "sampling.stop=[':']",
        f"sampling.max_new_tokens={LIMIT}",
    )
    assert run_job(spec_for(model_dir("llama"), inp, tmp_path / "out", *sets)).complete
    (row,) = read_rows(tmp_path / "out")
    assert row["finish_reason"] == "error" and early in row["error"], row
