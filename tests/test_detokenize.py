"""Output text reads as it does after the prompt, also for tokenizers whose decode strips the
leading space of a text (Llama 2's, Mistral's): the row's text, its stop strings and its
structured-output check all see the space its first token holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from batchgen import Engine, EngineConfig, SamplingParams
from batchgen.engine.detokenize import output_text
from batchgen.engine.stop_strings import match_stop_strings
from batchgen.job import run_job
from tests.helpers import SPM_VOCAB, script_outputs, sentencepiece_model
from tests.test_job import read_rows, spec_for, write_jsonl

PROMPTS = [
    "The weather today is",
    "Tell me a story about",
    "Once upon a time",
    "The capital of the country",
    "Here is a list of",
    "My favourite food is",
    "A short poem:",
    "In the morning we",
]


@pytest.fixture(scope="module")
def spm(model_dir, tmp_path_factory) -> Path:
    base = model_dir("llama", vocab_size=SPM_VOCAB)
    return sentencepiece_model(tmp_path_factory.mktemp("spm") / "model", base)


def after_prompt(tokenizer, prompt: list[int], output: list[int]) -> str:
    """What decoding prompt and output together adds to the prompt's own text."""
    whole = tokenizer.decode(prompt + output, skip_special_tokens=True)
    own = tokenizer.decode(prompt, skip_special_tokens=True)
    assert whole.startswith(own)
    return whole[len(own) :]


def test_output_text_is_what_the_output_adds_after_its_prompt(spm: Path, model_dir) -> None:
    text = "Hello world, the weather is fine. Über die Straße — ünïcödé 😀 done."
    for folder in (spm, model_dir("llama")):
        tok = AutoTokenizer.from_pretrained(folder)
        ids = tok(text, add_special_tokens=False).input_ids
        for k in range(1, len(ids)):
            before, after = ids[:k], ids[k:]
            got = output_text(tok, before, after)
            if not tok.decode(before).endswith("\ufffd"):  # a character split at k
                assert got == after_prompt(tok, before, after), (folder.name, k)
    tok = AutoTokenizer.from_pretrained(spm)
    ids = tok(" yes", add_special_tokens=False).input_ids
    assert tok.decode(ids) == "yes"  # decoded alone, the space is stripped
    assert output_text(tok, tok("Answer:").input_ids, ids) == " yes"
    assert output_text(tok, [], ids) == "yes"  # no prompt: the text's start


def test_engine_and_job_texts_keep_the_first_tokens_space(spm: Path, tmp_path: Path) -> None:
    engine = Engine(spm, EngineConfig(device="cpu"))
    tok = engine.tokenizer
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = sorted(engine.generate(PROMPTS, params), key=lambda o: int(o.request_id))
    spaced = [o for o in outs if tok.convert_ids_to_tokens(o.output_token_ids[0]).startswith("▁")]
    assert spaced, "no output starts with a spaced piece: the test checks nothing"
    for out in outs:
        assert out.text == after_prompt(tok, out.prompt_token_ids, out.output_token_ids)
    assert all(o.text.startswith(" ") for o in spaced)

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    for processes in (0, 1):
        out_dir = tmp_path / f"out-{processes}"
        spec = spec_for(
            spm,
            inp,
            out_dir,
            "sampling.max_new_tokens=8",
            "sampling.ignore_eos=true",
            "output.format='jsonl'",
            f"runtime.tokenizer_processes={processes}",
        )
        assert run_job(spec).complete
        assert [r["text"] for r in read_rows(out_dir)] == [o.text for o in outs]


def test_a_stop_string_matches_the_first_tokens_space(spm: Path) -> None:
    engine = Engine(spm, EngineConfig(device="cpu"))
    tok = engine.tokenizer
    free = list(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True)))
    spaced = [o for o in free if o.text.startswith(" ") and len(o.text.strip()) >= 2]
    assert spaced
    for out in spaced:
        stop = out.text[:3]  # the space and what follows: only the output's start holds it
        prompt = tok.decode(out.prompt_token_ids, skip_special_tokens=True)
        params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=(stop,))
        (cut,) = engine.generate([out.prompt_token_ids], params)
        assert cut.finish_reason == "stop", (prompt, stop)
        assert cut.text == ""
        kept = SamplingParams(
            max_new_tokens=8, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True
        )
        (whole,) = engine.generate([out.prompt_token_ids], kept)
        assert whole.text.startswith(stop)


def test_a_regex_with_a_leading_space_matches_the_rows_text(spm: Path, tmp_path: Path) -> None:
    pytest.importorskip("llguidance")
    pattern = r" [a-z]{2,6}"
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    spec = spec_for(
        spm,
        inp,
        tmp_path / "out",
        "sampling.max_new_tokens=10",
        "sampling.temperature=1.0",
        f"sampling.regex={pattern!r}",
        "output.format='jsonl'",
    )
    assert run_job(spec).complete
    rows = read_rows(tmp_path / "out")
    done = [r for r in rows if r["finish_reason"] == "stop"]
    assert done and all(r["error"] is None for r in rows)
    assert all(re.fullmatch(pattern, r["text"]) for r in done), [r["text"] for r in done]


