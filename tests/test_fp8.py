"""FP8 weights and activations: the quantize/dequantize round trip, the FP8 linear layer,
quantizing a model, merged projections, the engine in FP8 (CPU emulation; GPU: _scaled_mm and
graphs), and loading pre-quantized checkpoints."""

from __future__ import annotations

import importlib
import json
import math
import re
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from batchgen.engine import Engine, EngineConfig, SamplingParams
from batchgen.engine.fusion import _merged
from batchgen.engine.model_loader import load_model
from batchgen.engine.quant import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    dequantize_weight,
    quantize_model,
    quantize_rows,
    quantize_weight,
)
from batchgen.errors import BatchgenError

HALF_ULP = 2**-4  # E4M3 has 3 mantissa bits: rounding moves a normal value by <= |x| / 16
SUBNORMAL_STEP = 2**-9  # smallest E4M3 step, in units of the scale


def _within_fp8_error(x: torch.Tensor, back: torch.Tensor, scale: torch.Tensor) -> bool:
    """|back - x| <= |x| / 16 (normal values) or half the subnormal step (tiny ones)."""
    bound = torch.maximum(x.abs() * HALF_ULP, scale * SUBNORMAL_STEP / 2) * (1 + 1e-6)
    return bool(((back - x).abs() <= bound).all())


def test_weight_round_trip_within_fp8_error() -> None:
    w = torch.randn(48, 64) * torch.logspace(-3, 2, 48)[:, None]  # rows of any range
    w[5, 9] = 1e4  # an outlier sets only its own row's scale
    w[7] = 0.0
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (48,) and scale.dtype == torch.float32
    back = dequantize_weight(q, scale, torch.float32)
    assert _within_fp8_error(w, back, scale[:, None])
    torch.testing.assert_close(back.abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)  # 448
    assert (back[7] == 0).all()
    rows, s = quantize_rows(w.bfloat16())  # activations: the same per row, from 16-bit
    assert _within_fp8_error(w.bfloat16().float(), rows.float() * s[:, None], s[:, None])


def test_fp8_linear_is_the_fp8_product() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True)
    x = torch.randn(3, 5, 64)
    layer = Fp8Linear.from_linear(linear)
    out = layer(x)
    xq, xs = quantize_rows(x.reshape(-1, 64))
    weight = dequantize_weight(layer.weight, layer.weight_scale, torch.float32)
    exact = (xq.float() * xs[:, None]) @ weight.t() + linear.bias
    torch.testing.assert_close(out.reshape(-1, 32), exact, rtol=1e-5, atol=1e-5)
    ref = linear(x)
    assert ((out - ref).norm() / ref.norm()) < 0.08  # two FP8 roundings of ~3% each
    assert layer(torch.empty(0, 64)).shape == (0, 32)


