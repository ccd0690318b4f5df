"""Tiny Hugging Face models built locally from a seed: test fixtures and the embedded default.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on `batchgen/assets/corpus.txt`;
the weights come from `torch.manual_seed(seed)`. The same arguments always give byte-identical
files, and every model folder is published with one atomic rename, so a folder that exists is
complete and concurrent builders of the same folder are safe.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.qwen2.tokenization_qwen2 import (
    PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX,
)

from batchgen.errors import BatchgenError
from batchgen.home import models_dir

CORPUS_PATH = Path(__file__).resolve().parent.parent / "assets" / "corpus.txt"


@dataclass(frozen=True)
class SpecialTokens:
    bos: str = "<|begin_of_text|>"
    eos: str = "<|end_of_text|>"
    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"
    pad: str = "<|pad|>"

    def ordered(self) -> list[str]:
        """Special tokens in id order: bos=0, eos=1, im_start=2, im_end=3, pad=4."""
        return [self.bos, self.eos, self.im_start, self.im_end, self.pad]


SPECIAL_TOKENS = SpecialTokens()

# ChatML: "<bos>" then "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then
# "<|im_start|>assistant\n" when add_generation_prompt. A system message is just the first
# message with role "system". The bos is in the template because apply_chat_template
# tokenizes with add_special_tokens=False; encode(render) would add a second bos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    """Transformer shape; head_dim defaults to hidden_size // num_attention_heads."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512


TINY_SHAPE = TinyShape()
TOKENIZER_VOCAB_SIZE = 1024
ROPE_THETA = 10000.0
# Larger than HF's 0.02 so logits are far from uniform: clear argmax margins for greedy parity.
INITIALIZER_RANGE = 0.2

DEFAULT_MODEL_NAME = "batchgen-tiny-llama"
DEFAULT_MODEL_VERSION = "v1"
DEFAULT_MODEL_ARCH = "llama"
DEFAULT_MODEL_SEED = 0
DEFAULT_MODEL_SHAPE = TinyShape(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=2048,
)

ARCHS: dict[str, tuple[type[PreTrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
# Every layer uses full causal attention: no sliding window in any arch.
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"use_sliding_window": False, "sliding_window": None},
    "qwen3": {"use_sliding_window": False, "sliding_window": None},
    "mistral": {"sliding_window": None},
}
# A model folder is complete when all of these exist (it is published by one rename).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    return train_tokenizer(vocab_size, [CORPUS_PATH.read_text(encoding="utf-8")])


def train_tokenizer(vocab_size: int, texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on texts, with batchgen's special tokens and chat template."""
    # Byte-level: the 256-byte alphabet is always in the vocab, so any UTF-8 text round-trips.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS.ordered(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS.bos
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos}:1 $B:1",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS.bos,
        eos_token=SPECIAL_TOKENS.eos,
        pad_token=SPECIAL_TOKENS.pad,
        unk_token=None,  # saved as null: else Qwen2Tokenizer adds "<|endoftext|>" as a 1025th token
        extra_special_tokens=[SPECIAL_TOKENS.im_start, SPECIAL_TOKENS.im_end],
        chat_template=CHAT_TEMPLATE,
    )


def build_tokenizer(
    out_dir: Path, vocab_size: int = TOKENIZER_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the embedded corpus and `save_pretrained` it to out_dir.

    Encoding a prompt prepends bos; the chat template is ChatML. Deterministic: the same
    vocab_size always writes a byte-identical tokenizer.json.
    """
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _match_qwen2_tokenizer(tokenizer: PreTrainedTokenizerFast) -> None:
    """AutoTokenizer always loads model_type "qwen2" as Qwen2Tokenizer, which rebuilds the
    normalizer (NFC) and pre-tokenizer (Qwen2 regex split, then byte-level). Write the same
    pipeline into tokenizer.json so the raw file and AutoTokenizer give identical ids. Vocab
    and merges are unchanged; decode(encode(text)) == NFC(text) for this arch."""
    backend = tokenizer.backend_tokenizer
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _make_config(
    arch: str, tokenizer: PreTrainedTokenizerFast, overrides: dict[str, Any]
) -> PreTrainedConfig:
    fields: dict[str, Any] = {
        **asdict(TINY_SHAPE),
        "vocab_size": len(tokenizer),
        "tie_word_embeddings": False,
        "rope_theta": ROPE_THETA,
        "initializer_range": INITIALIZER_RANGE,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **_ARCH_CONFIG[arch],
        **overrides,
    }
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    config_cls, _ = ARCHS[arch]
    return config_cls(**fields)


def _write_model(folder: Path, arch: str, seed: int, overrides: dict[str, Any]) -> None:
    tokenizer = _train_tokenizer(TOKENIZER_VOCAB_SIZE)
    if arch == "qwen2":
        _match_qwen2_tokenizer(tokenizer)
    config = _make_config(arch, tokenizer, overrides)
    _, model_cls = ARCHS[arch]
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(folder)


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in MODEL_FILES)


def _publish(staging: Path, out_dir: Path) -> Path:
    try:
        # rename(2) is atomic and replaces only a missing or empty directory.
        os.rename(staging, out_dir)
    except OSError as err:
        if _is_complete(out_dir):  # another process won the race: use its folder
            return out_dir
        raise FileExistsError(
            f"{out_dir} exists but is not a complete model folder; remove it and retry"
        ) from err
    return out_dir


def build_tiny_model(
    out_dir: Path, arch: str = "llama", seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a complete HF model folder (config, safetensors, tokenizer, generation config).

    arch is one of ARCHS; weights are float32 from torch.manual_seed(seed); config_overrides
    replace any config field (shape defaults: TINY_SHAPE). If out_dir is already complete it
    is returned untouched. Loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained.
    """
    out_dir = Path(out_dir)
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {sorted(ARCHS)}")
    if _is_complete(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _write_model(staging, arch, seed, config_overrides)
        return _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def default_model_folder() -> Path:
    """Where the embedded default model is (or will be) built; nothing is built here."""
    return models_dir() / f"{DEFAULT_MODEL_NAME}-{DEFAULT_MODEL_VERSION}"


def default_model_path() -> Path:
    """The embedded default model folder, built deterministically on first call."""
    folder = default_model_folder()
    try:
        return build_tiny_model(
            folder, DEFAULT_MODEL_ARCH, DEFAULT_MODEL_SEED, **asdict(DEFAULT_MODEL_SHAPE)
        )
    except OSError as exc:  # $BATCHGEN_HOME is a file, read-only, full...
        reason = exc.strerror or type(exc).__name__
        raise BatchgenError(
            f"cannot build the embedded default model in '{folder}' ({reason}): set "
            "BATCHGEN_HOME to a writable folder"
        ) from exc
