"""Sampling features end to end on the CPU: n samples, logprobs, min_new_tokens, stop strings,
per-row values and reproducibility through an interruption."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from batchgen import BatchgenError, Engine, EngineConfig, Prompt, SamplingParams
from batchgen.engine.detokenize import output_text
from batchgen.engine.stop_strings import match_stop_strings
from batchgen.job import run_job
from tests.helpers import hf_greedy, hf_model, random_prompts, script_outputs
from tests.test_job import read_rows, spec_for, write_jsonl


@pytest.fixture(scope="module")
def path(model_dir) -> Path:
    return model_dir("llama")


def engine(path: Path, **config) -> Engine:
    return Engine(path, EngineConfig(device="cpu", **config))


def test_n_samples_are_separate_results(path: Path) -> None:
    prompt = random_prompts(1, 5, 5, 1000, seed=1)[0]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=3, ignore_eos=True)
    outs = sorted(engine(path).generate([prompt], params), key=lambda o: o.sample_index)
    assert [o.sample_index for o in outs] == [0, 1, 2, 3]
    assert all(o.num_samples == 4 and o.request_id == "0" for o in outs)
    assert len({tuple(o.output_token_ids) for o in outs}) == 4, "samples must differ"
    again = sorted(
        engine(path, max_num_seqs=2).generate([prompt], params), key=lambda o: o.sample_index
    )
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs]
    greedy = list(engine(path).generate([prompt], SamplingParams(max_new_tokens=8, n=3)))
    assert len({tuple(o.output_token_ids) for o in greedy}) == 1


def test_each_generate_call_draws_new_unseeded_samples_reproducibly(path: Path) -> None:
    """As a vLLM LLM's calls do: an unseeded sampled prompt generated again on the same
    engine gets new samples (best-of-N by calling again is not N copies); the first call of
    a fresh engine repeats the first call's, and a seed or a job's seed key keeps a prompt's
    samples across calls."""
    prompts = [random_prompts(1, 5, 5, 1000, seed=1)[0]] * 3
    params = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True)

    def draw(e: Engine, p=prompts, sp=params) -> list[tuple[int, ...]]:
        outs = sorted(e.generate(p, sp), key=lambda o: int(o.request_id))
        return [tuple(o.output_token_ids) for o in outs]

    one = engine(path)
    calls = [draw(one) for _ in range(3)]
    assert len({t for call in calls for t in call}) == 9, "every sample differs"
    fresh = engine(path)
    assert [draw(fresh) for _ in range(2)] == calls[:2], "reproducible per engine"
    seeded = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True, seed=7)
    assert draw(one, sp=seeded) == draw(one, sp=seeded)
    keyed = [Prompt(p, str(i), seed_key=f"row-{i}") for i, p in enumerate(prompts)]
    assert draw(one, p=keyed) == draw(one, p=keyed)


def test_logprobs_are_the_models_own(path: Path) -> None:
    prompt = random_prompts(1, 6, 6, 1000, seed=2)[0]
    params = SamplingParams(max_new_tokens=6, logprobs=3, ignore_eos=True)
    (out,) = engine(path).generate([prompt], params)
    ids = torch.tensor([prompt + out.output_token_ids])
    with torch.inference_mode():
        logits = hf_model(path)(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.output_token_ids[i]
        assert lp.logprob == pytest.approx(logits[i, lp.token_id].item(), abs=1e-4)
        top = logits[i].topk(3)
        assert lp.top_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        assert lp.top_ids[0] == lp.token_id  # greedy picks the most likely token


def test_min_new_tokens_bans_stop_tokens_until_reached(path: Path) -> None:
    prompt = random_prompts(1, 8, 8, 1000, seed=2)[0]
    free = hf_greedy(path, prompt, 12)
    stop = free[2]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), min_new_tokens=6)
    (out,) = engine(path).generate([prompt], params)
    assert stop not in out.output_token_ids[:6]
    assert len(out.output_token_ids) >= 6
    (early,) = engine(path).generate([prompt], params.replace(min_new_tokens=0))
    assert early.output_token_ids[-1] == stop and len(early.output_token_ids) == 3


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(
    path: Path, tmp_path: Path, keep: bool
) -> None:
    """As in vLLM: the token that ended the sample stays in the token ids; its text is in the
    text only with include_stop_str_in_output. Same in a job's rows."""
    eng = engine(path)
    prompt = "The weather today is"
    (free,) = eng.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))
    special = set(eng.tokenizer.all_special_ids)
    k = next(
        i
        for i, t in enumerate(free.output_token_ids)
        if i >= 3 and t not in special and eng.tokenizer.decode([t]).strip()
    )
    stop = free.output_token_ids[k]
    params = SamplingParams(
        max_new_tokens=30, stop_token_ids=(stop,), include_stop_str_in_output=keep
    )
    (out,) = eng.generate([prompt], params, decode=True)
    ids = out.output_token_ids
    assert ids[-1] == stop and out.finish_reason == "stop"
    want = eng.tokenizer.decode(ids if keep else ids[:-1], skip_special_tokens=True)
    assert out.text == want
    assert keep or not out.text.endswith(eng.tokenizer.decode([stop]))
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": prompt}])
    spec = spec_for(
        path,
        inp,
        tmp_path / "out",
        "sampling.max_new_tokens=30",
        f"sampling.stop_token_ids=[{stop}]",
        f"sampling.include_stop_str_in_output={str(keep).lower()}",
        "output.include_token_ids=true",
    )
    run_job(spec)
    (row,) = read_rows(tmp_path / "out")
    assert row["token_ids"] == ids and row["text"] == want


