"""An engine over a caller's model whose forward changes with no parameter changed: adapters
switched, disabled, merged or rescaled (peft's LoRA layers, or any layer with their
attributes), or a non-persistent buffer (the rotary inv_freq) changed in place. The next call
drops the prompt blocks cached before and equals a fresh engine on the model as it is now, and
the fingerprint (a checkpoint's identity) changes with it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen import BatchgenError, Engine, EngineConfig, Generator, SamplingParams
from tests.helpers import random_prompts, refused_under_graphs

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = random_prompts(3, 40, 40, 1000, seed=2)  # 5 blocks of 8: 4 cached per prompt


class LoraLinear(nn.Module):
    """A LoRA layer with the attributes of peft's tuner layers (active_adapters,
    disable_adapters, merged_adapters, scaling), switched the way peft switches them."""

    def __init__(self, base: nn.Linear, names: tuple[str, ...], rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict(
            {n: nn.Linear(base.in_features, rank, bias=False) for n in names}
        )
        self.lora_B = nn.ModuleDict(
            {n: nn.Linear(rank, base.out_features, bias=False) for n in names}
        )
        for n in names:
            nn.init.normal_(self.lora_B[n].weight, std=0.5)
        self.scaling = dict.fromkeys(names, 1.0)
        self._active_adapter = names[0]
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.in_features, self.out_features = base.in_features, base.out_features

    @property
    def active_adapters(self) -> list[str]:
        return [self._active_adapter]

    @property
    def disable_adapters(self) -> bool:
        return self._disable_adapters

    def enable_adapters(self, enabled: bool) -> None:
        self._disable_adapters = not enabled

    def set_adapter(self, name: str) -> None:
        self._active_adapter = name

    def merge(self) -> None:  # as peft's unsafe merge: through .data, no version bumped
        name = self._active_adapter
        delta = self.lora_B[name].weight @ self.lora_A[name].weight * self.scaling[name]
        self.base_layer.weight.data += delta.detach()
        self.merged_adapters.append(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self._disable_adapters or self.merged_adapters:
            return out
        for name in self.active_adapters:
            out = out + self.lora_B[name](self.lora_A[name](x)) * self.scaling[name]
        return out


def _config() -> EngineConfig:
    return EngineConfig(device="cpu", block_size=8)


def _tokens(engine: Engine) -> list[list[int]]:
    outs = {o.request_id: o for o in engine.generate(PROMPTS, PARAMS, decode=False)}
    return [outs[str(i)].output_token_ids for i in range(len(PROMPTS))]


def _fresh(model: nn.Module) -> list[list[int]]:
    with Engine(model, _config()) as engine:
        return _tokens(engine)


def _with_adapters(path) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(3)
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(layer.self_attn, name, LoraLinear(getattr(layer.self_attn, name), ("a", "b")))
    return model


def _adapters(model: nn.Module) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def _disable(model: nn.Module) -> None:
    for layer in _adapters(model):
        layer.enable_adapters(False)


def _switch(model: nn.Module) -> None:
    for layer in _adapters(model):
        layer.set_adapter("b")


def _rescale(model: nn.Module) -> None:
    for layer in _adapters(model):
        layer.scaling["a"] = 3.0


def _merge(model: nn.Module) -> None:
    for layer in _adapters(model):
        layer.merge()


def _rotary(model: nn.Module) -> None:  # a RoPE theta change made in place
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.25)


CHANGES = [_disable, _switch, _rescale, _rotary]
IDS = ["disable", "switch", "rescale", "rotary-buffer"]


@pytest.mark.parametrize("change", CHANGES, ids=IDS)
def test_a_changed_forward_drops_the_cached_prefixes(model_dir, change: Callable) -> None:
    model = _with_adapters(model_dir("llama"))
    with Engine(model, _config()) as engine:
        before = _tokens(engine)
        fingerprint = engine.fingerprint
        change(model)
        stats = engine.cache_stats
        after = _tokens(engine)
        assert (engine.cache_stats - stats).cached_tokens == 0
        assert engine.fingerprint != fingerprint
    truth = _fresh(model)
    assert truth != before, "the change was meant to change the outputs"
    assert after == truth


def test_merging_adapters_through_data_drops_the_cached_prefixes(model_dir) -> None:
    """A merge writes the base weights through `.data` (no version bumped): the merged state
    says the weights changed."""
    model = _with_adapters(model_dir("llama"))
    with Engine(model, _config()) as engine:
        _tokens(engine)
        fingerprint = engine.fingerprint
        _merge(model)
        stats = engine.cache_stats
        after = _tokens(engine)
        assert (engine.cache_stats - stats).cached_tokens == 0
        assert engine.fingerprint != fingerprint
    assert after == _fresh(model)


def test_unchanged_adapters_keep_the_cache_and_fingerprint(model_dir) -> None:
    model = _with_adapters(model_dir("llama"))
    with Engine(model, _config()) as engine:
        first = _tokens(engine)
        fingerprint = engine.fingerprint
        stats = engine.cache_stats
        assert _tokens(engine) == first
        assert (engine.cache_stats - stats).cached_tokens == 4 * 8 * len(PROMPTS)
        assert engine.fingerprint == fingerprint


def test_a_checkpoint_of_another_adapter_is_not_resumed(model_dir, tmp_path) -> None:
    """A Generator's checkpoint_dir written with adapter "a" is refused under adapter "b"."""
    datasets = pytest.importorskip("datasets")
    path = model_dir("llama")
    model = _with_adapters(path)
    ds = datasets.Dataset.from_dict({"prompt": ["The cat sat on", "Once upon a time"]})
    sampling = {"max_new_tokens": 6}
    with Generator(model, _config(), tokenizer=AutoTokenizer.from_pretrained(path)) as gen:
        gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "ck", progress=False)
        _switch(model)
        with pytest.raises(BatchgenError, match="the model changed"):
            gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "ck", progress=False)


def test_adapter_changes_are_refused_where_graphs_replay_the_old_ones(model_dir) -> None:
    """CUDA graphs replay the adapter layers as they ran at capture: a switch is refused
    there, before any step; without graphs it runs on the switched adapter."""
    model = _with_adapters(model_dir("llama"))
    with Engine(model, _config()) as engine:
        _tokens(engine)
        _switch(model)
        refused_under_graphs(engine, _tokens, "adapters were switched")
        assert _tokens(engine) == _fresh(model)


def test_peft_lora_adapters(model_dir) -> None:
    """The same with peft's own LoRA layers, where peft is installed."""
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import LoraLayer

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.inject_adapter_in_model(config, model, adapter_name="a")
    with Engine(model, _config()) as engine:
        before = _tokens(engine)
        fingerprint = engine.fingerprint
        for layer in model.modules():
            if isinstance(layer, LoraLayer):
                layer.enable_adapters(False)
        after = _tokens(engine)
        assert engine.fingerprint != fingerprint
    truth = _fresh(model)
    assert truth != before and after == truth
