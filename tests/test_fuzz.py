"""Property-based fuzzing of the job path: random malformed JSONL lines, per-row sampling values
and spec overrides. Every run ends with every row answered exactly once (good rows generated,
bad rows as error rows), or with one line and exit 2; never a traceback. Bounded for CI:
a fixed number of derandomized examples on one loaded engine."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from click.testing import CliRunner  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from batchgen import BatchgenError, Engine, EngineConfig  # noqa: E402
from batchgen.cli import main  # noqa: E402
from batchgen.job import run_job  # noqa: E402
from tests.test_job import read_rows, spec_for  # noqa: E402

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["\\udc00", "x\\ud800y"]),  # lone surrogates (as JSON escapes, below)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
small_ints = st.one_of(st.integers(min_value=-3, max_value=6), json_values)
sampling_values = st.dictionaries(
    st.sampled_from(
        ["max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "n",
         "seed", "stop", "stop_token_ids", "logprobs", "ignore_eos", "repetition_penalty",
         "presence_penalty", "unknown_field"]
    ),
    small_ints,
    max_size=4,
)  # fmt: skip
good_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(1, 4),
        "temperature": st.floats(0, 2),
        "top_k": st.integers(0, 50),
        "top_p": st.floats(0.05, 1),
        "n": st.integers(1, 3),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "logprobs": st.integers(0, 3),
    },
)
# mostly rows that can run, with every kind of bad value mixed in
prompts = st.one_of(*[st.text(min_size=1, max_size=40)] * 3, json_values)
uids = st.one_of(*[st.integers(0, 10**6).map(str)] * 3, json_values)
samplings = st.one_of(*[good_sampling] * 3, sampling_values, json_values)
rows = st.fixed_dictionaries(
    {"prompt": prompts, "uid": uids, "s": samplings}, optional={"tag": json_values}
)


def to_line(row: dict) -> str:
    # a surrogate written as "\\udc00" text becomes a real lone surrogate once parsed
    return json.dumps(row, allow_nan=True).replace("\\\\ud", "\\ud")


lines = st.one_of(
    *[rows.map(to_line)] * 4,
    st.text(max_size=30).filter(lambda t: "\n" not in t and "\r" not in t),  # mostly not JSON
    st.just('{"prompt": "cut short'),
)


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(model_dir("llama"), EngineConfig(device="cpu", max_num_seqs=16))


@settings(SETTINGS, max_examples=100)
@given(st.lists(lines, min_size=1, max_size=8), st.sampled_from(["jsonl", "parquet"]))
def test_random_rows_are_answered_exactly_once(engine, model_dir, batch, fmt) -> None:
    batch = [line for line in batch if line.strip()] or ['{"prompt": "hi"}']
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in.jsonl"
        inp.write_text("\n".join(batch) + "\n", encoding="utf-8", errors="surrogatepass")
        spec = spec_for(
            model_dir("llama"),
            inp,
            Path(tmp) / "out",
            "prompt.id_column='uid'",
            "prompt.sampling_column='s'",
            "prompt.passthrough=['tag']",
            "sampling.max_new_tokens=3",
            f"output.format='{fmt}'",
        )
        try:
            result = run_job(spec, engine=engine)
        except BatchgenError as exc:  # a job-level problem: one line, nothing written
            hypothesis.event("job-level error")
            assert "\n" not in str(exc) and not (Path(tmp) / "out" / "job.json").exists()
            return
        assert result.complete
        out = read_rows(Path(tmp) / "out")
    ok = sum(r["error"] is None for r in out)
    hypothesis.event("rows generated" if ok else "only error rows")
    indexes = sorted({r["index"] for r in out})
    assert indexes == list(range(len(batch)))
    keys = [(r["index"], r["sample_index"]) for r in out]
    assert len(keys) == len(set(keys))
    for row in out:
        if row["error"] is None:
            assert row["finish_reason"] in ("stop", "length") and isinstance(row["text"], str)
        else:
            assert row["finish_reason"] == "error" and row["text"] is None


SPEC_KEYS = [
    "sampling.temperature", "sampling.max_new_tokens", "sampling.top_p", "sampling.stop",
    "sampling.n", "sampling.seed", "prompt.truncate", "prompt.template", "prompt.column",
    "prompt.passthrough", "output.format", "output.shard_rows", "output.shard_seconds",
    "runtime.device", "runtime.dtype", "runtime.max_num_seqs", "runtime.block_size",
    "runtime.max_model_len", "runtime.attention_backend", "input.format", "input.batch_rows",
    "model.served_model_name", "nosuch.key", "sampling.nosuch",
]  # fmt: skip
toml_values = st.one_of(
    st.integers(min_value=-(2**65), max_value=2**65).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(
        lambda f: {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(str(f), repr(f))
    ),
    st.sampled_from(["true", "false", "'left'", "'auto'", "'cuda:7'", "[]", "['a', 1]", "{}"]),
    st.text(max_size=12).map(lambda t: json.dumps(t)),
    st.text(max_size=12),  # a bare word, or not TOML at all
)


@settings(SETTINGS, max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(SPEC_KEYS), toml_values), max_size=4))
def test_random_spec_overrides_end_in_ok_or_one_line(tmp_path_factory, overrides) -> None:
    tmp = tmp_path_factory.mktemp("spec")
    inp = tmp / "in.jsonl"
    inp.write_text('{"prompt": "hi", "a": 1}\n')
    args = ["validate", "--input", str(inp), "--output", str(tmp / "out")]
    for key, value in overrides:
        args += ["--set", f"{key}={value}"]
    result = CliRunner().invoke(main, args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        assert lines[-1].startswith("ok: ")
    else:
        assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
        assert len(lines) == 1 and lines[0].startswith("batchgen: error: "), lines


body_values = st.one_of(small_ints, st.text(max_size=6))
message_items = st.one_of(
    st.text(max_size=5), st.dictionaries(st.text(max_size=5), body_values, max_size=2)
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.one_of(
            st.just([{"role": "user", "content": "hi"}]),
            st.lists(message_items, max_size=2),
        ),
        "prompt": st.one_of(st.text(max_size=10), json_values),
        "max_tokens": small_ints,
        "n": small_ints,
        "temperature": body_values,
        "stop": st.one_of(st.text(max_size=3), json_values),
        "logprobs": json_values,
        "top_logprobs": small_ints,
        "model": st.one_of(st.just("served"), json_values),
        "seed": json_values,
    },
)  # fmt: skip
requests = st.fixed_dictionaries(
    {
        "custom_id": st.one_of(*[st.integers(0, 99).map(str)] * 3, json_values),
        "method": st.sampled_from(["POST", "POST", "GET"]),
        "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
        "body": st.one_of(*[bodies] * 3, json_values),
    }
)


@settings(SETTINGS, max_examples=60)
@given(st.lists(st.one_of(*[requests.map(to_line)] * 3, lines), min_size=1, max_size=6))
def test_random_openai_batch_lines_each_land_in_one_file(engine, model_dir, batch) -> None:
    batch = [line for line in batch if line.strip()] or ['{"custom_id": "x"}']
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in.jsonl"
        inp.write_text("\n".join(batch) + "\n", encoding="utf-8", errors="surrogatepass")
        spec = spec_for(
            model_dir("llama"),
            inp,
            Path(tmp) / "out",
            "input.format='openai-batch'",
            "model.served_model_name=['served']",
            "sampling.max_new_tokens=3",
        )
        assert run_job(spec, engine=engine).complete
        out = Path(tmp) / "out"
        ok = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        bad = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert len(ok) + len(bad) == len(batch)
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in ok)
    assert all(x["response"]["status_code"] in (400, 404) and x["error"] is None for x in bad)
    assert all(x["response"]["body"]["error"]["code"] for x in bad)
