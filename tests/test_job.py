"""The job runner end to end (in process): inputs, output contract, bad rows, resume rules."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers.utils import logging as hf_logging

from batchgen import BatchgenError, Engine, EngineConfig, SamplingParams
from batchgen.job import run_job
from batchgen.spec import load_spec


def write_jsonl(path: Path, rows: list[dict] | list[str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_rows(out_dir: Path) -> list[dict]:
    files = sorted(out_dir.glob("results.*"))
    assert len(files) == 1, f"one result file expected in {out_dir}"
    if files[0].suffix == ".parquet":
        return pq.read_table(files[0]).to_pylist()
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def spec_for(model: Path, inp: Path, out: Path, *sets: str):
    return load_spec(
        None,
        [
            f"model.path={json.dumps(str(model))}",
            f"input.path={json.dumps(str(inp))}",
            f"output.dir={json.dumps(str(out))}",
            "runtime.quiet=true",
            "runtime.device='cpu'",
            *sets,
        ],
    )


PROMPTS = [f"Tell me about item {i} and the weather." for i in range(12)]


def test_jsonl_job_matches_the_engine(model_dir, tmp_path: Path, capfd) -> None:
    """...and a quiet job prints no progress bar, transformers' weight loading included."""
    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p, "k": i} for i, p in enumerate(PROMPTS)])
    spec = spec_for(
        model,
        inp,
        tmp_path / "out",
        "sampling.max_new_tokens=10",
        "prompt.passthrough=['k']",
        "output.format='jsonl'",
        "output.include_token_ids=true",
        "output.shard_rows=5",
    )
    bars = hf_logging.is_progress_bar_enabled()
    result = run_job(spec)
    assert result.complete and not result.interrupted
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() == bars  # the process's setting is left as it was
    rows = read_rows(tmp_path / "out")
    assert [r["index"] for r in rows] == list(range(12))
    assert [r["id"] for r in rows] == [str(i) for i in range(12)]
    assert [r["k"] for r in rows] == list(range(12))
    engine = Engine(model, EngineConfig(device="cpu"))
    expected = {
        o.request_id: o for o in engine.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    }
    for r in rows:
        e = expected[r["id"]]
        assert r["token_ids"] == e.output_token_ids and r["text"] == e.text
        assert r["finish_reason"] == e.finish_reason and r["error"] is None
        assert r["num_prompt_tokens"] == len(e.prompt_token_ids)
        assert r["num_generated_tokens"] == len(e.output_token_ids)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rows_ok"] == 12 and summary["rows_error"] == 0 and summary["complete"]
    assert summary == result.summary.to_dict()
    phases = ["checks", "load", "shape", "kv_cache_and_graphs", "model_check", "first_row"]
    assert list(result.summary.startup_s) == phases and set(summary["startup_s"]) == set(phases)
    assert all(v >= 0 for v in summary["startup_s"].values())
    assert len(list((tmp_path / "out" / "shards").glob("part-*"))) >= 3


def test_parquet_and_saved_dataset_inputs(model_dir, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    model = model_dir("llama")
    table = pa.table({"article": PROMPTS[:6], "uid": [f"u{i}" for i in range(6)]})
    pq.write_table(table, tmp_path / "in.parquet")
    datasets.Dataset.from_dict(table.to_pydict()).save_to_disk(str(tmp_path / "saved"))
    results = []
    for name, inp in (("pq", tmp_path / "in.parquet"), ("ds", tmp_path / "saved")):
        spec = spec_for(
            model,
            inp,
            tmp_path / name,
            "prompt.template='Summarize: {article}'",
            "prompt.id_column='uid'",
            "sampling.max_new_tokens=6",
        )
        assert run_job(spec).complete
        results.append(read_rows(tmp_path / name))
    assert results[0] == results[1]
    assert [r["id"] for r in results[0]] == [f"u{i}" for i in range(6)]


def test_summary_reports_the_prefix_cache_hit_rate(model_dir, tmp_path: Path) -> None:
    """Rows behind one long instruction: the job's summary counts the prompt tokens the cache
    served; with runtime.enable_prefix_caching=false none, and the same texts."""
    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"article": p} for p in PROMPTS])
    instruction = "You are a careful assistant. Read the article and summarize it in one line."
    texts, summaries = [], []
    for caching in ("true", "false"):
        out = tmp_path / f"out-{caching}"
        spec = spec_for(
            model, inp, out, f"prompt.template='{instruction} Article: {{article}}'",
            "sampling.max_new_tokens=5", "runtime.block_size=8", "runtime.num_kv_blocks=256",
            f"runtime.enable_prefix_caching={caching}",
        )  # fmt: skip
        assert run_job(spec).complete
        texts.append([r["text"] for r in read_rows(out)])
        summaries.append(json.loads((out / "summary.json").read_text()))
    on, off = summaries
    assert texts[0] == texts[1]
    assert on["prompt_tokens"] == off["prompt_tokens"] > 0
    assert on["prompt_tokens_cached"] >= 11 * 8 and 0 < on["prefix_cache_hit_rate"] < 1
    assert on["prefix_cache_hit_rate"] == round(on["prompt_tokens_cached"] / on["prompt_tokens"], 4)
    assert off["prompt_tokens_cached"] == 0 and off["prefix_cache_hit_rate"] == 0


def test_bad_rows_become_error_rows(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama", max_position_embeddings=48)
    long_text = " ".join(["word"] * 200)
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "ok-1", "prompt": "Hello there"},
            '{"id": "broken", "prompt": ',
            {"id": "missing"},
            {"id": "null", "prompt": None},
            {"id": "empty", "prompt": ""},
            {"id": "long", "prompt": long_text},
            {"id": "not-text", "prompt": 17},
            {"id": "bad-temp", "prompt": "Hi", "temp": -2.0},
            {"id": "ok-1", "prompt": "duplicate id"},
            {"prompt": "no id"},
            {"id": {"key": 1}, "prompt": "an object as id"},
            {"id": "", "prompt": "an empty id"},
            {"id": "ok-2", "prompt": "Goodbye now"},
        ],
    )
    spec = spec_for(
        model,
        inp,
        tmp_path / "out",
        "prompt.id_column='id'",
        "prompt.temperature_column='temp'",
        "sampling.max_new_tokens=5",
    )
    result = run_job(spec)
    rows = read_rows(tmp_path / "out")
    assert len(rows) == 13 and [r["index"] for r in rows] == list(range(13))
    errors = [r for r in rows if r["finish_reason"] == "error"]
    assert [r["index"] for r in errors] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    messages = [r["error"] for r in errors]
    assert "line 2" in messages[0] and "JSON" in messages[0]
    assert "'prompt' is missing or null" in messages[1] and "missing or null" in messages[2]
    assert "prompt is empty" in messages[3]
    assert "max_model_len" in messages[4]
    assert messages[4].startswith("prompt has"), "no engine request id: the row is the context"
    assert "not text" in messages[5]
    assert "temperature" in messages[6]
    assert "duplicate id 'ok-1'" in messages[7]
    assert "id column 'id' is missing" in messages[8]
    assert "id column 'id' holds dict: an id is text or a number" in messages[9]
    assert errors[9]["id"] == "", "not Python's repr of the object"
    assert messages[10] == "id column 'id' is empty text: every row needs an id"
    assert all(r["text"] is None for r in errors)
    assert result.summary.rows_error == 11 and result.summary.rows_ok == 2


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_policy_keeps_long_prompts(model_dir, tmp_path: Path, mode: str) -> None:
    model = model_dir("llama", max_position_embeddings=48)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": " ".join(["word"] * 200)}])
    spec = spec_for(
        model, inp, tmp_path / "out", f"prompt.truncate='{mode}'", "sampling.max_new_tokens=8"
    )
    (row,) = (run_job(spec), read_rows(tmp_path / "out"))[1]
    assert row["error"] is None and row["num_prompt_tokens"] == 48 - 8
    assert row["num_generated_tokens"] == 8 or row["finish_reason"] == "stop"


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_leaves_prompts_within_the_context_whole(model_dir, mode: str) -> None:
    """Only a prompt over the context is cut (as vLLM reads it): one within it runs whole, its
    generation capped by the context, also where max_new_tokens would leave it little room."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    text = " ".join(["word"] * 12)  # 25 tokens, 36 as a chat prompt: within 47
    chat = [{"role": "user", "content": text}]
    for config, row in (
        (PromptConfig(truncate=mode), {"prompt": text}),
        (PromptConfig(truncate=mode, messages_column="m"), {"m": chat}),
    ):
        whole = PromptBuilder(config, tokenizer, 47, SamplingParams()).build(0, row)
        for new in (1, 20, 46, 47, 100):
            builder = PromptBuilder(config, tokenizer, 47, SamplingParams(max_new_tokens=new))
            built = builder.build(0, row)
            assert built.error is None and built.prompt_ids == whole.prompt_ids, (new, config)
            assert 25 <= len(built.prompt_ids) <= 47


def wordpiece_tokenizer(tmp_path: Path) -> Any:
    """A BERT-style tokenizer: whitespace dropped, a word it cannot spell one [UNK]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "[SEP]", "hello", "world", "x"])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )
    fast.save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("mode", ["error", "left", "right"])
