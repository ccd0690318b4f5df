"""Tiny random-weight models of many Hugging Face decoder families, built offline from their
config classes (transformers ships every one): the inputs of the model-family parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 256
# shared small shape; each family's config takes the keys it knows
BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
MOE = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2}
MOE |= {"moe_intermediate_size": 32}
DROP = object()  # a BASE key this family's config must not be given
TWO_KINDS = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
# model_type -> config keys beyond BASE (None: BASE is not used, the dict is complete)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 16},
    "mistral-full": {"model_type": "mistral", "sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {**MOE, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {**MOE, "sliding_window": None},
    "gemma": {},
    "gemma3_text": {**TWO_KINDS, "query_pre_attn_scalar": 16},
    "phi3": {"original_max_position_embeddings": 512},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
    "gpt_neox": {"rotary_pct": 0.5},
    "olmo2": {},
    "granite": {},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "starcoder2": {"sliding_window": 16},
    "gpt_oss": {**MOE, **TWO_KINDS},
    "gemma2": {**TWO_KINDS, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0},
    "llama4_text": {
        "attention_chunk_size": 8, "interleave_moe_layer_step": 1, "intermediate_size_mlp": 128,
        "no_rope_layers": [1, 0], "num_local_experts": 2, "num_experts_per_tok": 1,
    },
    "cohere": {},
    "cohere2": {**TWO_KINDS},
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512, "rotary_dim": 8},
    "deepseek_v3": {
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "head_dim": 8, "first_k_dense_replace": 1, "n_group": 1,
        "topk_group": 1, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_key_value_heads": 4,
    },
    "stablelm": {"partial_rotary_factor": 0.5},
    "gemma3n_text": {  # one MLP width per layer
        **TWO_KINDS, "intermediate_size": [128, 96], "activation_sparsity_pattern": [0.0, 0.0],
        "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
        "laurel_rank": 8, "altup_num_inputs": 2, "num_kv_shared_layers": 0,
    },
    "mpt": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 512, "expansion_ratio": 2},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2, "head_dim": DROP},
    "gpt_neo": {"num_layers": 2, "num_heads": 4, "attention_types": [[["global", "local"], 1]]},
    "bloom": {"n_layer": 2, "n_head": 4},
    "jamba": {
        **MOE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
        "expert_layer_offset": 1, "mamba_d_state": 4, "mamba_dt_rank": 4,
        "use_mamba_kernels": False,
    },
    "lfm2": {"layer_types": ["conv", "full_attention"], "block_dim": 64, "block_ff_dim": 128},
    "qwen3_next": {
        **MOE, "layer_types": ["linear_attention", "full_attention"],
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "shared_expert_intermediate_size": 64,
    },
    "mamba": {"state_size": 4, "time_step_rank": 4, "use_mambapy": True},
}  # fmt: skip


def tiny_config(family: str) -> Any:
    extra = dict(FAMILIES[family])
    model_type = extra.pop("model_type", family)
    kwargs = {k: v for k, v in {**BASE, **extra}.items() if v is not DROP}
    return AutoConfig.for_model(model_type, **kwargs)


def build_family_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Save a float32 random-weight model of `family` (no tokenizer: prompts are token ids)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir
