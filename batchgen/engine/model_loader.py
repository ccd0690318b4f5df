"""Load a Hugging Face decoder-only model and its tokenizer for the engine."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import GENERATION_CONFIG_NAME
from transformers.utils import logging as hf_logging

from batchgen.engine.attention import ATTENTION_NAME, attention_scope, register
from batchgen.engine.config import DEFAULT_BLOCK_SIZE, EngineConfig
from batchgen.engine.fingerprint import (
    adapter_state,
    buffers_digest,
    modules_digest,
    nonpersistent_buffers,
)
from batchgen.engine.model_path import resolve_model_path
from batchgen.engine.preload import Preload
from batchgen.engine.quant import FP8_DTYPE, check_fp8_device, quantize_model
from batchgen.engine.quant.checkpoint import (
    check_loading_info,
    checkpoint_folder,
    checkpoint_format,
    load_fp8_checkpoint,
)
from batchgen.engine.quant.convert import check_coverage
from batchgen.engine.sampling_params import generation_defaults
from batchgen.engine.upload import upload_model
from batchgen.errors import BatchgenError, first_line


class ModelShape(NamedTuple):
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


def activation_bytes_per_token(model: PreTrainedModel, dtype: torch.dtype) -> int:
    """An estimate of a step's live activations per token, from the text config: the residual
    stream, its normed copy, q/k/v and the attention output (4 x hidden, with room for grouped
    heads), and the MLP's gate/up pair and product (3 x its widest intermediate; experts count
    as many as route each token). Families name these fields differently: a missing one is
    taken as 4 x hidden, and one given per layer (Gemma-3n) counts its widest."""
    config = model.config.get_text_config()

    def width(name: str) -> int:
        value = getattr(config, name, 0) or 0
        return max(map(int, value), default=0) if isinstance(value, (list, tuple)) else int(value)

    hidden = width("hidden_size")
    dense = width("intermediate_size")
    experts = width("num_experts_per_tok")
    expert = width("moe_intermediate_size") or dense
    intermediate = max(dense, experts * expert) or 4 * hidden
    return (4 * hidden + 3 * intermediate) * torch.tensor([], dtype=dtype).element_size()


class WeightsVersion(NamedTuple):
    """What a caller's model computes with, compared between generate calls: equal unless
    its weights, buffers, adapters or modules were changed or replaced."""

    # where each parameter and persistent buffer lives and its version counter, which every
    # in-place change made through the tensor (an optimizer step, load_state_dict, copy_
    # under no_grad) bumps; a change made through `.data` bumps none. Inference tensors
    # count by address.
    tensors: tuple[tuple[int, int], ...]
    buffers: tuple[int, ...]  # where each non-persistent floating-point buffer lives
    buffer_contents: bytes  # their digest (buffers_digest)
    adapters: tuple[tuple[Any, ...], ...]  # adapter layers' state (adapter_state)
    modules: str  # the module tree and each module's settings (modules_digest)
    vocab_size: int | None  # the config's (resize_token_embeddings changes it)

    def addresses(self) -> tuple[int, ...]:
        """Where every tensor lives (what CUDA graphs and fused layers read)."""
        return (*(a for a, _ in self.tensors), *self.buffers)


def weights_version(model: torch.nn.Module) -> WeightsVersion:
    out = []
    for module in model.modules():
        skip = module._non_persistent_buffers_set
        for name, t in (*module._parameters.items(), *module._buffers.items()):
            if t is not None and name not in skip:
                out.append((t.data_ptr(), -1 if t.is_inference() else t._version))
    buffers = nonpersistent_buffers(model)
    where = tuple(t.data_ptr() for t in buffers)
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    return WeightsVersion(
        tuple(out), where, buffers_digest(buffers), adapter_state(model), modules_digest(model),
        vocab,
    )  # fmt: skip


def set_cpu_threads(config: EngineConfig) -> None:
    """torch's intra-op threads for a CPU engine (see EngineConfig.cpu_threads)."""
    threads = config.cpu_threads
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return
        threads = max(1, len(os.sched_getaffinity(0)) - 1)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def adopt_model(model: PreTrainedModel, config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """Device and dtype for a model the caller loaded; it is used as it is, never moved or
    cast (the caller may go on using it). A setting that asks otherwise is an error."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = model.dtype
    if config.device != "auto":
        wanted = torch.device(config.device)
        if wanted.type != device.type or (wanted.index is not None and wanted != device):
            raise BatchgenError(
                f"the model passed in is on {device} but device={config.device!r}: move it "
                "first (model.to(...)) or use device='auto' to run where it is"
            )
    if config.dtype != "auto" and getattr(torch, config.dtype) != dtype:
        raise BatchgenError(
            f"the model passed in is {str(dtype).removeprefix('torch.')} but "
            f"dtype={config.dtype!r}: convert it first (model.to(torch.{config.dtype})) or use "
            "dtype='auto' to run it as it is"
        )
    register()
    return device, dtype


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run the block with every module of `model` in eval mode (no dropout, no other
    training-only behaviour), then give each module back the mode it had."""
    training = [module for module in model.modules() if module.training]
    for module in training:
        module.training = False
    try:
        yield
    finally:
        for module in training:
            module.training = True


def has_training_parts(model: torch.nn.Module) -> bool:
    """Whether any module of `model` is in train mode."""
    return any(module.training for module in model.modules())


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the KV cache stores: the model's dtype, or FP8 E4M3 (kv_cache_dtype='fp8')."""
    if config.kv_cache_dtype != "fp8":
        return dtype
    check_fp8_device(device, "kv_cache_dtype='fp8'")
    return FP8_DTYPE


def kv_block_size(config: EngineConfig, kv_dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per KV block: config.block_size, or where it is unset an 8-bit cache's decode
    tile on a GPU with TMA (each tile then one TMA copy of one block: on an H200, 8b heads at
    batch 256, 72.6 against 82.5 us per layer), else DEFAULT_BLOCK_SIZE."""
    if config.block_size is not None:
        return config.block_size
    if kv_dtype.itemsize == 1 and device.type == "cuda":
        from batchgen.engine.attention.triton import TritonTuning
        from batchgen.engine.kernels.paged_decode import has_tma

        if has_tma(device):
            return TritonTuning.decode_8bit_block_n
    return DEFAULT_BLOCK_SIZE


def load_model(
    model: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
    preload: Preload | None = None,
) -> PreTrainedModel:
    """Load a model folder, hub id or "default" with batchgen's attention; quantization
    'fp8' quantizes its Linear layers on the device. A pre-quantized FP8 folder or hub model
    (its config.json says so) is read as FP8 whatever quantization says. preload: the folder's
    weights, read ahead onto the device (preload.py), if it has read this folder's."""
    register()
    try:
        source = resolve_model_path(model)
        folder = checkpoint_folder(source)  # a hub id's snapshot in the Hugging Face cache
        fmt = checkpoint_format(folder)
        if fmt is not None or quantization == "fp8":
            check_fp8_device(device)
        weights = preload.take(source, device) if preload is not None else None
        try:
            if fmt is not None:
                loaded = load_fp8_checkpoint(folder, fmt, dtype, ATTENTION_NAME)
            else:
                loaded, failed = _from_weights(source, weights, dtype, device)
                if loaded is None:  # the folder is read (again)
                    loaded, info = AutoModelForCausalLM.from_pretrained(
                        source,
                        dtype=dtype,
                        attn_implementation=ATTENTION_NAME,
                        output_loading_info=True,
                    )
                    check_loading_info(source, loaded, info)
                    if folder != source:  # a hub model's weight files are in the cache now
                        checkpoint_format(folder)
                if failed is not None:  # read ahead for nothing, yet the folder loads
                    warnings.warn(
                        f"batchgen: the weights read ahead were not used ({failed}): the model "
                        "folder was read again",
                        stacklevel=2,
                    )
        except (torch.OutOfMemoryError, BatchgenError):
            raise
        except Exception as exc:  # missing files, bad weights (safetensors, pickle), offline hub
            _refuse_unsupported_class(source, exc)
            raise BatchgenError(
                f"could not load model '{model}' ({first_line(exc)}): check the model folder "
                "or hub id"
            ) from exc
        loaded = upload_model(loaded, device).eval()
        if quantization == "fp8" and fmt is None:
            check_coverage(loaded, quantize_model(loaded))
        return loaded
    except torch.OutOfMemoryError as exc:
        free = _free_gib(device)
        raise BatchgenError(
            f"model '{model}' does not fit on {device} in "
            f"{dtype} ({free} free): use a smaller model, another dtype or a larger device"
        ) from exc


def _from_weights(
    source: str, weights: dict[str, torch.Tensor] | None, dtype: torch.dtype, device: torch.device
) -> tuple[PreTrainedModel | None, str | None]:
    """-> (the folder's model built by transformers' loading from its weights read ahead
    onto the device (on a GPU through a device map, which needs accelerate), or None: no
    weights, a model class that loads files of its own, or a failure, given second as one
    line). What from_pretrained reads from the folder besides the weights (config,
    generation config, name) is read here."""
    if weights is None:
        return None, None
    try:
        config = AutoConfig.from_pretrained(source)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        if getattr(config, "auto_map", None) or getattr(type(config), "extra_files", None):
            return None, None
        placed = {} if device.type == "cpu" else {"device_map": {"": device}}
        loaded, info = cls.from_pretrained(
            None,
            config=config,
            state_dict=weights,
            dtype=dtype,
            attn_implementation=ATTENTION_NAME,
            output_loading_info=True,
            **placed,
        )
        check_loading_info(source, loaded, info)
    except (torch.OutOfMemoryError, BatchgenError):
        raise
    except Exception as exc:  # reading the folder itself reports what is wrong, if anything
        return None, first_line(exc)
    finally:
        weights.clear()  # the model holds what it uses; the rest goes now
    loaded.config.name_or_path = loaded.name_or_path = source  # as from_pretrained sets them
    if loaded.can_generate():  # as from_pretrained does (adjust_generation_fn)
        if (Path(source) / GENERATION_CONFIG_NAME).is_file():
            loaded.generation_config = GenerationConfig.from_pretrained(source)
        else:
            loaded.generation_config = GenerationConfig.from_pretrained(
                source, config_file_name="config.json", _from_model_config=True
            )
    return loaded, None


def hf_progress_bars(shown: bool) -> AbstractContextManager[None]:
    """transformers' own progress bars (loading weights) shown or not inside; the process's
    setting is restored after (a quiet job prints none)."""
    return library_bars(
        shown,
        hf_logging.is_progress_bar_enabled,
        hf_logging.disable_progress_bar,
        hf_logging.enable_progress_bar,
    )


@contextmanager
def library_bars(
    shown: bool, enabled: Callable[[], bool], disable: Callable[[], Any], enable: Callable[[], Any]
) -> Iterator[None]:
    """A library's progress bars (its is-enabled, disable and enable switches) off inside
    where not shown; as they were after."""
    off = enabled() and not shown
    if off:
        disable()
    try:
        yield
    finally:
        if off:
            enable()


def _refuse_unsupported_class(source: str, exc: BaseException) -> None:
    """A model class that cannot take batchgen's attention at all (its attention classes are
    chosen from a per-model table): refuse it by name of its family."""
    try:
        config = AutoConfig.from_pretrained(source)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:
        return
    if not getattr(cls, "_supports_attention_backend", True):
        raise BatchgenError(
            f"batchgen cannot run {config.model_type} models exactly: {cls.__name__} does not "
            "route attention through transformers' attention interface"
        ) from exc


def _free_gib(device: torch.device) -> str:
    if device.type != "cuda":
        return "not enough memory"
    free, _ = torch.cuda.mem_get_info(device)
    return f"{free / 2**30:.1f} GiB"


SHAPE_PROBE = "batchgen-shape-probe"


def model_shape(model: PreTrainedModel) -> ModelShape:
    """Layers, heads and KV head width, measured from the tensors the model's layers hand to
    attention on a two-token forward pass (not read off config fields, which families name
    and use differently). Keys and values of unequal width (multi-head latent attention)
    share the wider one. BatchgenError for a model whose layers do not hand attention to
    transformers' attention interface, or whose layers differ in attention shape."""
    config = model.config.get_text_config()
    family = getattr(config, "model_type", None) or type(model).__name__
    seen, failure = _attention_calls(model, family)
    shapes = set(seen.values())
    if len(shapes) != 1:
        raise BatchgenError(
            f"batchgen cannot run {family} models exactly: their layers differ in attention "
            f"shape ({sorted(shapes)}), and batchgen's KV cache has one shape for all layers"
        )
    heads, kv_heads, k_dim, v_dim = shapes.pop()
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    missing = sorted(set(range(layers)) - set(seen))
    if missing and failure is not None:  # the layers after it were never reached
        raise BatchgenError(
            f"batchgen cannot run {family} models exactly: its forward pass fails "
            f"({first_line(failure)})"
        ) from failure
    if missing:
        raise BatchgenError(
            f"batchgen cannot run {family} models exactly: layer(s) {missing} of {layers} mix "
            "tokens without attention (recurrent, convolutional or linear-attention layers: "
            "batchgen keeps no state for them)"
        )
    if layers < len(seen) or any(not isinstance(i, int) or not 0 <= i < layers for i in seen):
        raise BatchgenError(
            f"batchgen cannot run {family} models exactly: their attention layers are not "
            f"numbered 0..num_hidden_layers-1 ({sorted(map(str, seen))})"
        )
    limit = getattr(config, "max_position_embeddings", None)
    return ModelShape(
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=max(k_dim, v_dim),
        vocab_size=config.vocab_size,
        max_position_embeddings=limit or 2**31 - 1,
    )


@torch.inference_mode()
def _attention_calls(
    model: PreTrainedModel, family: str
) -> tuple[dict[Any, tuple[int, int, int, int]], Exception | None]:
    """-> (layer_idx -> (query heads, key heads, key dim, value dim) of each attention call,
    the exception that ended the forward pass after some layers were seen, or None)."""
    seen: dict[Any, tuple[int, int, int, int]] = {}

    def record(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(module, "layer_idx", f"#{len(seen)}")
        seen[layer] = (query.shape[1], key.shape[1], key.shape[-1], value.shape[-1])
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
        return out, None

    AttentionInterface.register(SHAPE_PROBE, record)
    device = next(model.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    failure = None
    try:
        with attention_scope(model, SHAPE_PROBE):
            model(input_ids=ids, use_cache=False)
    except Exception as exc:
        failure = exc
        if not seen:
            with attention_scope(model, "eager"):
                try:  # failing before any attention call: the model's own pass fails too?
                    model(input_ids=ids, use_cache=False)
                except Exception as own:
                    raise BatchgenError(
                        f"batchgen cannot run {family} models exactly: its own forward pass "
                        f"fails ({first_line(own)})"
                    ) from own
            raise BatchgenError(
                f"batchgen cannot run {family} models exactly: their layers do not hand "
                f"attention to transformers' attention interface ({type(exc).__name__})"
            ) from exc
    if not seen:
        raise BatchgenError(
            f"batchgen cannot run {family} models exactly: their layers do not hand attention "
            "to transformers' attention interface (recurrent or custom sequence mixing)"
        )
    return seen, failure


def check_rope(model: PreTrainedModel, max_model_len: int) -> None:
    """BatchgenError where the model's rotary embedding depends on more than each token's
    position within max_model_len tokens: LongRoPE picks short or long factors from the
    largest position of the whole forward pass (transformers' dynamic update), which a packed
    step of several requests, or a chunk of one prompt, does not share with the model's own
    pass. Below original_max_position_embeddings only the short factors are ever used."""
    config = model.config.get_text_config()
    limits = _longrope_limits(config)
    if limits and max_model_len > min(limits):
        family = getattr(config, "model_type", None) or type(model).__name__
        raise BatchgenError(
            f"batchgen cannot run {family} models exactly beyond {min(limits):,} tokens: their "
            "LongRoPE switches rotary factors once a sequence passes "
            f"original_max_position_embeddings ({min(limits):,}), and max_model_len is "
            f"{max_model_len:,}: set max_model_len (runtime.max_model_len) <= {min(limits):,} to "
            "run it exactly"
        )


def _longrope_limits(config: Any) -> list[int]:
    """original_max_position_embeddings of each LongRoPE rotary in the config (a flat rope
    dict, or one per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict) or not params:
        return []
    nested = all(isinstance(v, dict) for v in params.values())
    groups = list(params.values()) if nested else [params]
    fallback = getattr(config, "original_max_position_embeddings", None)
    fallback = fallback or getattr(config, "max_position_embeddings", None) or 2**31 - 1
    return [
        int(group.get("original_max_position_embeddings") or fallback)
        for group in groups
        if (group.get("rope_type") or group.get("type")) == "longrope"
    ]


def model_sampling_defaults(model: PreTrainedModel, config: EngineConfig) -> dict[str, Any]:
    """What the model's generation_config.json recommends for sampling, under
    generation_config "auto"; {} under "ignore", and where the folder has no such file (a
    generation config derived from config.json: an old checkpoint's sampling keys there are
    read by neither Hugging Face's AutoConfig nor vLLM)."""
    gen = getattr(model, "generation_config", None)
    if config.generation_config != "auto" or gen is None or _derived(gen):
        return {}
    return generation_defaults(gen)


def _derived(gen: Any) -> bool:
    """Whether a model's generation config was derived from its config.json (the folder has
    no generation_config.json)."""
    return bool(getattr(gen, "_from_model_config", False))


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None and (gen is None or _derived(gen)):
        # config.json's ids only where no generation_config.json was read: one that names no
        # end-of-sequence id stops on the tokenizer's alone (as Hugging Face and vLLM do)
        eos = model.config.get_text_config().eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
