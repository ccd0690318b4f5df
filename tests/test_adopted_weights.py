"""An engine over a caller's loaded model (a training loop's): weights changed in place between
calls drop the prompt blocks cached with the old ones, so the next call equals a fresh engine
on the updated model; reset_prefix_cache() drops them on request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen import BatchgenError, Engine, EngineConfig, Generator, SamplingParams
from tests.helpers import random_prompts, refused_under_graphs

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = random_prompts(3, 40, 40, 1000, seed=1)  # 5 blocks of 8: 4 cached per prompt


def _config() -> EngineConfig:
    return EngineConfig(device="cpu", block_size=8)


def _tokens(engine: Engine) -> list[list[int]]:
    outs = {o.request_id: o for o in engine.generate(PROMPTS, PARAMS, decode=False)}
    return [outs[str(i)].output_token_ids for i in range(len(PROMPTS))]


def _fresh(model: torch.nn.Module) -> list[list[int]]:
    with Engine(model, _config()) as engine:
        return _tokens(engine)


def _train_step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(-1.5)
            layer.self_attn.v_proj.weight.mul_(0.3)


def _load_other(model: torch.nn.Module) -> None:
    torch.manual_seed(1)
    other = {k: torch.randn_like(v) * 0.1 for k, v in model.state_dict().items()}
    model.load_state_dict(other)


def _replace_data(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        weight = layer.self_attn.k_proj.weight
        weight.data = -weight.data.clone()


@pytest.mark.parametrize(
    "update", [_train_step, _load_other, _replace_data], ids=["in-place", "state-dict", "data"]
)
def test_changed_weights_drop_the_cached_prefixes(model_dir, update: Callable) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()
    with Engine(model, _config()) as engine:
        _tokens(engine)
        again = engine.cache_stats
        _tokens(engine)  # unchanged weights: the cache serves the second call
        assert (engine.cache_stats - again).cached_tokens == 4 * 8 * len(PROMPTS)
        update(model)
        before = engine.cache_stats
        updated = _tokens(engine)
        assert (engine.cache_stats - before).cached_tokens == 0
    assert updated == _fresh(model)


def test_reset_prefix_cache(model_dir: Callable[..., Path]) -> None:
    """A change no version counter sees (through .data) needs reset_prefix_cache()."""
    path = model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with Generator(model, _config(), tokenizer=AutoTokenizer.from_pretrained(path)) as gen:
        _tokens(gen.engine)
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.data.mul_(-1.5)
        gen.reset_prefix_cache()
        before = gen.engine.cache_stats
        updated = _tokens(gen.engine)
        assert (gen.engine.cache_stats - before).cached_tokens == 0
    assert updated == _fresh(model)


def _swap_activation(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.Tanh()


def _norm_eps(model: torch.nn.Module) -> None:
    for layer in model.model.layers:
        layer.input_layernorm.variance_epsilon = 10.0


@pytest.mark.parametrize("update", [_swap_activation, _norm_eps], ids=["activation", "eps"])
def test_changed_modules_drop_the_cached_prefixes(model_dir, update: Callable) -> None:
    """A change that touches no tensor (an activation swapped, a norm's eps set) is seen as
    a weight change is: the cached prompt blocks are dropped, the next call equals a fresh
    engine on the changed model; where graphs or fused layers run the old modules, it is
    refused."""
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()
    with Engine(model, _config()) as engine:
        _tokens(engine)
        update(model)
        refused_under_graphs(engine, _tokens, "modules were replaced or their settings")
        before = engine.cache_stats
        updated = _tokens(engine)
        assert (engine.cache_stats - before).cached_tokens == 0
    assert updated == _fresh(model)


def test_the_generation_config_is_read_at_each_call(model_dir) -> None:
    """As Hugging Face's generate reads model.generation_config at each call, so does an
    engine over a caller's model: an end-of-sequence id or a max_new_tokens set after the
    engine started applies to the next call."""
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()
    with Engine(model, _config()) as engine:
        (first,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6), decode=False)
        stop_at = first.output_token_ids[2]
        model.generation_config.eos_token_id = [stop_at]
        (ended,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6), decode=False)
        assert (
            ended.output_token_ids
            == first.output_token_ids[: first.output_token_ids.index(stop_at) + 1]
        )
        assert ended.finish_reason == "stop" and str(stop_at) in engine.fingerprint["eos_token_ids"]
        model.generation_config.max_new_tokens = 2
        model.generation_config.eos_token_id = None
        (short,) = engine.generate([PROMPTS[0]], decode=False)
        want = model.generate(torch.tensor([PROMPTS[0]]), do_sample=False)[0, len(PROMPTS[0]) :]
    assert short.output_token_ids == want.tolist() and len(want) <= 2


def test_a_resized_vocabulary_is_refused_in_one_line(model_dir) -> None:
    """resize_token_embeddings after the engine started: the engine's sampling is sized for
    the old vocabulary, so the next call is refused, naming the remedy."""
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()
    with Engine(model, _config()) as engine:
        _tokens(engine)
        model.resize_token_embeddings(model.config.vocab_size + 32, mean_resizing=False)
        with pytest.raises(BatchgenError, match=r"vocabulary was resized .*create a new engine"):
            _tokens(engine)


def test_replaced_weights_are_refused_where_graphs_hold_the_old_ones(model_dir) -> None:
    """CUDA graphs (and fused layers' merged weights) read the tensors they were made with:
    a model whose tensors were replaced is refused there, before any step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()
    with Engine(model, _config()) as engine:
        _tokens(engine)
        _replace_data(model)
        refused_under_graphs(engine, _tokens, "replaced by new tensors")
        assert _tokens(engine) == _fresh(model)  # without graphs: runs on the new tensors


def test_a_checkpoint_of_the_old_weights_is_not_resumed_after_a_change(
    model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """A Generator's checkpoint_dir holds rows of the weights they were made with: after a
    training step, a change through .data told by reset_prefix_cache(), or a module swapped,
    the same directory is refused as another model's, not handed back."""
    datasets = pytest.importorskip("datasets")
    path = model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ds = datasets.Dataset.from_dict({"prompt": ["The cat sat on", "Once upon a time"]})
    sampling = {"max_new_tokens": 6}
    with Generator(model, _config(), tokenizer=tokenizer) as gen:
        gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "ck", progress=False)
        _train_step(model)
        with pytest.raises(BatchgenError, match="the model changed"):
            gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "ck", progress=False)
        gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "data", progress=False)
        for layer in model.model.layers:  # unseen by version counters, told by the caller
            layer.self_attn.k_proj.weight.data.mul_(-1.5)
        gen.reset_prefix_cache()
        with pytest.raises(BatchgenError, match=r"the model changed \(weights_checksum differ"):
            gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "data", progress=False)
        gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "act", progress=False)
        _swap_activation(model)
        with pytest.raises(BatchgenError, match=r"the model changed \(modules differ"):
            gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "act", progress=False)
        fresh = gen.generate(ds, sampling=sampling, checkpoint_dir=tmp_path / "new", progress=False)
    assert len(fresh["text"]) == 2


