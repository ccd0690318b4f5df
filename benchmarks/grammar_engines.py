"""xgrammar against llguidance on this machine's CPU: tokenizer setup, schema compile time,
per-token mask time along a valid document, and the batched mask fill of 64 matchers.

    pip install xgrammar   # not one of batchgen's requirements: only this comparison uses it
    PYTHONPATH=$PWD python benchmarks/grammar_engines.py

Tokenizers: the tests' 1k byte-level BPE and the benchmarks' 32k one (batchgen.bench.job_path).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr

from batchgen.bench.job_path import bench_tokenizer
from batchgen.engine.grammar import EXAMPLE_SCHEMA, EXAMPLE_VALUE
from batchgen.models.tiny import build_tokenizer

BATCH = 64
# a raw control character inside a maxLength string: invalid JSON that a grammar must refuse
# (each engine's compact separators: xgrammar writes ": ", llguidance ":")
BAD_DOC = {"xgrammar": '{"title": "\x1f', "llguidance": '{"title":"\x1f'}


def _timed(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def bench_xgrammar(tokenizer, doc: list[int]) -> dict[str, float]:
    vocab = len(tokenizer)
    out = {}
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id]
    )
    out["setup_ms"] = (time.perf_counter() - start) * 1e3
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    schema = json.dumps(EXAMPLE_SCHEMA)
    out["compile_ms"] = _timed(lambda: compiler.compile_json_schema(schema)) * 1e3
    compiled = compiler.compile_json_schema(schema)
    mask = xgr.allocate_token_bitmask(BATCH, vocab)
    matcher = xgr.GrammarMatcher(compiled)
    times = []
    for token in doc:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(token), token
    out["token_ms"] = statistics.mean(times) * 1e3
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    for i, m in enumerate(matchers):  # spread over the document's positions
        for token in doc[: i * len(doc) // BATCH]:
            m.accept_token(token)
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    out["batch_fill_ms"] = _timed(lambda: batch.batch_fill_next_token_bitmask(matchers, mask), 5)
    out["batch_fill_ms"] *= 1e3
    bad = tokenizer(BAD_DOC["xgrammar"], add_special_tokens=False).input_ids
    fresh = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
    out["refuses_bad"] = not all(fresh.accept_token(t) for t in bad)
    return out


def bench_llguidance(tokenizer, doc: list[int]) -> dict[str, float]:
    vocab = len(tokenizer)
    out = {}
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    out["setup_ms"] = (time.perf_counter() - start) * 1e3
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(EXAMPLE_SCHEMA))
    out["compile_ms"] = _timed(lambda: llguidance.LLMatcher(lltok, grammar)) * 1e3
    mask = llguidance.torch.allocate_token_bitmask(BATCH, vocab)
    matcher = llguidance.LLMatcher(lltok, grammar)
    times = []
    for token in doc:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(token), (token, matcher.get_error())
    out["token_ms"] = statistics.mean(times) * 1e3
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    for i, m in enumerate(matchers):
        m.consume_tokens(doc[: i * len(doc) // BATCH])
    executor = llguidance.LLExecutor(num_threads=2)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    fill = lambda: llguidance.torch.fill_next_token_bitmask_par(executor, pairs, mask)  # noqa: E731
    out["batch_fill_ms"] = _timed(fill, 5) * 1e3
    bad = tokenizer(BAD_DOC["llguidance"], add_special_tokens=False).input_ids
    compact = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(EXAMPLE_SCHEMA), {"whitespace_flexible": False}
    )
    fresh = llguidance.LLMatcher(lltok, compact, log_level=0)
    out["refuses_bad"] = not fresh.consume_tokens(bad) or fresh.is_error()
    return out


def main() -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = {
            "1k (tests)": build_tokenizer(Path(tmp) / "tok"),
            "32k (bench)": bench_tokenizer(Path(tmp)),
        }
        rows = []
        for name, tok in tokenizers.items():
            doc = tok(json.dumps(EXAMPLE_VALUE), add_special_tokens=False).input_ids
            for engine, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
                rows.append((name, engine, len(doc), fn(tok, doc)))
    print(
        f"| tokenizer | engine | doc tokens | setup ms | compile ms | mask/token ms | "
        f"fill {BATCH} ms | refuses a raw control char in a maxLength string |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, engine, n, r in rows:
        print(
            f"| {name} | {engine} | {n} | {r['setup_ms']:.0f} | {r['compile_ms']:.1f} | "
            f"{r['token_ms']:.3f} | {r['batch_fill_ms']:.2f} | {r['refuses_bad']} |"
        )


if __name__ == "__main__":
    main()
