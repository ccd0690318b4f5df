"""Bad input: each bad request is an error result naming it; the others still complete."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchgen import BatchgenError, Engine, EngineConfig, Prompt, SamplingParams
from tests.helpers import hf_greedy, random_prompts


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(
        model_dir("llama", max_position_embeddings=64), EngineConfig(device="cpu", dtype="float32")
    )


def test_bad_requests_become_errors_and_the_rest_complete(engine: Engine, model_dir) -> None:
    good = random_prompts(2, 4, 10, 500, seed=1)
    items = [
        Prompt(good[0], request_id="good-0"),
        Prompt("", request_id="empty-text"),
        Prompt([], request_id="empty-ids"),
        Prompt(list(range(5, 5 + 64)), request_id="too-long"),
        Prompt(good[1], request_id="zero-new", sampling={"max_new_tokens": 0}),
        Prompt(good[1], request_id="neg-temp", sampling={"temperature": -1.0}),
        Prompt(good[1], request_id="unknown-field", sampling={"top_q": 0.5}),
        Prompt([5, 10**9], request_id="bad-id"),
        Prompt(None, request_id="none"),  # type: ignore[arg-type]
        Prompt(good[1], request_id="good-1"),
    ]
    outs = {o.request_id: o for o in engine.generate(items, SamplingParams(max_new_tokens=8))}
    assert set(outs) == {p.request_id for p in items}, "every request yields exactly one result"
    errors = {k: o.error for k, o in outs.items() if o.finish_reason == "error"}
    assert set(errors) == set(outs) - {"good-0", "good-1"}
    for rid, message in errors.items():
        assert message.startswith(f"request {rid}:")
    assert "prompt is empty" in errors["empty-text"] and "prompt is empty" in errors["empty-ids"]
    assert "64 tokens" in errors["too-long"] and "max_model_len" in errors["too-long"]
    assert "max_new_tokens" in errors["zero-new"]
    assert "temperature" in errors["neg-temp"]
    assert "top_q" in errors["unknown-field"]
    assert "outside the vocabulary" in errors["bad-id"]
    path = model_dir("llama", max_position_embeddings=64)
    for i in (0, 1):
        expected = hf_greedy(path, good[i], 8, eos_token_id=engine.tokenizer.eos_token_id)
        assert outs[f"good-{i}"].output_token_ids == expected


def test_generation_stops_at_the_models_context(engine: Engine) -> None:
    prompt = list(range(5, 5 + 60))
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.output_token_ids) == 64


def test_duplicate_running_id_is_an_error(engine: Engine) -> None:
    items = [Prompt([5, 6, 7], request_id="x"), Prompt([8, 9], request_id="x")]
    outs = list(engine.generate(items, SamplingParams(max_new_tokens=4)))
    assert sorted(o.finish_reason for o in outs) != ["error", "error"]
    assert [o.error for o in outs if o.error] == [
        "request x: id 'x' was given to an earlier prompt of this call (a prompt without a "
        "request_id has its position as id): ids must be unique"
    ]


def test_missing_model_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(BatchgenError, match=r"model path '.*nope' does not exist"):
        Engine(str(tmp_path / "nope"))
    with pytest.raises(BatchgenError, match=r"has no config\.json"):
        Engine(str(tmp_path))


def test_invalid_engine_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(max_new_tokens=0)


def test_an_unset_token_budget_follows_the_device(monkeypatch) -> None:
    """Unset, a step's token budget is 16,384 on a GPU of 70 GiB or more other than an A100
    whose memory beside the weights and KV cache holds twice that step's activations, 8,192
    elsewhere, and never below max_num_seqs; a budget that is set is kept."""
    from types import SimpleNamespace

    import torch

    from batchgen.engine import device as engine_device

    cuda, cpu, gib = torch.device("cuda"), torch.device("cpu"), 1024**3
    gpus = {"NVIDIA H200": 140 * gib, "NVIDIA A100-SXM4-80GB": 80 * gib, "NVIDIA L4": 24 * gib}
    gpu = ["NVIDIA H200"]
    props = lambda device: SimpleNamespace(name=gpu[0], total_memory=gpus[gpu[0]])  # noqa: E731
    monkeypatch.setattr(engine_device.torch.cuda, "get_device_properties", props)
    budget = engine_device.token_budget
    per_token = 120_000  # an 8b Llama's activations per token in bf16 (about)
    room = 2 * 16384 * per_token  # twice a 16,384-token step's
    assert budget(EngineConfig(), cuda, room, per_token) == 16384
    assert budget(EngineConfig(), cuda, room - 1, per_token) == 8192  # a bigger model's
    assert budget(EngineConfig(max_num_batched_tokens=4096), cuda, room, per_token) == 4096
    assert budget(EngineConfig(), cpu, room, per_token) == 8192
    assert budget(EngineConfig(max_num_seqs=10000), cpu) == 10000
    for name in ("NVIDIA A100-SXM4-80GB", "NVIDIA L4"):
        gpu[0] = name
        assert budget(EngineConfig(), cuda, room, per_token) == 8192, name
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_activations_per_token_follow_the_config(model_dir) -> None:
    import torch
    from transformers import AutoConfig

    from batchgen.engine.model_loader import activation_bytes_per_token

    config = AutoConfig.from_pretrained(model_dir("llama"))
    model = SimpleNamespace(config=config)
    expected = (4 * config.hidden_size + 3 * config.intermediate_size) * 2
    assert activation_bytes_per_token(model, torch.bfloat16) == expected
    config.moe_intermediate_size, config.num_experts_per_tok = config.intermediate_size, 8
    hidden, routed = config.hidden_size, 8 * config.intermediate_size  # 8 experts per token
    assert activation_bytes_per_token(model, torch.float32) == (4 * hidden + 3 * routed) * 4


def test_kv_cache_too_small_for_one_request(model_dir) -> None:
    path = model_dir("llama", max_position_embeddings=64)
    with pytest.raises(BatchgenError, match="KV cache fits"):
        Engine(path, EngineConfig(device="cpu", block_size=8, cpu_kv_cache_gib=1e-6))


def test_model_that_does_not_fit_is_a_clear_error(model_dir, monkeypatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", out_of_memory)
    with pytest.raises(BatchgenError, match="does not fit on cpu"):
        Engine(model_dir("llama"), EngineConfig(device="cpu"))


def test_spare_bytes_are_what_the_planned_cache_leaves(monkeypatch) -> None:
    import torch

    from batchgen.engine import runner
    from batchgen.engine.attention import KVCache
    from batchgen.engine.model_loader import ModelShape

    gib, cuda = 1024**3, torch.device("cuda")
    monkeypatch.setattr(runner.torch.cuda, "mem_get_info", lambda device: (100 * gib, 140 * gib))
    monkeypatch.setattr(runner.torch.cuda, "memory_reserved", lambda device: 3 * gib)
    monkeypatch.setattr(runner.torch.cuda, "memory_allocated", lambda device: 1 * gib)
    shape = ModelShape(16, 32, 8, 64, 32000, 4096)
    config = EngineConfig(block_size=16)
    per_block = KVCache.bytes_per_block(16, 16, 8, 64, torch.bfloat16)
    spare = runner.spare_bytes(config, shape, torch.bfloat16, cuda, 1000)
    assert spare == 102 * gib - 1001 * per_block  # free + reserved-unused - cache (+ scratch)
    assert runner.spare_bytes(config, shape, torch.bfloat16, torch.device("cpu"), 1000) == 0


def test_text_whose_tokens_the_model_lacks_is_an_error(model_dir) -> None:
    """A tokenizer with more tokens than the model's vocabulary: a text prompt that tokenizes
    beyond it is an error result, as token ids are; the others complete."""
    small = Engine(model_dir("llama", vocab_size=300), EngineConfig(device="cpu"))
    text = "The weather today is cold and the temperature is low"
    assert max(small.tokenizer(text).input_ids) >= 300
    items = [Prompt(text, request_id="text"), Prompt([5, 6, 7], request_id="ids")]
    outs = {o.request_id: o for o in small.generate(items, SamplingParams(max_new_tokens=3))}
    assert outs["text"].finish_reason == "error"
    assert outs["text"].error.startswith("request text: token id ")
    assert "is outside the vocabulary [0, 300): the tokenizer gives ids" in outs["text"].error
    assert outs["ids"].finish_reason == "length"
    small.close()


def test_a_text_prompt_that_is_not_valid_unicode_is_an_error_result(engine: Engine) -> None:
    """A lone surrogate (json.loads('"\\ud800"') gives one) in one text prompt: its result is
    an error naming it, as the job's rows are; the other prompts complete."""
    bad = "caf" + chr(0xD800)
    items = [Prompt("fine prompt", request_id="a"), Prompt(bad, request_id="bad")]
    items.append(Prompt("another fine prompt", request_id="b"))
    outs = {o.request_id: o for o in engine.generate(items, SamplingParams(max_new_tokens=2))}
    assert outs["bad"].finish_reason == "error"
    assert outs["bad"].error == (
        "request bad: prompt is not valid Unicode (it holds a lone surrogate)"
    )
    assert outs["a"].finish_reason == outs["b"].finish_reason == "length"