def test_a_long_text_of_few_tokens_runs_whole(model_dir, tmp_path: Path, mode: str) -> None:
    """A prompt's length in characters says nothing of its tokens for a tokenizer that drops
    characters (WordPiece drops whitespace): such a prompt within the context runs whole,
    whatever its characters, never refused nor cut; for a tokenizer that keeps every
    character, a text too long to fit is still refused or cut before it is tokenized."""
    from transformers import AutoTokenizer

    from batchgen.engine.prompt_text import keeps_every_character
    from batchgen.prompts import PromptBuilder, PromptConfig

    wordpiece = wordpiece_tokenizer(tmp_path)
    assert not keeps_every_character(wordpiece)
    text = "hello" + " " * 20_000 + "world" + "\n" * 20_000 + "x" * 500  # 5 tokens
    built = PromptBuilder(PromptConfig(truncate=mode), wordpiece, 63, SamplingParams()).build(
        0, {"prompt": text}
    )
    assert built.error is None and built.prompt_ids == wordpiece(text).input_ids == [1, 3, 4, 0, 2]
    llama = AutoTokenizer.from_pretrained(model_dir("llama"))
    assert keeps_every_character(llama)
    builder = PromptBuilder(
        PromptConfig(truncate=mode), llama, 63, SamplingParams(max_new_tokens=8)
    )
    long = builder.build(0, {"prompt": " ".join(["word"] * 100_000)})
    if mode == "error":
        assert long.error.startswith("prompt has 499,999 characters, more than the model's")
    else:
        assert long.error is None and len(long.prompt_ids) == 64 - 8