@pytest.mark.parametrize("keep", [False, True])
def test_stop_strings_span_tokens_and_cut_the_text(path: Path, keep: bool) -> None:
    eng = engine(path)
    prompt = "The weather today is"
    (free,) = eng.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))
    pieces = [eng.tokenizer.decode([t]) for t in free.output_token_ids]
    k = next(i for i in range(3, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    start = sum(len(p) for p in pieces[:k]) + len(pieces[k]) - 1
    stop = free.text[start : start + 2]  # the last char of token k, the first of token k+1
    params = SamplingParams(
        max_new_tokens=30, ignore_eos=True, stop=(stop,), include_stop_str_in_output=keep
    )
    (out,) = eng.generate([prompt], params)
    cut = free.text.find(stop)
    assert out.finish_reason == "stop"
    assert out.text == free.text[: cut + (len(stop) if keep else 0)]
    assert out.output_token_ids == free.output_token_ids[: len(out.output_token_ids)]
    assert len(out.output_token_ids) <= k + 2, "tokens past the stop string are not counted"


class _ThreadRecordingTokenizer:
    """The engine's tokenizer, noting which threads decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.threads = tokenizer, set()

    def decode(self, *args, **kwargs):
        self.threads.add(threading.current_thread().name)
        return self.tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_stop_strings_are_matched_off_the_engine_thread_as_if_after_every_token(
    path: Path,
) -> None:
    """Many samples (n > 1, preempted under a small cache, logprobs on) each stopped where a
    check after every token stops it, whenever the watcher's answer reaches the engine."""
    eng = engine(path, num_kv_blocks=12, block_size=8, max_num_seqs=6)
    prompts = [Prompt(p, str(i)) for i, p in enumerate(random_prompts(8, 3, 9, 1000, seed=5))]
    base = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=9, n=2)
    free = {(o.request_id, o.sample_index): o for o in eng.generate(prompts, base)}
    # each prompt's stop string: two characters from the middle of its first sample's text
    stops = {i: free[(str(i), 0)].text[10:12] for i in range(8)}
    tok = eng.tokenizer
    eng.tokenizer = eng.stops.tokenizer = _ThreadRecordingTokenizer(tok)
    asked = [
        p._replace(sampling={"stop": (stops[i],), "logprobs": 1, "min_new_tokens": 2 * (i % 3)})
        for i, p in enumerate(prompts)
    ]
    outs = list(eng.generate(asked, base, decode=False))
    assert len(outs) == 16 and eng.scheduler.num_preemptions > 0
    assert threading.current_thread().name not in eng.tokenizer.threads
    for out in outs:
        i = int(out.request_id)
        ids = free[(out.request_id, out.sample_index)].output_token_ids
        expected_text, n = None, len(ids)
        for j in range(1, len(ids) + 1):  # the check after every token
            expected_text = match_stop_strings(ids[:j], (stops[i],), False, 2 * (i % 3), tok)
            if expected_text is not None:
                n = j
                break
        assert out.output_token_ids == ids[:n]
        assert len(out.logprobs) == n
        assert out.text == expected_text
        assert out.finish_reason == ("length" if expected_text is None else "stop")
    assert any(o.finish_reason == "stop" for o in outs)
    eng.blocks.check_invariants()


def first_match(tokens: list[int], stop: tuple[str, ...], tok, prompt: list[int], **kw):
    """The check after every token: (tokens fed when it matched, the text) or None."""
    for n in range(1, len(tokens) + 1):
        text = match_stop_strings(
            tokens[:n], stop, kw.get("include", False), kw.get("min_tokens", 0), tok, prompt
        )
        if text is not None:
            return n, text
    return None


@pytest.mark.parametrize("gap", [1, 9, 40, 200])
def test_special_tokens_inside_a_stop_string_do_not_hide_it(
    path: Path, monkeypatch, gap: int
) -> None:
    """Special tokens add no text (they are skipped): any number of them between a stop
    string's characters leaves it a match, as in the text the row shows."""
    eng = engine(path)
    tok = eng.tokenizer
    prompt = tok("Hello there").input_ids
    a, b = (tok(c, add_special_tokens=False).input_ids for c in ("A", "B"))
    specials = [i for i in tok.all_special_ids if i not in eng.eos_token_ids]
    gaps = [specials[i % len(specials)] for i in range(gap)]
    tail = tok(" and more text", add_special_tokens=False).input_ids
    for stop in (("AB",), ("xyz", "A" + "B")):
        assert first_match(a + gaps + b + tail, stop, tok, prompt) == (len(a + gaps + b), "")
    longer = tok(" so AB", add_special_tokens=False).input_ids
    spread = [t for token in longer for t in (token, *gaps)]  # gaps after every token
    assert first_match(spread + tail, ("so A",), tok, prompt)[1] == " "
    script = a + gaps + b + tail
    script_outputs(monkeypatch, {len(prompt): script})
    params = SamplingParams(max_new_tokens=len(script), ignore_eos=True, stop=("AB",))
    (out,) = eng.generate([prompt], params)
    assert (out.finish_reason, out.text) == ("stop", "")
    assert out.output_token_ids == a + gaps + b


@pytest.mark.parametrize("include", [False, True])
def test_a_hidden_stop_tokens_text_completes_no_stop_string(
    path: Path, monkeypatch, include: bool
) -> None:
    """A stop token whose text is left out ends the output as a stop token: stop strings its
    text would complete (or hold whole) do not cut the text before it. Kept in the output
    (include_stop_str_in_output), its text is matched like any other."""
    eng = engine(path)
    tok = eng.tokenizer
    prompt = tok("Hello there").input_ids
    body = tok(" one two abc", add_special_tokens=False).input_ids
    more = tok(" more words", add_special_tokens=False).input_ids
    for word, stop in (("d", "cd"), (" the", "he"), (" the", " the"), (" the", "c the")):
        (ending,) = tok(word, add_special_tokens=False).input_ids
        script = [*body, ending, *more]
        script_outputs(monkeypatch, {len(prompt): script})
        params = SamplingParams(
            max_new_tokens=len(script),
            stop_token_ids=(ending,),
            stop=(stop,),
            include_stop_str_in_output=include,
        )
        (out,) = eng.generate([prompt], params)
        assert out.output_token_ids == [*body, ending], (word, stop)
        assert out.finish_reason == "stop"
        whole = output_text(tok, prompt, [*body, ending])
        want = whole[: whole.find(stop) + len(stop)] if include else " one two abc"
        assert out.text == want, (word, stop)


def test_a_stop_string_inside_the_min_new_tokens_is_not_a_match(path: Path) -> None:
    """A stop string completed by one of the first min_new_tokens tokens does not count: the
    text is cut only at a later match, and the text always agrees with the tokens returned."""
    prompts = [Prompt(p, str(i)) for i, p in enumerate(random_prompts(6, 3, 9, 1000, seed=7))]
    base = SamplingParams(max_new_tokens=16, ignore_eos=True)
    free = {o.request_id: o for o in engine(path).generate(prompts, base)}
    tok = engine(path).tokenizer
    asked, cases = [], {}
    for i, p in enumerate(prompts):
        ids = free[str(i)].output_token_ids
        stop = tok.decode(ids[:2], skip_special_tokens=True)[:2]  # completed within 2 tokens
        cases[str(i)] = (stop, ids)
        asked.append(p._replace(sampling={"stop": (stop,), "min_new_tokens": 6}))
    outs = list(engine(path).generate(asked, base))
    assert len(outs) == 6
    for out in outs:
        stop, ids = cases[out.request_id]
        full = tok.decode(ids, skip_special_tokens=True)
        floor = len(tok.decode(ids[:6], skip_special_tokens=True).rstrip("\ufffd"))
        assert out.output_token_ids == ids[: len(out.output_token_ids)]
        assert len(out.output_token_ids) >= 6
        later = full.find(stop, max(0, floor - len(stop) + 1))
        if later < 0:
            assert (out.finish_reason, out.text) == ("length", full)
        else:
            assert (out.finish_reason, out.text) == ("stop", full[:later])
            assert later + len(stop) > floor


def test_a_stop_string_must_end_after_the_min_new_tokens(path: Path, monkeypatch) -> None:
    """As in vLLM: with min_new_tokens=k a stop string counts only where it ends in text after
    the first k tokens' (the tokens eos is banned for), also where it begins inside them."""
    eng = engine(path)
    tok = eng.tokenizer
    prompt = tok("Hello there").input_ids
    words = [" one", " two", " three", " the", " cat", " was"]
    script = [t for w in words for t in tok(w, add_special_tokens=False).input_ids]
    assert len(script) == len(words)
    script_outputs(monkeypatch, {len(prompt): script})
    base = SamplingParams(max_new_tokens=len(script), ignore_eos=True)
    whole = "".join(words)
    for k in range(len(script) + 1):
        for stop in (" three", "ee t", "one two", " cat was"):
            ends = whole.find(stop) + len(stop)  # its end, in characters
            tokens_to_end = next(n for n in range(7) if len("".join(words[:n])) >= ends)
            (out,) = eng.generate([prompt], base.replace(stop=(stop,), min_new_tokens=k))
            if tokens_to_end > k:
                assert (out.finish_reason, out.text) == ("stop", whole[: whole.find(stop)])
                assert len(out.output_token_ids) == tokens_to_end, (k, stop)
            else:
                assert (out.finish_reason, out.text) == ("length", whole), (k, stop)
            expected = first_match(script, (stop,), tok, prompt, min_tokens=k)
            assert (expected or (0, whole))[1] == out.text


def test_bad_sampling_values_are_errors_naming_the_field(path: Path) -> None:
    items = [
        Prompt("hi", request_id="a", sampling={"top_p": 0.0}),
        Prompt("hi", request_id="b", sampling={"n": 0}),
        Prompt("hi", request_id="c", sampling={"min_new_tokens": 9, "max_new_tokens": 3}),
        Prompt("hi", request_id="d"),
        # beyond float32 on the device: inf / inf would be NaN, a wrong token
        Prompt("hi", request_id="e", sampling={"temperature": 1e39}),
        Prompt("hi", request_id="f", sampling={"repetition_penalty": 1e-50}),
        Prompt("hi", request_id="g", sampling={"repetition_penalty": 1e31}),
    ]
    outs = {o.request_id: o for o in engine(path).generate(items, SamplingParams(max_new_tokens=2))}
    assert "top_p=0.0 must be in (0, 1]" in outs["a"].error
    assert "temperature=1e+39 must be a number in [0, 1e+30]" in outs["e"].error
    assert "repetition_penalty=1e-50 must be a number in [1e-30, 1e+30]" in outs["f"].error
    assert "repetition_penalty=1e+31 must be" in outs["g"].error
    assert "n=0" in outs["b"].error
    assert "min_new_tokens=9 must be <= max_new_tokens=3" in outs["c"].error
    assert outs["d"].finish_reason in ("stop", "length")


def test_a_stop_token_id_outside_the_vocabulary_is_refused(path: Path, tmp_path: Path) -> None:
    """Its ban (min_new_tokens) would index past the logits: an error row, or one line before a
    job's first row; the other rows run."""
    eng = engine(path)
    vocab = eng.shape.vocab_size
    outside = {"stop_token_ids": (7, vocab), "min_new_tokens": 2}
    items = [Prompt("hi", request_id="bad", sampling=outside), Prompt("hi", request_id="ok")]
    outs = {o.request_id: o for o in eng.generate(items, SamplingParams(max_new_tokens=4))}
    assert outs["bad"].finish_reason == "error"
    assert f"stop_token_ids holds {vocab}, outside the model's vocabulary" in outs["bad"].error
    assert outs["ok"].finish_reason in ("stop", "length")
    rows = [{"prompt": "a", "s": json.dumps(outside)}, {"prompt": "b"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    sets = ("prompt.sampling_column='s'", "sampling.max_new_tokens=4", "output.format='jsonl'")
    assert run_job(spec_for(path, inp, tmp_path / "rows", *sets)).complete
    bad, ok = read_rows(tmp_path / "rows")
    assert bad["finish_reason"] == "error" and "outside the model's vocabulary" in bad["error"]
    assert ok["error"] is None
    job_wide = (f"sampling.stop_token_ids=[{vocab + 5}]", "sampling.min_new_tokens=1")
    with pytest.raises(BatchgenError, match=r"^\[sampling\] stop_token_ids holds"):
        run_job(spec_for(path, inp, tmp_path / "job", *job_wide))
    assert not (tmp_path / "job" / "results.jsonl").exists()


def test_logprob_tokens_in_rows_show_their_own_bytes(path: Path, tmp_path: Path) -> None:
    """A row's logprob tokens are each token's own text: a token holding part of a UTF-8
    character shows those bytes as \\xNN escapes (as in OpenAI Batch output), not U+FFFD."""
    from batchgen.token_bytes import TokenBytes

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hello"}, {"prompt": "日本語 😊"}])
    sets = ("sampling.max_new_tokens=6", "sampling.logprobs=20", "sampling.ignore_eos=true")
    run_job(spec_for(path, inp, tmp_path / "out", *sets))
    tokens = TokenBytes(engine(path).tokenizer)
    entries = [
        e
        for r in read_rows(tmp_path / "out")
        for lp in r["logprobs"]
        for e in (lp, *lp["top_logprobs"])
    ]
    assert all(e["token"] == tokens.text(e["token_id"]) for e in entries)
    partial = [e for e in entries if "\\x" in e["token"]]
    assert partial and not any("\ufffd" in e["token"] for e in entries)


def test_job_rows_for_samples_logprobs_and_bad_values(path: Path, tmp_path: Path) -> None:
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"prompt": "Hello", "params": {"n": 2, "temperature": 1.0, "logprobs": 1}},
            {"prompt": "Hi", "params": json.dumps({"top_p": 2.0})},
            {"prompt": "Bye", "params": None},
        ],
    )
    spec = spec_for(
        path,
        inp,
        tmp_path / "out",
        "prompt.sampling_column='params'",
        "sampling.max_new_tokens=4",
        "sampling.seed=5",
    )
    result = run_job(spec)
    rows = read_rows(tmp_path / "out")
    assert [(r["index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    assert all(len(r["logprobs"]) == r["num_generated_tokens"] for r in rows[:2])
    assert rows[0]["logprobs"][0]["top_logprobs"][0]["token_id"] >= 0
    assert "top_p=2.0" in rows[2]["error"]
    assert result.summary.rows_error == 1


def test_sampled_job_is_identical_after_an_interruption(path: Path, tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(40)])
    sets = (
        "sampling.max_new_tokens=12",
        "sampling.temperature=0.9",
        "sampling.top_p=0.9",
        "output.shard_rows=4",
        "runtime.max_num_seqs=4",
    )
    assert run_job(spec_for(path, inp, tmp_path / "ref", *sets)).complete
    stop = threading.Event()
    spec = spec_for(path, inp, tmp_path / "cut", *sets)
    engine_stop = Engine(path, EngineConfig(device="cpu", max_num_seqs=4))
    original = engine_stop.generate

    def generate_then_stop(*args, **kwargs):
        for i, out in enumerate(original(*args, **kwargs)):
            if i == 10:
                stop.set()
            yield out

    engine_stop.generate = generate_then_stop
    first = run_job(spec, engine=engine_stop, stop=stop)
    assert first.interrupted and not first.complete
    assert run_job(spec).complete
    ref = {r["id"]: r["text"] for r in read_rows(tmp_path / "ref")}
    got = {r["id"]: r["text"] for r in read_rows(tmp_path / "cut")}
    assert got == ref


def test_samples_share_the_prompt_kv_blocks(path: Path) -> None:
    """4 samples of a 64-token prompt run at once in 20 blocks of 8 only if the prompt is
    shared (4 separate copies would need 36 blocks); greedy samples all match HF generate."""
    prompt = random_prompts(1, 64, 64, 1000, seed=8)[0]
    small = engine(path, block_size=8, num_kv_blocks=20, max_num_seqs=4)
    small.add_request(prompt, SamplingParams(max_new_tokens=8, n=4, ignore_eos=True), "p")
    outs, most_running = [], 0
    while small.has_unfinished():
        outs += small.step()
        most_running = max(most_running, len(small.scheduler.running))
        small.blocks.check_invariants()
    assert most_running == 4 and small.scheduler.num_preemptions == 0
    assert small.blocks.num_free_blocks == 20
    expected = hf_greedy(path, prompt, 8)
    assert [o.output_token_ids for o in outs] == [expected] * 4