def test_a_text_prompt_that_begins_with_the_bos_text_is_an_error_result(engine: Engine) -> None:
    """The tokenizer adds its BOS before a text that begins with one already (a chat template
    rendered upstream): an error result naming it, not a prompt with two; others complete."""
    bos = engine.tokenizer.bos_token
    items = [Prompt(bos + "Hello there", request_id="two"), Prompt("Hello there", request_id="one")]
    outs = {o.request_id: o for o in engine.generate(items, SamplingParams(max_new_tokens=2))}
    assert outs["two"].finish_reason == "error"
    assert outs["two"].error == (
        f"request two: the prompt text already begins with the BOS token {bos}, and the "
        "tokenizer adds another: remove it from the text, or pass token ids"
    )
    assert outs["one"].prompt_token_ids.count(engine.tokenizer.bos_token_id) == 1


def test_token_ids_that_are_not_integers_are_an_error_result(engine: Engine) -> None:
    """A bool among token ids (True is an int in Python, 1 to an int64 array) is an error
    result naming it, as a float is, never token 1; an int subclass such as numpy's ints
    runs as its value."""
    np = pytest.importorskip("numpy")
    items = [
        Prompt([5, True, 7], request_id="bool"),
        Prompt([5, False], request_id="false"),
        Prompt([5, 6.0], request_id="float"),
        Prompt([5, 2**70], request_id="huge"),
        Prompt([5, np.int64(1), 7], request_id="numpy"),
        Prompt([5, 1, 7], request_id="plain"),
    ]
    outs = {o.request_id: o for o in engine.generate(items, SamplingParams(max_new_tokens=2))}
    errors = {k: o.error for k, o in outs.items()}
    assert errors["bool"] == "request bool: prompt token ids must be integers, not bool (True)"
    assert errors["false"] == "request false: prompt token ids must be integers, not bool (False)"
    assert errors["float"] == "request float: prompt token ids must be integers, not float (6.0)"
    assert errors["huge"] == "request huge: prompt token ids must fit in 64 bits"
    assert outs["numpy"].prompt_token_ids == outs["plain"].prompt_token_ids == [5, 1, 7]
    assert outs["numpy"].output_token_ids == outs["plain"].output_token_ids