def test_chat_prompts_are_truncated_on_the_left_only(model_dir, tmp_path: Path) -> None:
    """Cutting a chat prompt's right end would cut off the template's turn for the reply (the
    model would go on with the user's text): such a row is an error row; the left end may go."""
    model = model_dir("llama", max_position_embeddings=48)
    long = [{"role": "user", "content": " ".join(["word"] * 200)}]
    short = [{"role": "user", "content": "hi"}]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"m": long}, {"m": short}])
    sets = (
        "prompt.messages_column='m'",
        "sampling.max_new_tokens=8",
        "output.include_token_ids=true",
    )
    run_job(spec_for(model, inp, tmp_path / "right", *sets, "prompt.truncate='right'"))
    cut, fine = read_rows(tmp_path / "right")
    assert "truncate='right' would cut off the chat template's turn" in cut["error"]
    assert fine["error"] is None
    run_job(spec_for(model, inp, tmp_path / "left", *sets, "prompt.truncate='left'"))
    kept, _ = read_rows(tmp_path / "left")
    tokenizer = Engine(model, EngineConfig(device="cpu")).tokenizer
    reply = tokenizer("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert kept["error"] is None and kept["prompt_token_ids"][-len(reply) :] == reply


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_that_would_leave_no_prompt_is_an_error_row(
    model_dir, tmp_path: Path, mode: str
) -> None:
    model = model_dir("llama", max_position_embeddings=48)
    rows = [{"prompt": " ".join(["word"] * 200)}, {"prompt": "word word"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = spec_for(
        model, inp, tmp_path / "out", f"prompt.truncate='{mode}'", "sampling.max_new_tokens=48"
    )
    result = run_job(spec)
    cut, short = read_rows(tmp_path / "out")
    assert cut["text"] is None and "max_new_tokens=48 fills the whole context" in cut["error"]
    assert short["error"] is None and short["num_generated_tokens"] >= 1
    assert result.summary.rows_error == 1 and result.summary.rows_ok == 1


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_keeps_the_special_tokens_the_tokenizer_adds(
    model_dir, tmp_path: Path, mode: str
) -> None:
    """As Hugging Face truncates a text (and vLLM with it): the tokens the tokenizer adds around
    the text (a BOS, an EOS) are kept and only the text's own tokens are cut, on the side asked
    for; room for no more than them is an error row. A chat prompt, whose template writes its
    BOS as text, is cut as vLLM cuts it: its last tokens, the BOS going with the start."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig
    from tests.test_token_bytes import sentencepiece_style

    llama = AutoTokenizer.from_pretrained(model_dir("llama"))
    both = sentencepiece_style(tmp_path)  # made to add a BOS before the text and an EOS after
    both.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    texts = {llama: " ".join(["word"] * 40), both: " ".join(["Héllo wörld"] * 20)}
    for tokenizer, text in texts.items():
        config = PromptConfig(truncate=mode)
        builder = PromptBuilder(config, tokenizer, 19, SamplingParams(max_new_tokens=4))
        row = builder.build(0, {"prompt": text})
        tokenizer.truncation_side = mode
        cut = tokenizer(text, truncation=True, max_length=16).input_ids  # context 20, less 4
        assert row.error is None and row.prompt_ids == cut
        assert cut[0] == tokenizer.bos_token_id != cut[1]
        full = PromptBuilder(config, tokenizer, 19, SamplingParams(max_new_tokens=19))
        added = 1 if tokenizer is llama else 2  # room for these only: none of the text
        assert full.build(0, {"prompt": text}).error == (
            f"prompt has {len(tokenizer(text).input_ids)} tokens and max_new_tokens=19 fills "
            f"the whole context of 20 tokens (max_model_len) beside the {added} special "
            "token(s) the tokenizer adds, so truncating would leave no prompt: lower "
            "max_new_tokens"
        )
    assert cut[-1] == both.eos_token_id
    chat = [{"role": "user", "content": texts[llama]}]
    config = PromptConfig(truncate="left", messages_column="m")
    row = PromptBuilder(config, llama, 19, SamplingParams(max_new_tokens=4)).build(0, {"m": chat})
    rendered = llama.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(llama.bos_token)
    assert row.prompt_ids == llama(rendered, add_special_tokens=False).input_ids[-16:]
    assert llama.bos_token_id not in row.prompt_ids


def test_summary_prompt_tokens_count_only_the_prompts_the_engine_ran(
    model_dir, tmp_path: Path
) -> None:
    model = model_dir("llama", max_position_embeddings=48)
    rows = [{"prompt": "word word"}, {"prompt": " ".join(["word"] * 200)}, {"prompt": ""}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = spec_for(model, inp, tmp_path / "out", "sampling.max_new_tokens=2", "sampling.n=2")
    summary = run_job(spec).summary
    ok, _, too_long, _empty = read_rows(tmp_path / "out")
    assert too_long["error"] is not None and too_long["num_prompt_tokens"] > 48
    assert summary.rows_ok == 2 and summary.rows_error == 2
    assert summary.prompt_tokens == 2 * ok["num_prompt_tokens"]  # each sample its prompt
    assert summary.rows_committed_total == 3  # input rows; rows_ok / rows_error output rows


def test_summary_names_the_result_file_wherever_the_job_was_started(
    model_dir, tmp_path: Path, monkeypatch
) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "row"}])
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    spec = spec_for(model_dir("llama"), inp, Path("../out"), "sampling.max_new_tokens=2")
    summary = run_job(spec).summary
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    written = on_disk["result_file"]
    assert written == summary.result_file == str(tmp_path / "cwd" / "../out/results.parquet")
    assert Path(written).is_absolute() and Path(written).is_file()
    # the start-up phases in the order they ran (they add up in that order), as printed
    assert list(on_disk["startup_s"]) == list(summary.startup_s)
    assert list(summary.startup_s)[:2] == ["checks", "load"]


def test_a_stop_after_every_row_is_done_leaves_the_job_complete(model_dir, tmp_path: Path) -> None:
    """A SIGTERM (the stop event) that comes once the last row is done: the job still commits
    it and ends complete, with its final file, not "interrupted"."""
    import threading

    from batchgen.job import Hooks

    rows = [{"prompt": f"row {i}"} for i in range(5)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = spec_for(model_dir("llama"), inp, tmp_path / "out", "sampling.max_new_tokens=2")
    stop, seen = threading.Event(), []

    def on_rows(records: list[dict]) -> None:
        seen.extend(records)
        if len(seen) == len(rows):
            stop.set()

    result = run_job(spec, stop=stop, hooks=Hooks(on_rows=on_rows))
    assert stop.is_set() and result.complete and not result.interrupted
    assert result.summary.result_file is not None
    assert [r["index"] for r in read_rows(tmp_path / "out")] == list(range(5))


def test_chat_messages_with_system_prompt(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama")
    messages = [{"role": "user", "content": "Hi!"}]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"messages": messages}, {"messages": "not a list"}])
    spec = spec_for(
        model,
        inp,
        tmp_path / "out",
        "prompt.messages_column='messages'",
        "prompt.system_prompt='Be brief.'",
        "sampling.max_new_tokens=4",
        "output.include_token_ids=true",
    )
    run_job(spec)
    ok, bad = read_rows(tmp_path / "out")
    engine = Engine(model, EngineConfig(device="cpu"))
    chat = [{"role": "system", "content": "Be brief."}, *messages]
    rendered = engine.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert ok["prompt_token_ids"] == engine.tokenizer(rendered, add_special_tokens=False).input_ids
    assert ok["prompt_token_ids"].count(engine.tokenizer.bos_token_id) == 1
    assert "holds text, not a list of {role, content} messages" in bad["error"]


@pytest.mark.parametrize("role", ["system", "developer"])
def test_a_system_prompt_is_not_added_before_a_system_or_developer_message(
    model_dir, role: str
) -> None:
    """developer is OpenAI's newer name for the system role: a conversation that begins with
    one has its system message, and system_prompt is only for those that begin without."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    config = PromptConfig(messages_column="m", system_prompt="Be brief.")
    builder = PromptBuilder(config, tokenizer, 500, SamplingParams())
    own = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    bare = [{"role": "user", "content": "Hi"}]
    kept, added = builder.build_many([(0, {"m": own}), (1, {"m": bare})])
    assert kept.error is None and added.error is None
    text = tokenizer.decode(kept.prompt_ids)
    assert "Be brief." not in text and "Answer in French." in text
    assert "Be brief." in tokenizer.decode(added.prompt_ids)


DEVELOPER_STYLE = (  # names the developer role, as templates for OpenAI's roles do
    "{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}<|im_start|>"
    "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_a_developer_message_reaches_a_template_that_lacks_the_role_as_system(model_dir) -> None:
    """As vLLM passes it: a template that never names the developer role gets a developer
    message as a system one (its own system slot, never dropped); one that names it gets it."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ]
    config = PromptConfig(messages_column="m", system_prompt="Be brief.")
    as_system = PromptBuilder(config, tokenizer, 500, SamplingParams()).build(0, {"m": messages})
    text = tokenizer.decode(as_system.prompt_ids)
    assert "<|im_start|>system\nAnswer in French." in text and "developer" not in text
    tokenizer.chat_template = DEVELOPER_STYLE
    named = PromptBuilder(config, tokenizer, 500, SamplingParams()).build(0, {"m": messages})
    assert "[dev]<|im_start|>developer\nAnswer in French." in tokenizer.decode(named.prompt_ids)


PARTS_ONLY = (  # loops over content parts and nothing else, as some vision models' templates do
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% for part in m.content %}"
    "{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)
FIRST_PART_ONLY = (  # reads a system message's first part only, as Gemma 3's template does
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'system' %}"
    "{{ m.content[0].text }}{% else %}{% for part in m.content %}{{ part.text }}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_text_reaches_a_template_that_loops_over_content_as_one_part(model_dir) -> None:
    """For a template that loops over content, a message's text (and system_prompt) is passed
    as one text part, as vLLM passes it: a template that only loops would drop a string."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    tokenizer.chat_template = PARTS_ONLY
    config = PromptConfig(messages_column="m", system_prompt="Be brief.")
    row = {"m": [{"role": "user", "content": "Tell me a joke"}]}
    built = PromptBuilder(config, tokenizer, 500, SamplingParams()).build(0, row)
    text = tokenizer.decode(built.prompt_ids)
    assert "system\nBe brief.<|im_end|>" in text and "user\nTell me a joke<|im_end|>" in text


TOOL_AS_JSON = (  # loops over content, renders a tool's result with tojson, as Llama 4's does
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>ipython\n{{ m.content | tojson }}"
    "{% else %}<|im_start|>{{ m.role }}\n{% for part in m.content %}{{ part.text }}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_a_tool_result_reaches_a_template_that_loops_over_content_as_text(model_dir) -> None:
    """A tool message's content reaches the template as text (its text parts joined by
    newlines) whatever the template's content format, as vLLM passes it: templates render a
    tool's result as text, and one part wrapped in a list would put the list's JSON in the
    prompt. The prompt is Hugging Face's for the row's own messages."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    tokenizer.chat_template = TOOL_AS_JSON
    builder = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
    user = {"role": "user", "content": "Weather in Paris?"}
    parts = [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21C"}]
    for content, shown in (("sunny, 21C", '"sunny, 21C"'), (parts, '"sunny\\n21C"')):
        messages = [user, {"role": "tool", "tool_call_id": "c1", "content": content}]
        text = tokenizer.decode(builder.build(0, {"m": messages}).prompt_ids)
        assert f"<|im_start|>ipython\n{shown}<|im_end|>" in text, text
    as_parts = {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}
    messages = [as_parts, {"role": "tool", "content": "sunny, 21C"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(builder.build(0, {"m": messages}).prompt_ids) == expected


def test_a_template_that_renders_part_of_a_messages_text_parts_is_an_error_row(
    model_dir,
) -> None:
    """A template that reads only a message's first text part would drop the others without a
    word: the row is an error row naming the message; one part, or a template that renders
    every part, is fine."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    tokenizer.chat_template = FIRST_PART_ONLY
    builder = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
    parts = [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]
    user = {"role": "user", "content": "Hi"}
    rows = [
        [{"role": "system", "content": parts}, user],
        [{"role": "system", "content": "One."}, user],
    ]
    rows += [[{"role": "user", "content": parts}]]
    dropped, single, all_parts = builder.build_many([(i, {"m": m}) for i, m in enumerate(rows)])
    assert dropped.prompt_ids is None
    assert "renders only part of message 0's 2 text parts (not 'Part two.')" in dropped.error
    assert single.error is None and all_parts.error is None
    assert "Part one.Part two." in tokenizer.decode(all_parts.prompt_ids)


def test_a_dropped_text_part_whose_text_is_elsewhere_in_the_prompt_is_an_error_row(
    model_dir,
) -> None:
    """A part counts as rendered only where the template rendered that part: a dropped part
    whose text is also in another part or in another message is still an error row; a
    template that renders every part, equal parts too, is fine."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    tokenizer.chat_template = FIRST_PART_ONLY
    builder = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())

    def parts(*texts: str) -> list[dict[str, str]]:
        return [{"type": "text", "text": text} for text in texts]

    rows = [
        [{"role": "system", "content": parts("Answer in French.", "Answer")}],  # in part one
        [
            {"role": "system", "content": parts("Be brief.", "Never tell.")},
            {"role": "user", "content": "Never tell."},  # in another message
        ],
        [{"role": "user", "content": parts("Same.", "Same.")}],
    ]
    inside, elsewhere, equal = builder.build_many([(i, {"m": m}) for i, m in enumerate(rows)])
    assert "renders only part of message 0's 2 text parts (not 'Answer')" in inside.error
    assert "(not 'Never tell.')" in elsewhere.error and elsewhere.prompt_ids is None
    assert equal.error is None and "Same.Same." in tokenizer.decode(equal.prompt_ids)


def test_a_text_prompt_that_begins_with_the_bos_text_is_an_error_row(
    model_dir, tmp_path: Path
) -> None:
    """A text rendered by a chat template upstream begins with the BOS token's text; the
    tokenizer adds its own BOS before it, so the model would see two: an error row naming it
    (column and template alike). A BOS text elsewhere, or a tokenizer that adds none, is fine."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig
    from tests.test_token_bytes import sentencepiece_style

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    chat = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(bos)
    texts = [rendered, bos + bos + "hi", "hi", f"hi {bos} there", " " + rendered]
    want = "the prompt text already begins with the BOS token " + bos
    want += ", and the tokenizer adds another: remove it from the text, or use messages_column"
    for config in (PromptConfig(column="p"), PromptConfig(template="{p}")):
        builder = PromptBuilder(config, tokenizer, 500, SamplingParams())
        rows = builder.build_many([(i, {"p": text}) for i, text in enumerate(texts)])
        assert [r.error for r in rows[:2]] == [want, want]
        assert rows[0].prompt_ids is None
        for row in rows[2:]:
            assert row.error is None and row.prompt_ids[0] == bos_id != row.prompt_ids[1]
    builder = PromptBuilder(PromptConfig(template=bos + "Q: {q}"), tokenizer, 500, SamplingParams())
    assert builder.build(0, {"q": "x"}).error == want
    plain = sentencepiece_style(tmp_path)  # adds no BOS of its own
    builder = PromptBuilder(PromptConfig(column="p"), plain, 500, SamplingParams())
    (row,) = builder.build_many([(0, {"p": "<s>Hello"})])
    assert row.error is None and row.prompt_ids[0] == plain.bos_token_id
    assert row.prompt_ids.count(plain.bos_token_id) == 1


TOOL_TEMPLATE = (  # renders tool calls as Qwen2.5's template does (arguments | tojson)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if 'tool_calls' in m %}[calls]{% for tc in m.tool_calls %}{% set f = tc.function %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def tool_turns(arguments: object, calls: list | None = None) -> list[dict]:
    """A user question, an assistant turn calling a tool (OpenAI's format: arguments is JSON
    text) and the tool's answer."""
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call] if calls is None else calls},
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    ]


def test_tool_call_arguments_reach_the_chat_template_as_objects(model_dir) -> None:
    """As vLLM passes them: arguments given as JSON text are parsed (a template renders them
    with tojson, which would quote the text again), an empty tool_calls is left out; arguments
    that are not a JSON object make an error row."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    tokenizer.chat_template = TOOL_TEMPLATE
    builder = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
    given = tool_turns('{"city": "Paris"}')
    rows = [given, tool_turns({"city": "Paris"}), tool_turns(""), tool_turns(None, calls=[])]
    rows += [tool_turns('{"city": '), tool_turns("[1, 2]"), tool_turns(None, calls=[5])]
    text, parsed, empty, none, broken, array, odd = builder.build_many(
        [(i, {"m": m}) for i, m in enumerate(rows)]
    )
    assert text.error is None and text.prompt_ids == parsed.prompt_ids
    rendered = tokenizer.decode(text.prompt_ids)
    assert '"arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert given[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert '"arguments": {}}' in tokenizer.decode(empty.prompt_ids)
    assert none.error is None and "[calls]" not in tokenizer.decode(none.prompt_ids)
    assert broken.prompt_ids is None and broken.error.startswith(
        "column 'm' message 1: tool_calls[0].function.arguments is not valid JSON: "
    )
    assert "arguments must be a JSON object, not list" in array.error
    assert "tool_calls[0] must be a function call" in odd.error
    calls_only = tool_turns('{"city": "Paris"}')
    calls_only[1]["content"] = None  # OpenAI's form of an assistant turn that only calls tools
    no_calls = tool_turns(None, calls=[])
    no_calls[1]["content"] = None
    only, bare = builder.build_many([(0, {"m": calls_only}), (1, {"m": no_calls})])
    assert only.error is None and only.prompt_ids == text.prompt_ids
    assert "content must be text or a list of text parts, not none" in bare.error


def test_tool_call_arguments_that_are_not_an_object_are_error_rows(model_dir) -> None:
    """Only missing, null or empty arguments are {} (as vLLM takes them); any other value that
    is not an object, falsy or not, is an error row, never {}; JSON text nested too deeply to
    parse is an error row too, not the end of the job."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    tokenizer.chat_template = TOOL_TEMPLATE
    builder = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
    missing = tool_turns(None)
    del missing[1]["tool_calls"][0]["function"]["arguments"]
    empty = [missing, tool_turns(None), tool_turns("")]
    refused = [tool_turns(value) for value in ([], 0, False, "[]", "0", [1])]
    deep = tool_turns('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rows = builder.build_many([(i, {"m": m}) for i, m in enumerate([*empty, *refused, deep])])
    for row in rows[: len(empty)]:
        assert row.error is None and '"arguments": {}}' in tokenizer.decode(row.prompt_ids)
    kinds = ["list", "int", "bool", "list", "int", "list"]
    for row, kind in zip(rows[len(empty) : -1], kinds, strict=True):
        assert row.prompt_ids is None
        assert row.error.endswith(f"arguments must be a JSON object, not {kind}"), row.error
    assert rows[-1].error == (
        "column 'm' message 1: tool_calls[0].function.arguments is not valid JSON: nested too "
        "deeply"
    )


def test_json_text_nested_too_deeply_in_a_column_is_an_error_row(model_dir) -> None:
    """As a JSONL line nested too deeply is: the parser's RecursionError is the row's error."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    deep = "[" * 100_000 + "]" * 100_000
    config = PromptConfig(sampling_column="s", json_schema_column="j")
    builder = PromptBuilder(config, tokenizer, 500, SamplingParams())
    rows = [{"prompt": "a"}, {"prompt": "b", "s": '{"stop": ' + deep + "}"}]
    rows += [{"prompt": "c", "j": '{"type": "object", "x": ' + deep + "}"}, {"prompt": "d"}]
    first, sampling, schema, last = builder.build_many(list(enumerate(rows)))
    assert first.error is None and last.error is None
    assert sampling.error == "column 's' is not valid JSON: nested too deeply"
    assert schema.prompt_ids is None and "json_schema=" in schema.error


LLAMA3_STYLE = (  # renders content through a filter: a list would become its Python repr
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] | trim + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chat_messages_for_a_model_without_a_chat_template_are_refused(
    model_dir, tmp_path: Path
) -> None:
    import shutil

    base = tmp_path / "base"
    shutil.copytree(model_dir("llama"), base)
    (base / "chat_template.jinja").unlink()  # a base model: no chat template
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [{"m": [{"role": "user", "content": "hi"}], "prompt": "hi"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = spec_for(base, inp, tmp_path / "out", "prompt.messages_column='m'")
    with pytest.raises(BatchgenError, match=r"has no chat template, so prompt\.messages_column"):
        run_job(spec)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert run_job(spec_for(base, inp, tmp_path / "ok", "sampling.max_new_tokens=2")).complete


def test_chat_content_as_text_parts_is_joined_and_other_content_is_an_error_row(
    model_dir,
) -> None:
    """Text parts ({"type": "text", "text": ...}) are joined by newlines, as vLLM joins them;
    content that is no text (none, an image part) is an error row, not a prompt holding
    Python's repr of it (which a template that filters its content would render)."""
    from batchgen import SamplingParams
    from batchgen.prompts import PromptBuilder, PromptConfig

    engine = Engine(model_dir("llama"), EngineConfig(device="cpu"))
    tokenizer = engine.tokenizer
    tokenizer.chat_template = LLAMA3_STYLE
    builder = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    rows = [
        {"m": [{"role": "user", "content": parts}]},
        {"m": [{"role": "user", "content": "Hi\nthere"}]},
        {"m": [{"role": "user", "content": None}]},
        {"m": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ]
    joined, plain, empty, image = builder.build_many(list(enumerate(rows)))
    assert joined.error is None and joined.prompt_ids == plain.prompt_ids
    assert "'type'" not in tokenizer.decode(joined.prompt_ids)
    assert "message 0: content must be text or a list of text parts, not none" in empty.error
    assert "content part 0 is a 'image_url' part: batchgen runs text models" in image.error
    assert image.prompt_ids is None


def test_chat_rendering_options_reach_the_template_as_in_vllms_chat(
    model_dir, tmp_path: Path
) -> None:
    """prompt.continue_final_message (with add_generation_prompt = false) continues a final
    assistant message, and chat_template_kwargs reach the template, as Hugging Face renders
    them; options a template call cannot take, or a job without chat messages, are refused
    before any row; a rerun with other options does not resume the rows."""
    from transformers import AutoTokenizer

    model = model_dir("llama")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, it"}]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"m": turns}])
    chat = ("prompt.messages_column='m'", "output.include_token_ids=true")
    options = ("prompt.continue_final_message=true", "prompt.add_generation_prompt=false")
    options += ("prompt.chat_template_kwargs={style='terse'}",)
    spec = spec_for(model, inp, tmp_path / "out", *chat, *options, "sampling.max_new_tokens=2")
    assert run_job(spec).complete
    (row,) = read_rows(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(
        turns, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("assistant\nSure, it")
    assert row["prompt_token_ids"] == tokenizer(text, add_special_tokens=False).input_ids
    again = spec_for(model, inp, tmp_path / "out", *chat, "sampling.max_new_tokens=2")
    with pytest.raises(BatchgenError, match=r"setting prompt\.add_generation_prompt changed"):
        run_job(again)
    with pytest.raises(BatchgenError, match="set add_generation_prompt = false with it"):
        run_job(spec_for(model, inp, tmp_path / "o2", *chat, options[0]))
    assert not (tmp_path / "o2").exists()
    with pytest.raises(BatchgenError, match="cannot set 'tokenize', an argument of the template"):
        spec_for(model, inp, tmp_path / "o2", *chat, "prompt.chat_template_kwargs={tokenize=1}")
    plain = spec_for(model, inp, tmp_path / "o3", "prompt.column='m'", options[2])
    with pytest.raises(BatchgenError, match="chat_template_kwargs applies to chat messages"):
        run_job(plain)


def test_messages_as_arrow_maps_run_and_messages_as_text_are_refused(
    model_dir, tmp_path: Path
) -> None:
    """Messages stored as Arrow maps (list<map<string, string>>, as Spark writes them) render
    as the same messages stored as structs; a messages column of text is refused before any
    row (Parquet) or is an error row saying it holds text (a JSON line)."""
    model = model_dir("llama")
    turns = [[("role", "user"), ("content", "Hi")], [("role", "assistant"), ("content", "ok")]]
    turns.append([("role", "user"), ("content", "More")])
    as_maps = pa.array([turns], type=pa.list_(pa.map_(pa.string(), pa.string())))
    as_structs = pa.array([[dict(m) for m in turns]])
    sets = ("prompt.messages_column='m'", "output.include_token_ids=true")
    ids = []
    for name, column in (("maps", as_maps), ("structs", as_structs)):
        pq.write_table(pa.table({"m": column}), tmp_path / f"{name}.parquet")
        spec = spec_for(model, tmp_path / f"{name}.parquet", tmp_path / name, *sets)
        assert run_job(spec).complete
        (row,) = read_rows(tmp_path / name)
        assert row["error"] is None
        ids.append(row["prompt_token_ids"])
    assert ids[0] == ids[1]
    pq.write_table(pa.table({"m": [json.dumps([dict(m) for m in turns])]}), tmp_path / "t.parquet")
    with pytest.raises(BatchgenError, match=r"'m' holds text, not lists of \{role, content\}"):
        run_job(spec_for(model, tmp_path / "t.parquet", tmp_path / "t", *sets))
    assert not (tmp_path / "t").exists()
    inp = write_jsonl(
        tmp_path / "t.jsonl", [{"m": json.dumps([{"role": "user", "content": "Hi"}])}]
    )
    assert run_job(spec_for(model, inp, tmp_path / "j", *sets)).complete
    (row,) = read_rows(tmp_path / "j")
    assert "column 'm' holds text, not a list of {role, content} messages" in row["error"]


PARTS_STYLE = (  # loops over a message's content parts itself, as Llama 4's and Gemma 3's do
    "{{ bos_token }}{% set turns = messages %}{% for m in turns %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content | trim }}{% else %}"
    "{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}[{{ part.text }}]"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def test_text_parts_are_passed_as_a_list_to_a_template_that_loops_over_them(model_dir) -> None:
    """As vLLM detects a template's content format: a template that loops over a message's
    content gets the text parts as a list ({"type": "text", "text": ...}); one that renders
    content as text gets them joined by newlines."""
    from transformers import AutoTokenizer

    from batchgen.content_format import template_format
    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    parts = [{"type": "text", "text": "Look:", "extra": 1}, {"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": parts}]
    for template, expected in ((PARTS_STYLE, "[Look:][What?]"), (LLAMA3_STYLE, "Look:\nWhat?")):
        tokenizer.chat_template = template
        builder = PromptBuilder(PromptConfig(messages_column="m"), tokenizer, 500, SamplingParams())
        row = builder.build(0, {"m": messages})
        assert row.error is None and expected in tokenizer.decode(row.prompt_ids)
        plain = [{"role": "user", "content": [{"type": "text", "text": p["text"]} for p in parts]}]
        hf = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        assert (template is PARTS_STYLE) is (row.prompt_ids == tokenizer(hf).input_ids[1:])
    assert parts[0] == {"type": "text", "text": "Look:", "extra": 1}, "the row is left unchanged"
    assert template_format(PARTS_STYLE) == "openai" and template_format(LLAMA3_STYLE) == "string"
    loops = "{% for m in messages %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}"
    assert template_format(loops) == "openai"
    other = "{% for m in messages %}{% for c in m.tools %}{% endfor %}{% endfor %}"
    assert template_format(other) == template_format("{% for m in messages") == "string"


@pytest.mark.parametrize("prompt", ["prompt.column='prompt'", "prompt.template='Q: {prompt}'"])
def test_a_system_prompt_without_chat_messages_is_refused(
    model_dir, tmp_path: Path, prompt: str
) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    spec = spec_for(model_dir("llama"), inp, tmp_path / "out", prompt, "prompt.system_prompt='x'")
    with pytest.raises(BatchgenError, match="system_prompt applies to chat messages"):
        run_job(spec)
    assert not (tmp_path / "out").exists()


def test_a_served_model_name_outside_openai_batch_input_is_refused(
    model_dir, tmp_path: Path
) -> None:
    """served_model_name names the model in OpenAI Batch lines and results; rows of other
    inputs carry no model name, so the setting would do nothing: one line, nothing written."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    served = "model.served_model_name=['gpt-x']"
    spec = spec_for(model_dir("llama"), inp, tmp_path / "out", "prompt.column='prompt'", served)
    with pytest.raises(BatchgenError) as excinfo:
        run_job(spec)
    assert str(excinfo.value) == (
        "model.served_model_name names the model in openai-batch lines and results only: "
        "remove it, or run the input with --format openai-batch"
    )
    assert not (tmp_path / "out").exists()


def test_a_kv_cache_set_too_small_for_the_start_up_check_names_the_setting(model_dir) -> None:
    """num_kv_blocks given, too few for the model check's probe requests: the line names the
    setting and the blocks needed, not the model as one batchgen cannot run."""
    model = model_dir("llama")
    with pytest.raises(BatchgenError) as excinfo:
        Engine(model, EngineConfig(device="cpu", block_size=16, num_kv_blocks=2))
    assert str(excinfo.value) == (
        "num_kv_blocks=2 is too small: the start-up check of the model runs a 40-token "
        "request, which needs 3 blocks of 16 tokens: give at least 3, and enough for the "
        "longest prompt plus max_new_tokens"
    )
    assert Engine(model, EngineConfig(device="cpu", block_size=16, num_kv_blocks=3)).num_blocks == 3


def test_a_max_model_len_over_the_models_context_is_refused(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama", max_position_embeddings=48)
    with pytest.raises(BatchgenError, match="max_model_len=49 is more than the model's context"):
        Engine(model, EngineConfig(device="cpu", max_model_len=49))
    assert Engine(model, EngineConfig(device="cpu", max_model_len=48)).max_model_len == 48
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    spec = spec_for(model, inp, tmp_path / "out", "runtime.max_model_len=4096")
    with pytest.raises(BatchgenError, match="lower it, or leave it unset"):
        run_job(spec)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "setting",
    [
        "prompt.temperature_column='temp'",
        "prompt.max_new_tokens_column='temp'",
        "prompt.passthrough=['temp']",
        "prompt.sampling_column='temp'",
    ],
)
def test_a_jsonl_column_that_no_line_has_is_refused(
    model_dir, tmp_path: Path, setting: str
) -> None:
    """As for Parquet, whose schema says so up front; JSONL lines vary, so a column the first
    lines lack is looked for in every line (also one escaped as Python's json writes it)."""
    from batchgen.job import check_job

    model = model_dir("llama")
    rows = [{"prompt": f"row {i}", "temperature": 0.5} for i in range(150)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(BatchgenError, match="input has no column 'temp': no line of"):
        run_job(spec_for(model, inp, tmp_path / "out", setting))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    late = [*rows[:-1], {"prompt": "last", "temp": None}]  # only the 150th line has it
    check_job(spec_for(model, write_jsonl(tmp_path / "late.jsonl", late), tmp_path / "o", setting))
    (tmp_path / "parts").mkdir()
    write_jsonl(tmp_path / "parts" / "a.jsonl", rows[:3])
    write_jsonl(tmp_path / "parts" / "b.jsonl", [{"prompt": "x", "temp": None}])
    check_job(spec_for(model, tmp_path / "parts", tmp_path / "o2", setting))
    name = setting.replace("'temp'", "'température'")
    escaped = tmp_path / "escaped.jsonl"
    lines = [json.dumps(r) for r in rows] + [json.dumps({"prompt": "é", "température": 1})]
    escaped.write_text("\n".join(lines))  # the key past the first lines, as \u00e9
    check_job(spec_for(model, escaped, tmp_path / "o3", name))
    with pytest.raises(BatchgenError, match="no column 'température'"):
        check_job(spec_for(model, inp, tmp_path / "o4", name))
    # the prompt column too: missing from the first lines is not missing from the input
    check_job(spec_for(model, tmp_path / "late.jsonl", tmp_path / "o5", "prompt.column='temp'"))


def test_per_row_sampling_columns(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama")
    rows = [{"prompt": "Hello", "n": n, "seed": 7, "t": 1.0} for n in (1, 3, 6)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = spec_for(
        model,
        inp,
        tmp_path / "out",
        "prompt.max_new_tokens_column='n'",
        "prompt.seed_column='seed'",
        "prompt.temperature_column='t'",
        "sampling.ignore_eos=true",
    )
    run_job(spec)
    out = read_rows(tmp_path / "out")
    assert [r["num_generated_tokens"] for r in out] == [1, 3, 6]
    assert out[2]["text"].startswith(out[1]["text"])  # same seed: same draws, longer limit


def test_a_setting_given_in_two_columns_of_a_row_is_an_error_row(model_dir, tmp_path) -> None:
    """A sampling column and a column of its own for one setting: neither silently wins."""
    rows = [
        {"prompt": "Hello", "n": 5, "s": {"max_new_tokens": 3}},
        {"prompt": "Hello", "n": 5, "s": json.dumps({"max_tokens": 3})},  # vLLM's name
        {"prompt": "Hello", "n": 5, "s": {"temperature": 0.0}},
        {"prompt": "Hello", "n": None, "s": {"max_new_tokens": 2}},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    sets = ("prompt.max_new_tokens_column='n'", "prompt.sampling_column='s'")
    run_job(spec_for(model_dir("llama"), inp, tmp_path / "out", *sets, "sampling.ignore_eos=true"))
    first, second, other, alone = read_rows(tmp_path / "out")
    for row in (first, second):
        assert row["finish_reason"] == "error"
        assert row["error"] == (
            "max_new_tokens is given both in column 's' and in column 'n': give it in one of them"
        )
    assert other["error"] is None and other["num_generated_tokens"] == 5
    assert alone["error"] is None and alone["num_generated_tokens"] == 2


def test_a_template_field_holding_a_list_or_object_is_an_error_row(
    model_dir, tmp_path: Path
) -> None:
    rows = [
        {"topic": "rain", "n": 3},
        {"topic": ["rain", "snow"], "n": 3},
        {"topic": {"name": "rain"}, "n": 3},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    sets = ("prompt.template='Write {n} lines on {topic}.'", "sampling.max_new_tokens=2")
    run_job(
        spec_for(model_dir("llama"), inp, tmp_path / "out", *sets, "output.include_token_ids=true")
    )
    ok, listed, obj = read_rows(tmp_path / "out")
    assert ok["error"] is None
    tokenizer = Engine(model_dir("llama"), EngineConfig(device="cpu")).tokenizer
    assert ok["prompt_token_ids"] == tokenizer("Write 3 lines on rain.").input_ids
    assert "template field 'topic' holds list" in listed["error"]
    assert "template field 'topic' holds dict" in obj["error"]


def test_the_progress_bar_ends_at_the_jobs_error_count(model_dir, tmp_path: Path, capfd) -> None:
    """The bar's rates and error count are refreshed at most twice a second while rows come,
    and once more at the end: its last line counts every error row, not those of its last
    refresh."""
    rows = [{"prompt": "Hello there"}] + [{"prompt": ""} for _ in range(6)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = spec_for(model_dir("llama"), inp, tmp_path / "out", "sampling.max_new_tokens=2",
                    "runtime.quiet=false")  # fmt: skip
    result = run_job(spec)
    assert result.complete and result.summary.rows_error == 6
    last = capfd.readouterr().err.split("\r")[-1]
    assert "7/7" in last and "errors=6" in last, last


def test_a_template_names_any_column_that_str_format_reads_as_a_key(model_dir) -> None:
    """Column names with spaces or dashes fill their fields as str.format_map fills them; a
    field str.format reads otherwise ({} and {0}: positional; {a.b} and {a[0]}: an attribute
    or an item of a column) is refused up front, naming it."""
    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig, template_fields

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    template = "Hi {first name}, about {question-text}:"
    row = {"first name": "Ada", "question-text": "why?"}
    built = PromptBuilder(PromptConfig(template=template), tokenizer, 500, SamplingParams())
    (got,) = built.build_many([(0, row)])
    assert got.prompt_ids == tokenizer(template.format_map(row)).input_ids
    assert template_fields(template) == ["first name", "question-text"]
    for field in ("{}", "{0}", "{a.b}", "{a[0]}"):
        with pytest.raises(ValueError, match=f"has the field {re.escape(field)}, which str.format"):
            template_fields("Q: " + field)


def test_a_template_field_whose_value_its_format_spec_cannot_take_is_an_error_row(
    model_dir,
) -> None:
    """A value's own __format__ raises what it likes (OverflowError, TypeError, ...): the row
    is an error row naming the field and the column, and the other rows run as str.format
    renders them."""
    import datetime

    from transformers import AutoTokenizer

    from batchgen.prompts import PromptBuilder, PromptConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    template = "v={b:.2f} c={c:c} d={d!s:>10} {{b}}"
    builder = PromptBuilder(PromptConfig(template=template), tokenizer, 500, SamplingParams())
    ok = {"b": 1.5, "c": 65, "d": datetime.timedelta(seconds=5)}
    rows = [ok, {**ok, "b": 10**400}, {**ok, "c": -1}, {**ok, "d": "x"}, ok]
    good, overflow, char, text, again = builder.build_many(list(enumerate(rows)))
    assert good.error is None and text.error is None and good.prompt_ids == again.prompt_ids
    assert good.prompt_ids == tokenizer(template.format(**ok)).input_ids
    assert overflow.prompt_ids is None and overflow.error == (
        "template field {b:.2f} cannot format column 'b', which holds int: OverflowError: int "
        "too large to convert to float; change the template's format spec or the column's values"
    )
    assert char.error.startswith("template field {c:c} cannot format column 'c', which holds int")
    timed = PromptBuilder(PromptConfig(template="{d:>10}"), tokenizer, 500, SamplingParams())
    (row,) = timed.build_many([(0, {"d": datetime.timedelta(seconds=5)})])
    assert row.error.startswith(
        "template field {d:>10} cannot format column 'd', which holds timedelta: TypeError: "
    )


def test_a_template_that_begins_with_the_bos_token_is_refused_up_front(
    model_dir, tmp_path: Path
) -> None:
    """The tokenizer adds its own BOS before the template's: every row would be an error row,
    so the job is refused in one line before any output. A tokenizer that adds none takes it."""
    from batchgen.prompts import PromptConfig, check_template_bos
    from tests.test_token_bytes import sentencepiece_style

    model = model_dir("llama")
    tokenizer = Engine(model, EngineConfig(device="cpu")).tokenizer
    template = tokenizer.bos_token + "Q: {q}"
    inp = write_jsonl(tmp_path / "in.jsonl", [{"q": "a"}, {"q": "b"}])
    spec = spec_for(model, inp, tmp_path / "out", f"prompt.template={json.dumps(template)}")
    with pytest.raises(BatchgenError) as refused:
        run_job(spec)
    assert str(refused.value) == (
        f"prompt.template {template!r} begins with the BOS token {tokenizer.bos_token}, and the "
        "tokenizer adds its own, so the model would see two and every row would be an error "
        "row: remove it from the template"
    )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    ok = spec_for(
        model, inp, tmp_path / "ok", "prompt.template='Q: {q}'", "sampling.max_new_tokens=2"
    )
    assert run_job(ok).summary.rows_ok == 2
    check_template_bos(PromptConfig(template="<s>Q: {q}"), sentencepiece_style(tmp_path))


def test_jsonl_output_writes_dates_bytes_and_decimals_as_json_does(
    model_dir, tmp_path: Path
) -> None:
    """Types JSON lacks: ISO 8601 dates and times, base64 bytes, decimals as their exact text;
    never Python's repr (b'...')."""
    import base64
    import datetime
    import decimal

    table = pa.table(
        {
            "prompt": ["hi"],
            "ts": pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5)], pa.timestamp("us")),
            "day": pa.array([datetime.date(2024, 1, 2)], pa.date32()),
            "blob": pa.array([b"\x00\xffab"], pa.binary()),
            "price": pa.array([decimal.Decimal("1.50")], pa.decimal128(5, 2)),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    sets = ("prompt.passthrough=['ts', 'day', 'blob', 'price']", "output.format='jsonl'")
    out = tmp_path / "out"
    run_job(
        spec_for(
            model_dir("llama"), tmp_path / "in.parquet", out, *sets, "sampling.max_new_tokens=2"
        )
    )
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert row["ts"] == "2024-01-02T03:04:05" and row["day"] == "2024-01-02"
    assert base64.b64decode(row["blob"]) == b"\x00\xffab" and row["price"] == "1.50"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_float32_and_nanosecond_values_reach_templates_ids_and_output_exactly(
    model_dir, tmp_path: Path, fmt: str
) -> None:
    """A float32 value reads in a template and as an id as its own shortest text (0.1, not
    0.10000000149011612); a time64[ns] value keeps its nanoseconds in a template and in the
    output, and a duration is written to JSON in ISO 8601."""
    import datetime

    table = pa.table(
        {
            "f": pa.array([0.1, 3.3], pa.float32()),
            "t": pa.array([1234567890123, 0], pa.time64("ns")),
            "d": pa.array([datetime.timedelta(days=1, microseconds=5)] * 2, pa.duration("us")),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    sets = (
        "prompt.template='v {f} at {t}'",
        "prompt.id_column='f'",
        "prompt.passthrough=['t', 'd']",
        f"output.format='{fmt}'",
        "output.include_token_ids=true",
        "sampling.max_new_tokens=2",
    )
    model = model_dir("llama")
    run_job(spec_for(model, tmp_path / "in.parquet", tmp_path / "out", *sets))
    rows = read_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == ["0.1", "3.3"] and rows[0]["error"] is None
    tokenizer = Engine(model, EngineConfig(device="cpu")).tokenizer
    assert rows[0]["prompt_token_ids"] == tokenizer("v 0.1 at 00:20:34.567890123").input_ids
    if fmt == "jsonl":
        assert [r["t"] for r in rows] == ["00:20:34.567890123", "00:00:00"]
        assert rows[0]["d"] == "P1DT0H0M0.000005S"
    else:
        stored = pq.read_table(tmp_path / "out" / "results.parquet")
        assert stored.column("t").cast(pa.int64()).to_pylist() == [1234567890123, 0]
        assert stored.column("d").type == pa.duration("us")


def test_parquet_files_whose_types_no_type_holds_together_keep_every_value(
    model_dir, tmp_path: Path
) -> None:
    """One file's naive timestamps and dates beside another's zoned timestamps and times of
    day: one type would drop a zone or cut a time, so those columns are each value's JSON text
    in Parquet output; a column whose files agree keeps its type."""
    import datetime

    tokyo = datetime.timezone(datetime.timedelta(hours=9))
    day = datetime.datetime(2020, 1, 1, 12)
    files = {
        "a": (pa.array([day], pa.timestamp("us")), pa.array([day.date()])),
        "b": (pa.array([day.replace(tzinfo=tokyo)]), pa.array([day], pa.timestamp("s"))),
    }
    (tmp_path / "in").mkdir()
    for name, (when, on) in files.items():
        table = pa.table({"prompt": [name], "when": when, "on": on, "n": [len(name)]})
        pq.write_table(table, tmp_path / "in" / f"{name}.parquet")
    sets = ("prompt.passthrough=['when', 'on', 'n']", "sampling.max_new_tokens=2")
    out = tmp_path / "out"
    run_job(spec_for(model_dir("llama"), tmp_path / "in", out, *sets))
    got = read_rows(out)
    assert [r["when"] for r in got] == ['"2020-01-01T12:00:00"', '"2020-01-01T12:00:00+09:00"']
    assert [r["on"] for r in got] == ['"2020-01-01"', '"2020-01-01T12:00:00"']
    assert [r["n"] for r in got] == [1, 1]


def test_job_level_errors_before_model_work(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    with pytest.raises(BatchgenError, match="no column 'article'"):
        run_job(spec_for(model, inp, tmp_path / "o1", "prompt.template='S: {article}'"))
    with pytest.raises(BatchgenError, match=r"does not exist|no such|not found"):
        run_job(spec_for(model, tmp_path / "missing.jsonl", tmp_path / "o2"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(BatchgenError, match=r"bad\.parquet"):
        run_job(spec_for(model, tmp_path / "bad.parquet", tmp_path / "o3"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("someone else's files")
    with pytest.raises(BatchgenError, match="holds no batchgen job"):
        run_job(spec_for(model, inp, tmp_path / "busy"))
    assert not (tmp_path / "o1").exists(), "no output before the checks pass"


def test_resume_with_a_changed_spec_is_refused(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}, {"prompt": "there"}])
    out = tmp_path / "out"
    assert run_job(spec_for(model, inp, out, "sampling.max_new_tokens=3")).complete
    with pytest.raises(BatchgenError, match=r"sampling.temperature changed \(0.0 -> 0.5\)"):
        run_job(spec_for(model, inp, out, "sampling.max_new_tokens=3", "sampling.temperature=0.5"))
    again = run_job(
        spec_for(model, inp, out, "sampling.max_new_tokens=3", "runtime.max_num_seqs=4")
    )  # runtime changes are allowed
    assert again.complete and again.summary.run_rows_ok == 0
    forced = run_job(
        spec_for(model, inp, out, "sampling.max_new_tokens=3", "sampling.temperature=0.5"),
        force_resume=True,
    )
    assert forced.complete and len(read_rows(out)) == 2


def test_spec_errors_name_the_key(tmp_path: Path) -> None:
    base = ["input.path='x.jsonl'", "output.dir='o'"]
    with pytest.raises(BatchgenError, match=r"unknown key sampling\.temprature"):
        load_spec(None, [*base, "sampling.temprature=0.5"])
    with pytest.raises(
        BatchgenError, match=r"sampling.max_new_tokens = 'many': expected an integer"
    ):
        load_spec(None, [*base, "sampling.max_new_tokens='many'"])
    with pytest.raises(BatchgenError, match=r"unknown section \[smapling\]"):
        load_spec(None, [*base, "smapling.seed=1"])
    with pytest.raises(BatchgenError, match=r"\[sampling\] temperature=-1.0"):
        load_spec(None, [*base, "sampling.temperature=-1.0"])
    with pytest.raises(BatchgenError, match=r"\[input\] path is required"):
        load_spec(None, ["output.dir='o'"])
    job = tmp_path / "job.toml"
    job.write_text('[input]\npath = "a.jsonl"\n[output]\ndir = "o"\n[runtime]\nmax_num_seqs = 8\n')
    spec = load_spec(job, ["runtime.max_num_seqs=4", "prompt.passthrough=['a', 'b']"])
    assert spec.engine.max_num_seqs == 4 and spec.prompt.passthrough == ("a", "b")


@pytest.mark.parametrize(
    ("pattern", "out"),
    [("d/**/*.jsonl", "d/out"), ("d", "d/out"), ("d/*/*.jsonl", "d/out"), ("d/sub/*", "d/sub")],
)
def test_an_output_directory_the_input_would_read_is_refused(
    tmp_path: Path, monkeypatch, pattern: str, out: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "d" / "sub" / "a.jsonl", [{"prompt": "hi"}])
    spec = spec_for(Path("no-model-needed"), Path(pattern), Path(out))
    with pytest.raises(BatchgenError, match="would read its own results as input"):
        run_job(spec)
    assert not (tmp_path / out / "job.json").exists()


def test_an_output_directory_beside_the_input_is_fine(tmp_path: Path, monkeypatch) -> None:
    from batchgen.job import check_job

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"prompt": "hi"}])
    for pattern, out in (("d/*.jsonl", "d/out"), ("d", "d/_out"), ("d/a.jsonl", "o")):
        check_job(spec_for(Path("m"), Path(pattern), Path(out)))


def test_vllm_sampling_names_and_a_lone_stop_string() -> None:
    from batchgen import SamplingParams

    base = ["input.path='x.jsonl'", "output.dir='o'"]
    spec = load_spec(None, [*base, "sampling.max_tokens=7", "sampling.min_tokens=2"])
    assert (spec.sampling.max_new_tokens, spec.sampling.min_new_tokens) == (7, 2)
    assert load_spec(None, [*base, "sampling.stop='END'"]).sampling.stop == ("END",)
    with pytest.raises(BatchgenError, match="max_tokens and max_new_tokens are the same"):
        load_spec(None, [*base, "sampling.max_tokens=7", "sampling.max_new_tokens=8"])
    assert SamplingParams().replace(max_tokens=3).max_new_tokens == 3
    assert load_spec(None, [*base, "sampling.top_k=-1"]).sampling.top_k == 0  # vLLM's "off"
    assert SamplingParams(top_k=-1) == SamplingParams()
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    made = SamplingParams(max_tokens=5, min_tokens=2)  # as vLLM's SamplingParams is made
    assert (made.max_new_tokens, made.min_new_tokens) == (5, 2)
    with pytest.raises(ValueError, match=r"unknown sampling field\(s\) \['temprature'\]: use "):
        SamplingParams(temprature=0.5)


def test_numpy_numbers_are_taken_as_pythons() -> None:
    """A seed drawn by a NumPy Generator, a float32 temperature: taken as the int or float
    they hold (vLLM takes them), and kept as Python's numbers."""
    import numpy as np

    from batchgen import SamplingParams

    params = SamplingParams(
        max_new_tokens=np.int64(5),
        seed=np.random.default_rng(0).integers(0, 2**31),
        temperature=np.float32(0.5),
        top_p=np.float16(0.5),
        stop_token_ids=[np.int32(3)],
    )
    assert params == SamplingParams(
        max_new_tokens=5, seed=int(params.seed), temperature=0.5, top_p=0.5, stop_token_ids=[3]
    )
    assert type(params.seed) is int and type(params.stop_token_ids[0]) is int
    assert type(params.temperature) is float
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an integer"):
        SamplingParams(max_new_tokens=np.int64(0))


WARM_SCRIPT = """
import json, sys
from batchgen.job import run_job
from batchgen.spec import load_spec

from batchgen.io.writer import ShardWriter

spec = load_spec(None, json.loads(sys.argv[1]))
seen = ['pandas' in sys.modules]
commit = ShardWriter.commit
def first_commit(self, *args, **kwargs):  # notes what the first commit found imported
    if len(seen) == 1:
        seen.append('pandas' in sys.modules)
    return commit(self, *args, **kwargs)
ShardWriter.commit = first_commit
run_job(spec)
seen.append('pandas' in sys.modules)
print(json.dumps(seen))
"""


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_the_writers_first_use_costs_are_paid_before_its_first_commit(
    model_dir, tmp_path: Path, fmt: str
) -> None:
    """pyarrow's first conversion of Python values imports pandas where it is installed
    (0.15-0.2 s on a 2-core machine): for Parquet shards the writer has done it (while the
    first rows are generated) by its first commit, which does not pay it; a JSON Lines job,
    which never converts, never pays it."""
    import subprocess
    import sys

    pytest.importorskip("pandas")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    sets = [
        f"model.path={json.dumps(str(model_dir('llama')))}",
        f"input.path={json.dumps(str(inp))}",
        f"output.dir={json.dumps(str(tmp_path / 'out'))}",
        f"output.format='{fmt}'",
        "runtime.quiet=true",
        "runtime.device='cpu'",
        "sampling.max_new_tokens=2",
    ]
    done = subprocess.run(
        [sys.executable, "-c", WARM_SCRIPT, json.dumps(sets)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    before, at_commit, at_end = json.loads(done.stdout.strip().splitlines()[-1])
    assert not before  # nothing imported it yet: the checks below can fail
    assert (at_commit, at_end) == ((True, True) if fmt == "parquet" else (False, False))
    assert len(read_rows(tmp_path / "out")) == 2


def test_summary_counts_are_the_jobs_over_every_run(model_dir, tmp_path: Path) -> None:
    """A job stopped and resumed reports the counts one uninterrupted run reports (ok and
    error rows, prompt tokens of the samples the engine ran, generated tokens); this run's
    own are the run_* counts. A rerun of the complete job keeps the job's counts."""
    import threading

    from batchgen.job import Hooks

    model = model_dir("llama", max_position_embeddings=48)
    rows = [{"prompt": f"row {i} " * (1 + i % 3)} for i in range(14)]
    rows[3]["prompt"] = ""  # an error row the prompt stage makes
    rows[8]["prompt"] = " ".join(["word"] * 200)  # one the engine refuses: over the context
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    sets = ("sampling.max_new_tokens=3", "sampling.ignore_eos=true", "sampling.n=2")
    sets += ("output.shard_rows=2", "runtime.max_num_seqs=2")
    whole = run_job(spec_for(model, inp, tmp_path / "whole", *sets)).summary
    counts = ("rows_ok", "rows_error", "prompt_tokens", "generated_tokens")
    assert whole.rows_ok == 24 and whole.rows_error == 2 and whole.generated_tokens == 72

    spec = spec_for(model, inp, tmp_path / "out", *sets)
    stop, seen = threading.Event(), []

    def on_rows(records: list[dict]) -> None:
        seen.extend(records)
        if len(seen) >= 10:
            stop.set()

    # rows past the first 7 (13 records) are held back: the stop comes before the job could
    # finish, however fast the engine runs ahead of the writer
    hooks = Hooks(on_rows=on_rows, admit=lambda index: index < 7)
    first = run_job(spec, stop=stop, hooks=hooks).summary
    assert not first.complete and 0 < first.rows_committed_total < len(rows)
    resumed = run_job(spec).summary
    assert resumed.complete and resumed.resumed
    assert [getattr(resumed, k) for k in counts] == [getattr(whole, k) for k in counts]
    again = run_job(spec).summary
    assert [getattr(again, k) for k in counts] == [getattr(whole, k) for k in counts]
    assert [getattr(whole, k) for k in counts] == [getattr(whole, f"run_{k}") for k in counts]
    assert 0 < resumed.run_rows_ok < whole.rows_ok
    assert [getattr(again, f"run_{k}") for k in counts] == [0, 0, 0, 0]
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [written[k] for k in counts] == [getattr(whole, k) for k in counts]


def test_relative_paths_with_a_colon_in_their_first_part_are_local_files(
    model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "in-10:30/d.parquet" and "S3:/bucket" read as Arrow URIs would be unreadable: every
    shard judged damaged on resume. A rerun resumes and generates nothing."""
    monkeypatch.chdir(tmp_path)
    model = model_dir("llama")
    Path("in-10:30").mkdir()
    pq.write_table(pa.table({"prompt": PROMPTS[:6]}), tmp_path / "in-10:30" / "d.parquet")
    sets = ("sampling.max_new_tokens=4", "output.shard_rows=2")
    for out in ("rel-10:30/out", "S3:/bucket/run1"):
        first = run_job(spec_for(model, Path("in-10:30/d.parquet"), Path(out), *sets))
        assert first.complete and first.summary.rows_ok == 6
        again = run_job(spec_for(model, Path("in-10:30/d.parquet"), Path(out), *sets))
        assert again.complete and again.summary.resumed and again.summary.run_rows_ok == 0
        assert not (tmp_path / out / "damaged").exists()
        assert len(read_rows(tmp_path / out)) == 6


IMPORT_TAKES_1000_S = """
import json, sys, time
real = time.perf_counter
jump = [0.0]
time.perf_counter = lambda: real() + jump[0]

class SlowEngineImport:  # the engine module's import takes 1000 s on this clock
    def find_spec(self, name, path=None, target=None):
        if name == "batchgen.engine.engine":
            jump[0] += 1000.0
        return None

sys.meta_path.insert(0, SlowEngineImport())
from batchgen.job import run_job
from batchgen.spec import load_spec
assert "batchgen.engine.engine" not in sys.modules
result = run_job(load_spec(None, sys.argv[1:]))
print(json.dumps(result.summary.startup_s))
"""


def test_the_engine_import_counts_in_the_start_up_phases(model_dir, tmp_path: Path) -> None:
    """An engine in the job's process: importing its module (seconds, the first time) is part
    of "load", so the phases add up to the time from the start to the first row."""
    import subprocess
    import sys

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    sets = [
        f"model.path={json.dumps(str(model_dir('llama')))}",
        f"input.path={json.dumps(str(inp))}",
        f"output.dir={json.dumps(str(tmp_path / 'out'))}",
        "runtime.quiet=true",
        "runtime.device='cpu'",
        "runtime.engine_process='thread'",
        "sampling.max_new_tokens=2",
    ]
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_TAKES_1000_S, *sets], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    phases = json.loads(run.stdout.splitlines()[-1])
    assert 1000 <= phases["load"] < 2000, phases
    assert sum(phases.values()) < 2000, phases