def _modes(model: torch.nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


def test_a_model_in_train_mode_runs_as_in_eval_mode(model_dir) -> None:
    """Dropout never applies in the engine's forward passes nor in its start-up check: a model
    in train mode (whole or in part, before the engine or after) gives the tokens it gives in
    eval mode, and keeps its modes."""
    from tests.families import tiny_config

    config = tiny_config("gpt2")
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompts = random_prompts(3, 6, 12, config.vocab_size, seed=2)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def tokens(engine: Engine) -> list[list[int]]:
        outs = {o.request_id: o for o in engine.generate(prompts, params, decode=False)}
        return [outs[str(i)].output_token_ids for i in range(len(prompts))]

    with Engine(model, EngineConfig(device="cpu")) as engine:
        expected = tokens(engine)
        model.train()  # after the engine started
        assert tokens(engine) == expected
        assert all(_modes(model))
        model.eval()
        model.transformer.h[1].train()  # a part of it only
        modes = _modes(model)
        assert tokens(engine) == expected
        assert _modes(model) == modes
    model.train()  # before the engine: its check passes, its tokens are eval mode's
    with Engine(model, EngineConfig(device="cpu")) as engine:
        assert all(_modes(model))
        assert tokens(engine) == expected
    assert all(_modes(model))


def test_a_model_with_attention_dropout_in_train_mode_is_accepted(model_dir) -> None:
    path = model_dir("llama", attention_dropout=0.5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with Engine(model, EngineConfig(device="cpu"), tokenizer=tokenizer) as engine:
        trained = [o.output_token_ids for o in engine.generate("Hello there", PARAMS)]
    with Engine(model.eval(), EngineConfig(device="cpu"), tokenizer=tokenizer) as engine:
        assert [o.output_token_ids for o in engine.generate("Hello there", PARAMS)] == trained