def test_quantize_model_keeps_lm_head_and_norms(model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert quantize_model(model) == linears - 1  # every Linear but the lm_head
    assert type(model.lm_head) is nn.Linear and model.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_quantization_that_quantizes_nothing_is_refused_and_a_part_announced(tmp_path):
    """quantization='fp8' on a model with no nn.Linear to quantize (GPT-2's Conv1D) is
    refused in one line; where weight matrices stay 16-bit (Qwen3-MoE's experts, 3-D
    parameters), a warning line says how many."""
    from tests.families import build_family_model

    cpu = torch.device("cpu")
    gpt2 = build_family_model("gpt2", tmp_path / "gpt2")
    with pytest.warns(UserWarning, match="emulation"), pytest.raises(BatchgenError) as err:
        load_model(gpt2, cpu, torch.float32, quantization="fp8")
    assert "no nn.Linear layers batchgen can quantize" in str(err.value)
    assert "without quantization" in str(err.value) and "\n" not in str(err.value)
    moe = build_family_model("qwen3_moe", tmp_path / "moe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(moe, cpu, torch.float32, quantization="fp8")
    experts = [p.numel() for n, p in model.named_parameters() if ".experts." in n]
    left = [str(w.message) for w in caught if "leaves" in str(w.message)]
    assert len(left) == 1 and "\n" not in left[0], left
    assert re.search(r"leaves ([\d,]+) weights \((\d+)%", left[0])
    count = int(re.search(r"leaves ([\d,]+)", left[0]).group(1).replace(",", ""))
    assert count >= sum(experts) > 0 and "experts" in left[0]
    with warnings.catch_warnings(record=True) as caught:  # every matrix quantized: no warning
        warnings.simplefilter("always")
        load_model(build_family_model("llama", tmp_path / "llama"), cpu, torch.float32, "fp8")
    assert not [w for w in caught if "leaves" in str(w.message)]


def test_merged_projections_compose_with_fp8() -> None:
    torch.manual_seed(0)
    parent = nn.Module()
    names = ("q_proj", "k_proj", "v_proj")
    for name, rows in zip(names, (64, 32, 32), strict=True):
        setattr(parent, name, Fp8Linear.from_linear(nn.Linear(64, rows, bias=True)))
    x = torch.randn(4, 64)
    separate = torch.cat([getattr(parent, n)(x) for n in names], dim=-1)
    merged = _merged(parent, names)
    assert torch.equal(merged(x), separate)  # per-token scales come from the shared input
    base = parent.q_proj.weight.untyped_storage().data_ptr()
    for n in names:  # the children keep views of the merged weight and scales
        child = getattr(parent, n)
        assert child.weight.untyped_storage().data_ptr() == base
        assert child.weight_scale.untyped_storage().data_ptr() == (
            parent.q_proj.weight_scale.untyped_storage().data_ptr()
        )
    assert torch.equal(torch.cat([getattr(parent, n)(x) for n in names], dim=-1), separate)


def test_fp8_linear_takes_the_rows_attached_to_its_input() -> None:
    """A kernel that wrote x may attach x's FP8 rows: the linear multiplies those (not a new
    quantization of x); rows of another shape are ignored, and so are they while the model
    check runs 16-bit activations."""
    from batchgen.engine.quant.fp8 import (
        attach_fp8_rows,
        emulated_fp8_linear,
        quantize_rows_reference,
        unquantized_activations,
    )

    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(64, 32, bias=False))
    x, other = torch.randn(1, 4, 64), torch.randn(4, 64)
    own = layer(x)
    attach_fp8_rows(x, *quantize_rows_reference(other))
    assert torch.equal(layer(x)[0], emulated_fp8_linear(other, layer.weight, layer.weight_scale))
    assert not torch.equal(layer(x), own)
    with unquantized_activations():
        assert not torch.equal(layer(x)[0], layer(other)[0])
    y = torch.randn(1, 4, 64)
    attach_fp8_rows(y, *quantize_rows_reference(torch.randn(3, 64)))
    assert torch.equal(layer(y)[0], emulated_fp8_linear(y[0], layer.weight, layer.weight_scale))


def test_norms_feeding_fp8_projections_write_their_rows(model_dir) -> None:
    """In an FP8 model the fused norms before the merged q/k/v and gate/up projections write
    FP8 rows; the final norm (before the 16-bit lm_head) does not, and a 16-bit model's norms
    never do."""
    pytest.importorskip("triton")
    from transformers import AutoModelForCausalLM

    from batchgen.engine.fusion import Fusion

    path = model_dir("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    for fp8 in (True, False):
        model = AutoModelForCausalLM.from_pretrained(path)
        if fp8:
            quantize_model(model)
        fusion = Fusion(model)
        fusion.on()
        layers = model.model.layers
        feeding = {id(n) for n in fusion._norms_feeding_fp8()}
        norms = [(layer.input_layernorm, layer.post_attention_layernorm) for layer in layers]
        expected = {id(x) for pair in norms for x in pair}
        assert feeding == (expected if fp8 else set())
        assert id(model.model.norm) not in feeding
        fusion.off()


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outs = {o.request_id: o for o in engine.generate(prompts, params, decode=False)}
    return [outs[str(i)].output_token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_engine_fp8_on_cpu_warns_and_matches_its_own_model(model_dir, kv: str) -> None:
    """The engine's probe compares against the model's own forward pass with the same FP8
    layers (and FP8-rounded keys and values): it passes, and greedy tokens equal the quantized
    model's own greedy decoding."""
    from batchgen.engine.attention import attention_scope
    from batchgen.engine.probe import fp8_kv_reference

    path = model_dir("llama")
    config = EngineConfig(device="cpu", quantization="fp8", kv_cache_dtype=kv, num_kv_blocks=32)
    with pytest.warns(UserWarning, match="emulation"):
        engine = Engine(path, config)
    prompts = [[5, 9, 30, 7], [11, 12, 13, 14, 15, 16, 17]]
    got = _greedy(engine, prompts)
    model = engine.model
    name = "eager" if kv == "auto" else fp8_kv_reference()
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = list(prompt)
        with attention_scope(model, name), torch.inference_mode():
            for _ in tokens:
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert ids[len(prompt) :] == tokens
    assert engine.runner.kv_cache.keys[0].dtype == (FP8_DTYPE if kv == "fp8" else torch.float32)
    engine.close()


def test_fp8_kv_cache_scales_keys_beyond_its_range(model_dir) -> None:
    """Keys beyond +-448 would be stored saturated in an FP8 cache at scale 1: the start-up
    check measures each layer's keys and values on its probe and stores that layer's keys
    divided by the power of two that brings them within half the range; the others keep 1. The model
    then passes the check (its own forward pass over keys rounded the same way) and runs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(5000.0)
    config = EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=32)
    with Engine(model, config) as engine:
        scales = engine.runner.kv_cache.scales.tolist()
        assert scales[1][0] > 1.0, "layer 1's keys are scaled"
        assert all(s == [1.0, 1.0] for i, s in enumerate(scales) if i != 1)
        assert scales[1][1] == 1.0
        prompt = list(range(3, 40))
        (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert out.error is None and len(out.output_token_ids) == 6
        stored = engine.runner.kv_cache.keys[1].float().abs().max().item()
        assert FP8_MAX / 16 < stored < FP8_MAX, "layer 1's keys stored within range"
        assert scales[1][0] == 2 ** round(math.log2(scales[1][0])), "a power of two"
    unchecked = EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=32,
                             check_model=False)  # fmt: skip
    with Engine(model, unchecked) as engine:  # no check: no calibration, scale 1
        assert engine.runner.kv_cache.scales.eq(1.0).all()


def test_fp8_kv_cache_refuses_keys_beyond_its_calibrated_range(model_dir, monkeypatch) -> None:
    """Where the probe's keys reach beyond the cache's range at the scales it set (here, a
    headroom below 1 sets a range under the keys' peak), the check refuses the model in one
    line; the same model runs with a 16-bit cache."""
    from transformers import AutoModelForCausalLM

    from batchgen.engine import probe

    monkeypatch.setattr(probe, "KV_HEADROOM", 0.25)
    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"))
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(5000.0)
    config = EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=32)
    with pytest.raises(BatchgenError) as refused:
        Engine(model, config)
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(r"keys reach [\d.e+]+ \(layer 1\), beyond the FP8 cache's range", message)
    assert "kv_cache_dtype='auto'" in message
    with Engine(model, EngineConfig(device="cpu", num_kv_blocks=32)) as engine:
        assert engine.kv_dtype == torch.float32


def test_fp8_probe_refuses_a_wrong_attention(model_dir, monkeypatch) -> None:
    """Under FP8 the probe (activations unquantized) still sees attention that is wrong: here
    its softmax scale doubled."""
    from batchgen.engine.attention import hf_adapter

    real = hf_adapter.layer_spec

    def doubled(*args, **kwargs):
        spec = real(*args, **kwargs)
        return spec.__class__(**{**vars(spec), "scale": 2 * spec.scale})

    monkeypatch.setattr(hf_adapter, "layer_spec", doubled)
    config = EngineConfig(device="cpu", quantization="fp8", num_kv_blocks=32)
    with (
        pytest.warns(UserWarning, match="emulation"),
        pytest.raises(BatchgenError, match="differ from its own forward pass"),
    ):
        Engine(model_dir("llama"), config)


def test_fp8_probe_refuses_a_wrong_quantized_product(model_dir, monkeypatch) -> None:
    """The quantized product (on a GPU: the Triton kernel and _scaled_mm) is checked against
    its emulation: a per-token scale off by 2x is refused."""
    from batchgen.engine.quant import fp8

    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda x: (real(x)[0], 2 * real(x)[1]))
    config = EngineConfig(device="cpu", quantization="fp8", num_kv_blocks=32)
    with (
        pytest.warns(UserWarning, match="emulation"),
        pytest.raises(BatchgenError, match=r"FP8 \d+->\d+ product \(layer\) is off by"),
    ):
        Engine(model_dir("llama"), config)


def test_fp8_kv_doubles_the_blocks_of_a_budget(model_dir) -> None:
    path = model_dir("llama")
    blocks = []
    for kv in ("auto", "fp8"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = EngineConfig(device="cpu", dtype="bfloat16", kv_cache_dtype=kv,
                                  cpu_kv_cache_gib=0.01, check_model=False)  # fmt: skip
            with Engine(path, config) as engine:
                blocks.append(engine.num_blocks)
    assert blocks[1] == 2 * blocks[0]


def test_fp8_kv_block_size_follows_the_device(model_dir, monkeypatch) -> None:
    """Unset, the block size is the decode tile (64) for an FP8 cache on a GPU with TMA and
    16 elsewhere; a size that is set is kept."""
    from batchgen.engine.model_loader import kv_block_size

    pd = importlib.import_module("batchgen.engine.kernels.paged_decode")  # not the function
    fp8, bf16, cuda = torch.float8_e4m3fn, torch.bfloat16, torch.device("cuda")
    monkeypatch.setattr(pd, "has_tma", lambda device: device.type == "cuda")
    assert kv_block_size(EngineConfig(), fp8, cuda) == 64
    assert kv_block_size(EngineConfig(), bf16, cuda) == 16
    assert kv_block_size(EngineConfig(), fp8, torch.device("cpu")) == 16
    assert kv_block_size(EngineConfig(block_size=16), fp8, cuda) == 16
    monkeypatch.setattr(pd, "has_tma", lambda device: False)  # an FP8 GPU before Hopper
    assert kv_block_size(EngineConfig(), fp8, cuda) == 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=32,
                              check_model=False)  # fmt: skip
        with Engine(model_dir("llama"), config) as engine:
            assert engine.config.block_size == 16 and engine.blocks.block_size == 16


def test_bad_settings_refused(model_dir) -> None:
    with pytest.raises(ValueError, match="quantization='int4' is not allowed"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32)
    with pytest.raises(BatchgenError, match="not quantized"):
        Engine(model, EngineConfig(device="cpu", quantization="fp8"))


# ------------------------------------------------------------------------ pre-quantized folders


def _save_prequantized(src, dst, fmt: str) -> dict[str, torch.Tensor]:
    """A pre-quantized copy of the 16-bit folder src in format fmt; -> the 16-bit weights."""
    from safetensors.torch import load_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = {}
    for f in src.glob("*.safetensors"):
        state.update(load_file(f))
    out, originals = {}, {}
    for key, tensor in state.items():
        layer = key.removesuffix(".weight")
        if key.endswith(".weight") and tensor.dim() == 2 and "layers." in key:
            originals[layer] = tensor.float()
            out.update(_quantized_tensors(layer, tensor.float(), fmt))
        else:
            out[key] = tensor
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _quant_config(fmt)
    (dst / "config.json").write_text(json.dumps(config))
    return originals


def _quantized_tensors(layer: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "ct-channel":
        q, s = quantize_weight(w)
        return {f"{layer}.weight": q, f"{layer}.weight_scale": s[:, None]}
    if fmt == "ct-tensor":
        s = (w.abs().max() / FP8_MAX).reshape(1)
        return {f"{layer}.weight": (w / s).to(FP8_DTYPE), f"{layer}.weight_scale": s}
    # transformers FP8: 32x32 blocks here (the tiny model's layers are 64 wide)
    n, k = w.shape
    blocks = w.reshape(n // 32, 32, k // 32, 32).abs().amax((1, 3)) / FP8_MAX
    full = blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)
    return {f"{layer}.weight": (w / full).to(FP8_DTYPE), f"{layer}.weight_scale_inv": blocks}


def _quant_config(fmt: str) -> dict:
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
        }
    strategy = "channel" if fmt == "ct-channel" else "tensor"
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


@pytest.mark.parametrize("fmt", ["ct-channel", "ct-tensor", "fp8-block"])
def test_prequantized_folder_loads_the_quantized_weights(model_dir, tmp_path, fmt: str) -> None:
    """ct-channel: bit for bit what quantizing the 16-bit weights gives. ct-tensor: the stored
    FP8 values, the one scale per channel. fp8-block: block scales converted per channel, so
    within two FP8 roundings of the 16-bit weights."""
    src = model_dir("llama")
    originals = _save_prequantized(src, tmp_path / fmt, fmt)
    with pytest.warns(UserWarning, match="emulation"):
        model = load_model(tmp_path / fmt, torch.device("cpu"), torch.float32)
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert set(fp8) == set(originals) and type(model.lm_head) is nn.Linear
    for name, layer in fp8.items():
        w = originals[name]
        back = dequantize_weight(layer.weight, layer.weight_scale, torch.float32)
        if fmt == "ct-channel":
            q, s = quantize_weight(w)
            assert layer.weight.view(torch.uint8).equal(q.view(torch.uint8))
            assert torch.equal(layer.weight_scale, s)
        elif fmt == "ct-tensor":
            assert (layer.weight_scale == layer.weight_scale[0]).all()
            assert _within_fp8_error(w, back, layer.weight_scale[:, None])
        else:
            twice = torch.maximum(w.abs() * 2 * HALF_ULP * 1.1, layer.weight_scale[:, None] * 2**-9)
            assert ((back - w).abs() <= twice).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(tmp_path / fmt, EngineConfig(device="cpu", num_kv_blocks=32))
    assert len(_greedy(engine, [[5, 6, 7]])[0]) == 6  # the model check passed
    engine.close()


def test_unsupported_quantization_refused_in_one_line(model_dir, tmp_path) -> None:
    src = model_dir("llama")
    dst = tmp_path / "int4"
    _save_prequantized(src, dst, "ct-channel")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(BatchgenError, match="quantized as 'awq'") as err:
        load_model(dst, torch.device("cpu"), torch.float32)
    assert "\n" not in str(err.value)


def _drop_tensor(folder, name: str) -> None:
    from safetensors.torch import load_file

    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        if tensors.pop(name, None) is not None:
            save_file(tensors, file)


def _add_tensors(folder, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    file = folder / "model.safetensors"
    save_file({**load_file(file), **tensors}, file)


def _copy_folder(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", ["lm_head.weight", "model.norm.weight"])
def test_a_folder_missing_weights_is_refused(model_dir, tmp_path, name: str) -> None:
    """A weight the folder lacks would be left random by from_pretrained: refused in one line
    for an FP8 folder and a 16-bit one (read by from_pretrained or from weights read ahead);
    a tied lm_head is not missing."""
    from batchgen.engine.preload import Preload

    fp8 = tmp_path / "fp8"
    _save_prequantized(model_dir("llama"), fp8, "ct-channel")
    plain = _copy_folder(model_dir("llama"), tmp_path / "plain")
    for folder in (fp8, plain):
        _drop_tensor(folder, name)
    cpu = torch.device("cpu")
    for folder, preload in ((fp8, None), (plain, None), (plain, Preload(str(plain), cpu))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(BatchgenError, match="lacks 1 tensor") as err:
                load_model(folder, cpu, torch.float32, preload=preload)
        assert name in str(err.value) and "\n" not in str(err.value)
    tied = model_dir("llama", tie_word_embeddings=True)
    model = load_model(tied, cpu, torch.float32, preload=Preload(str(tied), cpu))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    load_model(tied, cpu, torch.float32)


def test_a_16_bit_folder_with_leftover_tensors_loads(model_dir, tmp_path) -> None:
    """Buffers an older transformers saved (GPT-2's masked_bias, say), which the model no
    longer takes, are ignored, as transformers ignores them; only an FP8 folder's are refused."""
    from batchgen.engine.preload import Preload

    cpu = torch.device("cpu")
    plain = _copy_folder(model_dir("llama"), tmp_path / "plain")
    _add_tensors(plain, {"model.layers.0.self_attn.masked_bias": torch.tensor(-1e4)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_model(plain, cpu, torch.float32)
        load_model(plain, cpu, torch.float32, preload=Preload(str(plain), cpu))


def test_an_fp8_folder_with_tensors_the_model_does_not_take_is_refused(model_dir, tmp_path):
    """Static activation and KV scales are not used (activations are scaled per token);
    any other tensor the model does not take is refused."""
    fp8 = tmp_path / "fp8"
    _save_prequantized(model_dir("llama"), fp8, "ct-channel")
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(2.0)}
    scales["model.layers.0.self_attn.q_proj.input_scale"] = torch.tensor([0.5])
    _add_tensors(fp8, scales)
    with pytest.warns(UserWarning, match="emulation"):
        load_model(fp8, torch.device("cpu"), torch.float32)
    _add_tensors(fp8, {"model.layers.0.mlp.up_proj.weight_zero_point": torch.zeros(128, 1)})
    with pytest.warns(UserWarning, match="emulation"), pytest.raises(BatchgenError) as err:
        load_model(fp8, torch.device("cpu"), torch.float32)
    assert "does not take ('model.layers.0.mlp.up_proj.weight_zero_point')" in str(err.value)


def test_quantized_weights_without_a_quantization_config_are_refused(model_dir, tmp_path):
    """FP8 (or integer) weights in a folder whose config.json describes no quantization would
    be cast to 16 bits without their scales: refused from the safetensors headers before
    loading, as is a ModelOpt folder (hf_quant_config.json) whatever it stores."""
    cpu = torch.device("cpu")
    bare = tmp_path / "bare"
    _save_prequantized(model_dir("llama"), bare, "ct-channel")
    config = json.loads((bare / "config.json").read_text())
    del config["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(BatchgenError, match=r"as F8_E4M3 but its config\.json has no quant"):
        load_model(bare, cpu, torch.float32)
    ints = _copy_folder(model_dir("llama"), tmp_path / "ints")
    _add_tensors(
        ints, {"model.layers.0.mlp.up_proj.weight": torch.zeros(256, 128, dtype=torch.int8)}
    )
    with pytest.raises(BatchgenError, match=r"up_proj\.weight' as I8 but"):
        load_model(ints, cpu, torch.float32)
    modelopt = _copy_folder(model_dir("llama"), tmp_path / "modelopt")
    (modelopt / "hf_quant_config.json").write_text(json.dumps({"quantization": {}}))
    with pytest.raises(BatchgenError, match=r"hf_quant_config\.json .*Model Optimizer") as err:
        load_model(modelopt, cpu, torch.float32)
    assert "\n" not in str(err.value)


def test_an_fp8_weight_not_in_e4m3_is_refused(model_dir, tmp_path) -> None:
    from safetensors.torch import load_file

    folder = tmp_path / "e5m2"
    _save_prequantized(model_dir("llama"), folder, "ct-channel")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)
    save_file(tensors, folder / "model.safetensors")
    with pytest.warns(UserWarning, match="emulation"), pytest.raises(BatchgenError) as err:
        load_model(folder, torch.device("cpu"), torch.float32)
    assert f"stores '{name}' as F8_E5M2" in str(err.value)


def _ct_folder_with(model_dir, folder, change) -> None:
    """A compressed-tensors FP8 folder whose quantization_config `change` edits in place."""
    _save_prequantized(model_dir("llama"), folder, "ct-channel")
    config = json.loads((folder / "config.json").read_text())
    change(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))


def _refused_in_one_line(folder, *phrases: str) -> None:
    with warnings.catch_warnings(), pytest.raises(BatchgenError) as err:
        warnings.simplefilter("ignore")  # the CPU emulation's
        load_model(folder, torch.device("cpu"), torch.float32)
    message = str(err.value)
    assert "\n" not in message and all(p in message for p in phrases), message


def test_compressed_tensors_sparsity_is_refused_unless_dense(model_dir, tmp_path) -> None:
    """Sparse storage (2:4 bitmask and the like) is not read: refused from config.json; a
    sparsity_config whose weights are stored dense loads as any FP8 folder."""

    def sparse(fmt: str):
        config = {"format": fmt, "sparsity_structure": "2:4", "targets": ["Linear"]}
        return lambda quant: quant.update(sparsity_config=config)

    _ct_folder_with(model_dir, tmp_path / "sparse", sparse("sparse-24-bitmask"))
    _refused_in_one_line(tmp_path / "sparse", "sparsity_config format 'sparse-24-bitmask'")
    _ct_folder_with(model_dir, tmp_path / "dense", sparse("dense"))
    with pytest.warns(UserWarning, match="emulation"):
        load_model(tmp_path / "dense", torch.device("cpu"), torch.float32)


def test_compressed_tensors_transforms_are_refused(model_dir, tmp_path) -> None:
    rotation = {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "input"}]}
    transforms = {"config_groups": {"r": rotation}}
    _ct_folder_with(model_dir, tmp_path / "t", lambda q: q.update(transform_config=transforms))
    _refused_in_one_line(tmp_path / "t", "transform_config")


@pytest.mark.parametrize("field", [("symmetric", False), ("dynamic", True)])
def test_compressed_tensors_weights_must_be_symmetric_and_static(model_dir, tmp_path, field):
    """Zero points (asymmetric weights) and dynamic weight scales are not loaded: refused."""

    def change(quant: dict) -> None:
        quant["config_groups"]["group_0"]["weights"][field[0]] = field[1]

    _ct_folder_with(model_dir, tmp_path / "w", change)
    _refused_in_one_line(tmp_path / "w", "compressed-tensors FP8 with", field[0])


def test_an_fp8_folder_is_read_from_the_files_from_pretrained_reads(model_dir, tmp_path):
    """Safetensors files beside model.safetensors (consolidated.safetensors of Mistral's
    layout, a stale copy) are not read: the FP8 weights are those of the model's own file."""
    from safetensors.torch import load_file

    folder = tmp_path / "fp8"
    _save_prequantized(model_dir("llama"), folder, "ct-channel")
    stored = load_file(folder / "model.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(stored, "model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    q = "model.layers.0.self_attn.q_proj"
    save_file(
        {"layers.0.attention.wq.weight": stored[f"{q}.weight"]}, folder / "consolidated.safetensors"
    )
    stale = {f"{q}.weight": stored[f"{q}.weight"].float().neg().to(FP8_DTYPE)}
    save_file(
        {**stale, f"{q}.weight_scale": stored[f"{q}.weight_scale"]}, folder / "zz.safetensors"
    )
    with pytest.warns(UserWarning, match="emulation"):
        model = load_model(folder, torch.device("cpu"), torch.float32)
    got = model.get_submodule(q).weight
    assert got.view(torch.uint8).equal(stored[f"{q}.weight"].view(torch.uint8))


def test_autofp8_per_tensor_weight_scales_load_exactly(model_dir, tmp_path) -> None:
    """quant_method "fp8" with a per-tensor `weight_scale` (AutoFP8's layout, not
    transformers' `weight_scale_inv`): the stored FP8 values, the scale on every channel."""
    from safetensors.torch import load_file

    folder = tmp_path / "autofp8"
    _save_prequantized(model_dir("llama"), folder, "ct-tensor")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    stored = load_file(folder / "model.safetensors")
    with pytest.warns(UserWarning, match="emulation"):
        model = load_model(folder, torch.device("cpu"), torch.float32)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        assert layer.weight.view(torch.uint8).equal(stored[f"{name}.weight"].view(torch.uint8))
        assert (layer.weight_scale == stored[f"{name}.weight_scale"]).all()


def test_fp8_weights_of_other_than_linear_layers_are_refused(model_dir, tmp_path) -> None:
    """An FP8 embedding, or FP8 weights named per expert where the model keeps its experts
    fused (Qwen3-MoE), are refused before loading, naming the tensor."""
    from safetensors.torch import load_file

    from tests.families import build_family_model

    folder = tmp_path / "embedding"
    _save_prequantized(model_dir("llama"), folder, "ct-channel")
    stored = load_file(folder / "model.safetensors")
    name = "model.embed_tokens.weight"
    q, s = quantize_weight(stored[name])
    save_file({**stored, name: q, "model.embed_tokens.weight_scale": s[:, None]},
              folder / "model.safetensors")  # fmt: skip
    _refused_in_one_line(folder, f"stores '{name}', which is not the weight of an nn.Linear")
    moe = build_family_model("qwen3_moe", tmp_path / "moe")
    tensors = {}
    for key, tensor in load_file(moe / "model.safetensors").items():  # saved per expert
        if ".experts." in key:
            q, s = quantize_weight(tensor)
            tensors |= {key: q, key.replace(".weight", ".weight_scale"): s[:, None]}
        else:
            tensors[key] = tensor
    save_file(tensors, moe / "model.safetensors")
    config = json.loads((moe / "config.json").read_text())
    config["quantization_config"] = _quant_config("ct-channel")
    (moe / "config.json").write_text(json.dumps(config))
    _refused_in_one_line(moe, "experts.0.down_proj.weight', which is not", "no module there")


HUB_SCRIPT = """
import sys, warnings, torch
from batchgen.engine.model_loader import load_model
from batchgen.engine.quant import Fp8Linear
warnings.simplefilter("ignore")
for repo in sys.argv[1:]:
    try:
        model = load_model(repo, torch.device("cpu"), torch.float32)
        print(repo, "fp8-layers", sum(isinstance(m, Fp8Linear) for m in model.modules()))
    except Exception as exc:
        print(repo, "refused", type(exc).__name__, str(exc).replace(chr(10), " "))
"""


def test_hub_models_get_the_checks_and_fp8_loading_of_folders(model_dir, tmp_path) -> None:
    """A hub id (here from an offline Hugging Face cache) is checked as a folder is: an FP8
    model loads through batchgen's FP8 loader, an unsupported quantization is refused, and
    FP8 weights under a config without quantization are refused."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    cache = tmp_path / "hub"
    fp8 = tmp_path / "fp8"
    _save_prequantized(model_dir("llama"), fp8, "ct-channel")
    _ct_folder_with(model_dir, tmp_path / "sparse", lambda q: q.update(
        sparsity_config={"format": "sparse-24-bitmask"}))  # fmt: skip
    bare = _copy_folder(fp8, tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())
    del config["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    for name, folder in (("fp8", fp8), ("sparse", tmp_path / "sparse"), ("bare", bare)):
        root = cache / f"models--probe--{name}"
        shutil.copytree(folder, root / "snapshots" / ("0" * 40))
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    ids = ["probe/fp8", "probe/sparse", "probe/bare"]
    run = subprocess.run([sys.executable, "-c", HUB_SCRIPT, *ids], env=env, text=True,
                         capture_output=True, timeout=600, check=True)  # fmt: skip
    lines = dict(
        line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith("probe/")
    )
    assert lines["probe/fp8"] == "fp8-layers 14", run.stdout + run.stderr
    assert lines["probe/sparse"].startswith("refused BatchgenError"), lines
    assert "sparse-24-bitmask" in lines["probe/sparse"]
    assert "as F8_E4M3 but its config.json has no quantization_config" in lines["probe/bare"]


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_scaled_mm_matches_the_emulation() -> None:
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(256, 512, bias=True)).cuda()
    for rows in (1, 7, 64, 300):  # M not a multiple of 16 included
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        got = layer(x.cuda()).float().cpu()
        cpu = Fp8Linear(layer.weight.cpu(), layer.weight_scale.cpu(), layer.bias.cpu())
        want = cpu(x.float()).float()
        assert ((got - want).norm() / want.norm()) < 1e-2  # bf16 output rounding


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_engine_fp8_on_gpu_with_graphs(model_dir, kv: str, monkeypatch) -> None:
    from batchgen.engine import graphs as graphs_module

    # each decode size on its own graph from its first step: a larger graph's shape (first_use
    # borrowing) rounds bfloat16 logits differently, as any other batch size does, and this
    # model's last row meets an exact tie of its two best tokens on its fifth step
    monkeypatch.setattr(graphs_module, "CAPTURE_AT_STEP", 1)
    # initializer_range 0.02 (a trained model's scale): the tiny models' default 0.2 makes a
    # chaotic network (residual outliers ~60, logits +-12) whose bfloat16 log-probabilities
    # move by more than the probe's tolerance under FP8 weight rounding alone (probe docs)
    path = model_dir("llama", hidden_size=128, intermediate_size=256, initializer_range=0.02)
    config = EngineConfig(quantization="fp8", kv_cache_dtype=kv, num_kv_blocks=64)
    with Engine(path, config) as engine:  # the model check passes on the GPU too
        assert engine.runner.graphs is not None
        prompts = [[5, 9, 30, 7], [11, 12, 13, 14, 15, 16, 17], list(range(20, 60))]
        graphed = _greedy(engine, prompts)
    eager = EngineConfig(quantization="fp8", kv_cache_dtype=kv, num_kv_blocks=64,
                         cuda_graphs=False)  # fmt: skip
    with Engine(path, eager) as engine:
        assert _greedy(engine, prompts) == graphed


@pytest.mark.gpu
def test_fp8_kv_on_hopper_takes_tma_blocks_and_the_same_tokens(model_dir) -> None:
    """On a GPU with TMA an FP8 cache gets 64-token blocks (decode by TMA copies): the same
    greedy tokens as 16-token blocks (pointer loads), graphed and eager."""
    from batchgen.engine.kernels.paged_decode import has_tma

    if not has_tma(torch.device("cuda")):
        pytest.skip("needs a GPU with TMA (compute capability 9.0+)")
    path = model_dir("llama", hidden_size=128, intermediate_size=256, initializer_range=0.02)
    prompts = [[5, 9, 30, 7], [11, 12, 13, 14, 15, 16, 17], list(range(20, 150))]
    tokens = {}
    for block_size, graphs in ((None, True), (None, False), (16, True)):
        config = EngineConfig(kv_cache_dtype="fp8", num_kv_blocks=64, block_size=block_size,
                              cuda_graphs=graphs)  # fmt: skip
        with Engine(path, config) as engine:
            assert engine.config.block_size == (64 if block_size is None else 16)
            tokens[block_size, graphs] = _greedy(engine, prompts)
    assert tokens[None, True] == tokens[None, False] == tokens[16, True]


@pytest.mark.gpu
def test_fp8_rows_from_the_norms_change_no_token(model_dir, monkeypatch) -> None:
    """The merged projections take the FP8 rows the norms wrote (no quantization kernel of
    their own), and the tokens are those of quantizing separately."""
    import batchgen.engine.fusion as fusion
    import batchgen.engine.quant.fp8 as fp8

    path = model_dir("llama", hidden_size=128, intermediate_size=256, initializer_range=0.02)
    config = EngineConfig(quantization="fp8", num_kv_blocks=64, cuda_graphs=False)
    prompts = [[5, 9, 30, 7], [11, 12, 13, 14, 15, 16, 17], list(range(20, 60))]
    attached, own = [], fp8._rows_of

    def spy(x: torch.Tensor, x2: torch.Tensor):
        attached.append(getattr(x, fp8._FP8_ROWS, None) is not None)
        return own(x, x2)

    monkeypatch.setattr(fp8, "_rows_of", spy)
    with Engine(path, config) as engine:
        with_rows = _greedy(engine, prompts)
    assert True in attached  # q/k/v and gate/up took the norms' rows
    monkeypatch.setattr(fusion, "FEEDS", ())
    with Engine(path, config) as engine:
        assert _greedy(engine, prompts) == with_rows


def test_a_hub_model_in_a_refused_quantization_is_refused_before_its_weights_download(
    tmp_path, monkeypatch
) -> None:
    """Its config.json says GPTQ: refused once that file is had, no weight file fetched."""
    import huggingface_hub

    from batchgen.engine.quant.checkpoint import checkpoint_folder

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    config = {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}
    (snapshot / "config.json").write_text(json.dumps(config))
    asked: list[list[str]] = []

    def fake_download(repo_id: str, allow_patterns: list[str], **kwargs: object) -> str:
        asked.append(list(allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    with pytest.raises(BatchgenError, match="gptq"):
        checkpoint_folder("org/model-gptq")
    assert asked == [["*.json"]]
