"""A token's own bytes, as OpenAI-style logprobs give them: concatenated they are the text's
bytes, also where a token holds part of a UTF-8 character (its decoded text alone is U+FFFD)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchgen.token_bytes import TokenBytes

TEXT = "Héllo wörld: 日本語のテキスト, emoji 😊🚀 and ascii."


def test_byte_level_tokens_give_their_bytes(model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    tokens = TokenBytes(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert b"".join(tokens(i) for i in ids) == TEXT.encode()
    partial = [i for i in ids if tokenizer.decode([i]) == "\ufffd"]
    assert partial, "the text has tokens that hold part of a character"
    for i in partial:
        assert tokens(i) != "\ufffd".encode()
        assert tokens.text(i) == tokens(i).decode("utf-8", "backslashreplace")
        assert "\\x" in tokens.text(i)
    whole = [i for i in ids if i not in partial]
    assert all(tokens.text(i) == tokenizer.decode([i]) for i in whole)


def test_special_tokens_show_as_their_own_strings(model_dir) -> None:
    """As vLLM shows them: each special token its own string, never all the same empty one."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    tokens = TokenBytes(tokenizer)
    special = tokenizer.all_special_ids
    assert len(special) > 1
    texts = [tokens.text(i) for i in special]
    assert texts == tokenizer.convert_ids_to_tokens(special) and len(set(texts)) == len(texts)
    assert all(tokens(i) == t.encode() for i, t in zip(special, texts, strict=True))
    assert tokens.text(tokenizer.eos_token_id) == tokenizer.eos_token


def sentencepiece_style(tmp_path: Path) -> PreTrainedTokenizerFast:
    """A Llama 2 / Mistral style tokenizer: ▁ for spaces, <0xNN> byte-fallback tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = []
    for word in ("▁Hé", "llo", "▁wö", "rld", "▁and", "▁ascii"):  # merged left to right
        for char in word:
            vocab.setdefault(char, len(vocab))
        for end in range(2, len(word) + 1):
            merges.append((word[: end - 1], word[end - 1]))
            vocab.setdefault(word[:end], len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def test_byte_fallback_tokens_give_their_bytes(tmp_path: Path) -> None:
    tokenizer = sentencepiece_style(tmp_path)
    tokens = TokenBytes(tokenizer)
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == TEXT
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert "<0xE6>" in pieces and "▁and" in pieces and "▁Hé" in pieces
    assert b"".join(tokens(i) for i in ids) == b" " + TEXT.encode()  # the ▁ the text began with
    assert tokens(tokenizer.convert_tokens_to_ids("<0xE6>")) == b"\xe6"
    assert tokens.text(tokenizer.convert_tokens_to_ids("▁and")) == " and"
