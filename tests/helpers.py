"""Test helpers: Hugging Face greedy references and random prompts."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from batchgen.engine.graphs import StepGraphs


@functools.cache
def hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32
    ).eval()


def hf_greedy(
    path: Path, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    """Hugging Face generate, greedy; stops only at eos_token_id (None: runs to the limit)."""
    model = hf_model(path)
    kwargs: dict = {"eos_token_id": eos_token_id}
    if eos_token_id is None:
        kwargs["min_new_tokens"] = max_new_tokens
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


NEAR_TIE = 1e-3  # fp32 logits this close are ordered by rounding: kernels may break either way


def assert_greedy_or_near_tie(model: Any, prompt: list[int], got: list[int], context: Any) -> None:
    """`got` (greedy tokens) against the model's own generate on its device, as many tokens:
    equal, or diverging only where the model's top two logits are a rounding apart."""
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([prompt], device=model.device), max_new_tokens=len(got),
            min_new_tokens=len(got), do_sample=False, eos_token_id=None, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    expected = ref.sequences[0, len(prompt) :].tolist()
    if got != expected:
        j = next(k for k, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        top = ref.scores[j][0].float().topk(2).values
        assert float(top[0] - top[1]) < NEAR_TIE, (context, j, float(top[0] - top[1]))


def random_prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def stop_after(engine: Any, outputs: int) -> Any:
    """The engine's next generate sets the job's stop event after `outputs` results."""
    original = engine.generate

    def generate(*args: Any, stop: Any = None, **kwargs: Any) -> Iterator[Any]:
        for count, out in enumerate(original(*args, stop=stop, **kwargs), start=1):
            yield out
            if count == outputs:
                stop.set()
        engine.generate = original

    engine.generate = generate
    return engine


def script_outputs(monkeypatch: Any, scripts: dict[int, list[int]]) -> None:
    """The engine's sampler picks, for a sample whose prompt has P tokens, scripts[P][i] as
    its i-th output token (its logits forced to that token before any ban or filter). A later
    call in the same test replaces the scripts."""
    from batchgen.engine.sampler import Sampler

    original = Sampler.__call__
    if hasattr(original, "scripts"):
        original.scripts.clear()
        original.scripts.update(scripts)
        return

    def call(self: Any, logits: torch.Tensor, s: Any, *args: Any, **kwargs: Any) -> Any:
        logits = logits.clone()
        for row, position in enumerate(s.positions.tolist()[: logits.shape[0]]):
            for prompt_len, script in call.scripts.items():
                if 0 <= position - prompt_len < len(script):
                    logits[row] = -1e9
                    logits[row, script[position - prompt_len]] = 0.0
        return original(self, logits, s, *args, **kwargs)

    call.scripts = dict(scripts)  # type: ignore[attr-defined]
    monkeypatch.setattr(Sampler, "__call__", call)


class EagerPadding(StepGraphs):
    """Stands in for StepGraphs on the CPU: pads steps as the graphs would (decode sizes, and
    token sizes for steps with prefill chunks when tokens are given), runs them eagerly."""

    def __init__(self, runner, sizes: tuple[int, ...], tokens: tuple[int, ...] = ()) -> None:
        self.sizes, self.tokens = sorted(sizes), sorted(tokens)
        self.max_seqs = runner.config.max_num_seqs
        self.first_use = False  # every size pads to its own shape (a test may borrow)
        self.runner = runner
        self.replays: list[tuple[int, int, int]] = []  # the padded (T, B, S) of each step

    def replay(self, flat, host):
        self.replays.append(tuple(host.layout[:3]))
        return self.runner.forward(flat, host)


SPM_VOCAB = 768  # sentencepiece_model's tokenizer: 5 special tokens, 256 bytes, 507 pieces


def sentencepiece_model(folder: Path, base: Path) -> Path:
    """The tiny model at `base` (built with vocab_size=SPM_VOCAB) with a tokenizer built as
    Llama 2's and Mistral's are: ▁ for a space, byte fallback, and a decoder that strips the
    leading space of a text. Trained on the same corpus; its special tokens have the same
    ids."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from batchgen.models.tiny import CHAT_TEMPLATE, CORPUS_PATH, SPECIAL_TOKENS

    if (folder / "tokenizer.json").is_file():
        return folder
    shutil.copytree(base, folder)
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=SPM_VOCAB,
        special_tokens=SPECIAL_TOKENS.ordered() + byte_tokens,
        initial_alphabet=["▁"],
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS_PATH.read_text(encoding="utf-8")], trainer=trainer)
    tok = _bytes_as_pieces(tok, set(byte_tokens))
    bos = SPECIAL_TOKENS.bos
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS.bos,
        eos_token=SPECIAL_TOKENS.eos,
        pad_token=SPECIAL_TOKENS.pad,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    fast.save_pretrained(folder)
    return folder


def _bytes_as_pieces(tok: Any, byte_tokens: set[str]) -> Any:
    """The trained tokenizer with its byte tokens as ordinary pieces of its vocabulary (ids
    kept), as in Llama 2's and Mistral's: decoding them keeps their text, however special
    tokens are skipped. The trainer took them as special tokens only to give them ids."""
    from tokenizers import Tokenizer

    body = json.loads(tok.to_str())
    body["added_tokens"] = [t for t in body["added_tokens"] if t["content"] not in byte_tokens]
    return Tokenizer.from_str(json.dumps(body))


Outputs = dict[tuple[str, int], list[int]]  # (request id, sample index) -> generated ids


def run_checked(engine: Any, prompts: list[list[int]], params: Any) -> Outputs:
    """Step an engine to the end; after every step its block bookkeeping holds and no
    waiting request holds a block; at the end every block is free again."""
    for i, prompt in enumerate(prompts):
        assert engine.add_request(prompt, params, default_id=str(i)) is None
    outs: Outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out
            outs[(out.request_id, out.sample_index)] = out.output_token_ids
        engine.blocks.check_invariants()
        assert all(not r.block_table for r in engine.scheduler.waiting), "a waiting one holds"
    engine.blocks.check_released()
    assert engine.blocks.num_free_blocks == engine.num_blocks
    return outs


class LoopbackHandler(BaseHTTPRequestHandler):
    """A quiet HTTP/1.1 handler for the tests' loopback servers: HEAD and GET go to the
    subclass's `_answer(head)`, which answers through `_send`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> Any:
        raise NotImplementedError

    def _send(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits: [S, V] with the tokens the sampler's bitmask (token_bitmask_allowed) forbids
    at -inf, as the sampler masks them."""
    from batchgen.engine.sampler import token_bitmask_allowed

    return logits.masked_fill(~token_bitmask_allowed(mask, logits.shape[-1]), float("-inf"))


def refused_under_graphs(engine: Any, run: Any, match: str) -> None:
    """run(engine) is refused (BatchgenError matching `match`) with the engine as on a GPU
    with CUDA graphs captured, which would not see the change; the engine is as it was after."""
    import pytest

    from batchgen import BatchgenError

    engine.runner.graphs = object()
    try:
        with pytest.raises(BatchgenError, match=match):
            run(engine)
    finally:
        engine.runner.graphs = None
