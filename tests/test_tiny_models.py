"""Tiny local models: tokenizer behaviour, determinism, loading through HF Auto classes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from batchgen.models import (
    ARCHS,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_SHAPE,
    DEFAULT_MODEL_VERSION,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    batchgen_home,
    build_tiny_model,
    build_tokenizer,
    default_model_path,
    tiny,
)

TEXTS = [
    "",
    "hello world",
    "The weather today: 7°C, wind NW 45 km/h.\n\nTomorrow -- showers?",
    "  leading spaces,\ttabs\r\nand CRLF\n",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇳🇿",
    "日本語のテキスト, Ελληνικά, русский, العربية",
    "café vs cafe\u0301 (decomposed)",
    'def f(x):\n    return {"a": [1, 2.5e-3]}  # ok',
    "literal <|im_start|> inside text",
    "\x00\x7f\u200b zero-width and control bytes",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there!"},
]
PROMPTS = ["The weather today is", "def fibonacci(n):", "Q: Why is the sky blue?\nA:"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Tiny matmuls gain nothing from threads, and OpenMP spin-waits are 30x slower on a busy CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHS}


def test_special_token_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer) == TOKENIZER_VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS.ordered()) == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        SPECIAL_TOKENS.bos,
        SPECIAL_TOKENS.eos,
        SPECIAL_TOKENS.pad,
    )
    assert tokenizer.unk_token is None


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_bos(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text).input_ids
    # ids: [bos, *text_ids]; exactly one bos, no eos appended
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids[1:]) == text
    assert tokenizer(text, add_special_tokens=False).input_ids == ids[1:]


def test_special_tokens_in_text_are_single_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS.im_start)
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS.im_end) in ids


def test_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|>"
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(MESSAGES[1:], tokenize=False)
    assert no_prompt == "<|begin_of_text|><|im_start|>user\nHi there!<|im_end|>\n"
    # Tokenized template: exactly one bos (the template's), same ids as the rendered text.
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert ids == tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.bos_token_id) == 1


def test_build_tokenizer_is_deterministic(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.slow
def test_build_tokenizer_is_deterministic_across_processes(tmp_path: Path) -> None:
    here = tmp_path / "here"
    build_tokenizer(here)
    code = "import sys; from pathlib import Path; from batchgen.models import build_tokenizer; "
    code += "build_tokenizer(Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True)
    assert _sha256(here / "tokenizer.json") == _sha256(tmp_path / "there" / "tokenizer.json")


def test_build_tiny_model_is_deterministic(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", "llama", seed=0)
    b = build_tiny_model(tmp_path / "b", "llama", seed=0)
    c = build_tiny_model(tmp_path / "c", "llama", seed=1)
    for name in tiny.MODEL_FILES:
        assert _sha256(a / name) == _sha256(b / name), name
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no staging left


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", "llama", seed=0)
    assert torch.equal(torch.rand(4), expected)


def _greedy_reference(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    # Full recompute each step, no KV cache: ids [1, seq_len]
    for _ in range(steps):
        with torch.no_grad():
            next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0].tolist()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_arch_loads_and_generates(arch_dirs: dict[str, Path], arch: str) -> None:
    folder = arch_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    config = model.config
    assert config.model_type == arch
    assert config.vocab_size == len(tok) == TOKENIZER_VOCAB_SIZE
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert not config.tie_word_embeddings
    assert getattr(config, "sliding_window", None) is None
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == tok.eos_token_id
    steps = 4
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        assert out[0].tolist() == _greedy_reference(model, enc.input_ids, steps)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_raw_tokenizer_json_matches_auto_tokenizer(arch_dirs: dict[str, Path], arch: str) -> None:
    folder = arch_dirs[arch]
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == raw.get_vocab_size() == TOKENIZER_VOCAB_SIZE
    for text in TEXTS:
        ids = tok(text).input_ids
        assert raw.encode(text).ids == ids
        # qwen2 loads as Qwen2Tokenizer, whose pipeline NFC-normalizes its input.
        expected = unicodedata.normalize("NFC", text) if arch == "qwen2" else text
        assert tok.decode(ids[1:]) == expected


def test_config_overrides(tmp_path: Path) -> None:
    folder = build_tiny_model(
        tmp_path / "m", "qwen3", hidden_size=32, num_hidden_layers=1, rope_theta=500.0
    )
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (32, 1, 8)
    assert config["rope_parameters"]["rope_theta"] == 500.0


def test_complete_folder_is_returned_untouched(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "m", "llama", seed=0)
    before = _sha256(folder / "model.safetensors")
    assert build_tiny_model(folder, "llama", seed=7) == folder
    assert _sha256(folder / "model.safetensors") == before


def test_empty_folder_is_filled_and_partial_folder_rejected(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert tiny._is_complete(build_tiny_model(tmp_path / "empty", "llama"))
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a complete model folder"):
        build_tiny_model(tmp_path / "partial", "llama")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "partial"]


def test_losing_a_build_race_uses_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "m"
    winner = build_tiny_model(tmp_path / "winner", "llama", seed=5)
    real_write = tiny._write_model

    def write_then_lose(folder: Path, *args: object) -> None:
        real_write(folder, *args)
        winner.rename(out)  # another process publishes first

    monkeypatch.setattr(tiny, "_write_model", write_then_lose)
    winner_hash = _sha256(winner / "model.safetensors")
    assert build_tiny_model(out, "llama", seed=0) == out
    assert _sha256(out / "model.safetensors") == winner_hash
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # loser's staging removed


def test_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch='gpt2' is not supported"):
        build_tiny_model(tmp_path / "m", "gpt2")


def test_default_model_path_honours_batchgen_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path / "home"))
    folder = default_model_path()
    expected = tmp_path / "home" / "models" / f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}"
    assert folder == expected
    assert tiny._is_complete(folder)
    before = _sha256(folder / "model.safetensors")
    assert default_model_path() == folder
    assert _sha256(folder / "model.safetensors") == before
    config = AutoModelForCausalLM.from_pretrained(folder).config
    assert config.model_type == "llama"
    assert config.hidden_size == DEFAULT_MODEL_SHAPE.hidden_size == 128
    assert (config.num_hidden_layers, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 2048


def test_batchgen_home_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHGEN_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert batchgen_home() == tmp_path / ".cache" / "batchgen"
    monkeypatch.setenv("BATCHGEN_HOME", "")
    assert batchgen_home() == tmp_path / ".cache" / "batchgen"