def test_the_test_tokenizer_keeps_byte_pieces_as_text(spm: Path) -> None:
    """Its byte pieces are ordinary tokens, as Llama 2's and Mistral's are: text they spell
    (emoji, CJK) is kept however special tokens are skipped."""
    tok = AutoTokenizer.from_pretrained(spm)
    text = "Hello 世界 😀 done"
    ids = tok(text, add_special_tokens=False).input_ids
    assert any(piece.startswith("<0x") for piece in tok.convert_ids_to_tokens(ids))
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_an_output_after_a_prompt_ending_in_byte_pieces_keeps_its_space(spm: Path) -> None:
    """The context tokens before an output may begin inside a character spelled in byte pieces
    (its first bytes cut off): the output still reads as it does after the prompt."""
    tok = AutoTokenizer.from_pretrained(spm)
    text = "Hello 世界, the weather 😀 is fine. 日本語のテキスト and ünïcödé 🎉 end."
    ids = tok(text, add_special_tokens=False).input_ids
    prompt = tok("Answer:").input_ids
    whole = output_text(tok, prompt, ids)
    assert whole == " " + text
    for k in range(1, len(ids)):
        head = output_text(tok, prompt, ids[:k])
        if not head.endswith("\ufffd"):  # not a character split at k
            assert head + output_text(tok, prompt + ids[:k], ids[k:]) == whole, k


@pytest.mark.parametrize(
    "prompt_text", ["Answer: \ufffd", "Answer:\ufffd", "x \ufffd\ufffd", "\ufffd"]
)
def test_an_output_after_a_prompt_ending_in_a_real_replacement_character_keeps_its_space(
    spm: Path, model_dir, monkeypatch, prompt_text: str
) -> None:
    """U+FFFD is text like any other character (scraped text holds it): a prompt ending in
    one is no half character, and the output after it keeps its first token's space."""
    for folder in (spm, model_dir("llama")):
        tok = AutoTokenizer.from_pretrained(folder)
        prompt = tok(prompt_text).input_ids
        out = tok(" yes it is", add_special_tokens=False).input_ids
        assert output_text(tok, prompt, out) == " yes it is", folder.name
        assert output_text(tok, prompt, out) == after_prompt(tok, prompt, out)
        assert match_stop_strings(out, (" yes",), True, 0, tok, prompt) == " yes"
    engine = Engine(spm, EngineConfig(device="cpu"))
    prompt = engine.tokenizer(prompt_text).input_ids
    out = engine.tokenizer(" yes it is", add_special_tokens=False).input_ids
    script_outputs(monkeypatch, {len(prompt): out})
    params = SamplingParams(max_new_tokens=len(out), ignore_eos=True)
    (free,) = engine.generate([prompt], params)
    (cut,) = engine.generate([prompt], params.replace(stop=(" it",)))
    assert (free.text, cut.text, cut.finish_reason) == (" yes it is", " yes", "stop")


def test_a_prompt_ending_inside_a_character_is_no_context(spm: Path, model_dir) -> None:
    """A context whose bytes end inside a character (its U+FFFD is no text) is not read
    before the output: one whose tokens finish that character decodes alone, and one that
    starts a new character after a prompt whose text is whole reads as after the prompt."""
    text = "Hello 世界, the weather 😀 is fine. 日本語のテキスト and ünïcödé 🎉 end."
    for folder in (spm, model_dir("llama")):
        tok = AutoTokenizer.from_pretrained(folder)
        ids = tok(text, add_special_tokens=False).input_ids
        prompt = tok("Answer:").input_ids
        split = 0
        for k in range(1, len(ids)):
            before, after = prompt + ids[:k], ids[k:]
            if tok.decode(before).endswith("\ufffd"):  # a character split at k
                split += 1
                got = output_text(tok, before, after)
                assert got == tok.decode(after, skip_special_tokens=True), (folder.name, k)
                assert text.endswith(got.lstrip("\ufffd")), (folder.name, k)
        assert split, "no character is split: the test checks nothing"


def test_an_output_after_a_prompt_cut_inside_a_character_keeps_its_space(
    spm: Path, monkeypatch
) -> None:
    """Token ids cut inside a character (its bytes unfinished), or a stray byte piece before a
    special token: the output does not go on with that character, so it reads as after the
    prompt, its first token's space kept, and a stop string beginning with the space ends it."""
    engine = Engine(spm, EngineConfig(device="cpu"))
    tok = engine.tokenizer
    out = tok(" the soup is hot", add_special_tokens=False).input_ids
    whole = tok("Answer: 龍 and 😀").input_ids
    pieces = tok.convert_ids_to_tokens(whole)
    cuts = [k for k in range(1, len(whole)) if tok.decode(whole[:k]).endswith("\ufffd")]
    assert len(cuts) >= 3 and all(pieces[k - 1].startswith("<0x") for k in cuts), pieces
    stray = [*tok("Answer:").input_ids, tok.convert_tokens_to_ids("<0xE9>"), tok.eos_token_id]
    for prompt in [whole[:k] for k in cuts] + [stray]:
        assert output_text(tok, prompt, out) == " the soup is hot" == after_prompt(tok, prompt, out)
        assert match_stop_strings(out, (" the",), False, 0, tok, prompt) == ""
    prompt = whole[: cuts[0]]
    script_outputs(monkeypatch, {len(prompt): out})
    params = SamplingParams(max_new_tokens=len(out), ignore_eos=True)
    (free,) = engine.generate([prompt], params)
    (cut,) = engine.generate([prompt], params.replace(stop=(" soup",)))
    assert (free.text, cut.text, cut.finish_reason) == (" the soup is hot", " the", "stop")
