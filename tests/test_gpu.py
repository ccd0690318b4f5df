"""The CUDA path: Triton attention, CUDA graphs, pinned double buffers and streams.

Run on a GPU machine (`pytest -m gpu`); skipped without CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen import BatchgenError, Engine, EngineConfig, Prompt, SamplingParams
from tests.families import FAMILIES, build_family_model
from tests.helpers import assert_greedy_or_near_tie, random_prompts
from tests.test_model_families import REFUSED

pytestmark = pytest.mark.gpu


def cuda_engine(path: Path, **overrides) -> Engine:
    """A small fixed KV cache: several engines share the GPU within one test."""
    overrides.setdefault("num_kv_blocks", 2048)
    return Engine(path, EngineConfig(device="cuda", **overrides))


def hf_greedy_cuda(path: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        .cuda()
        .eval()
    )
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def tokens(engine: Engine, prompts, params: SamplingParams) -> dict[str, list[int]]:
    outs = {o.request_id: o for o in engine.generate(prompts, params, decode=False)}
    assert all(o.finish_reason != "error" for o in outs.values())
    return {k: o.output_token_ids for k, o in outs.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp32_triton_graphs_match_hf(model_dir, arch: str) -> None:
    path = model_dir(arch)
    prompts = random_prompts(12, 2, 60, 1000, seed=3)
    engine = cuda_engine(path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    assert type(engine.runner.backend).__name__ == "TritonBackend"
    assert engine.runner.graphs is not None
    got = tokens(engine, prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy_cuda(path, prompt, 20), f"request {i}"


def test_graphs_eager_overlap_sync_agree(model_dir) -> None:
    """Every sampling feature, with and without graphs, overlapped and synchronous."""
    path = model_dir("llama")
    prompts = random_prompts(20, 2, 80, 1000, seed=4)
    extra = [
        {},
        {"top_p": 0.9, "top_k": 20},
        {"repetition_penalty": 1.3, "presence_penalty": 0.5},
        {"n": 3, "min_p": 0.1},
        {"logprobs": 2, "min_new_tokens": 10},
    ]
    items = [
        Prompt(p, sampling={"temperature": 0.9 * (i % 2), "seed": i, **extra[i % 5]})
        for i, p in enumerate(prompts)
    ]
    params = SamplingParams(max_new_tokens=24)
    runs = {}
    for graphs in (True, False):
        for overlap in (True, False):
            engine = cuda_engine(
                path,
                dtype="float32",
                cuda_graphs=graphs,
                overlap=overlap,
                max_num_seqs=16,
                max_num_batched_tokens=128,
            )
            outs = engine.generate(items, params, decode=False)
            runs[(graphs, overlap)] = {
                (o.request_id, o.sample_index): (o.output_token_ids, o.logprobs) for o in outs
            }
    first = runs[(True, True)]
    assert len(first) == 20 + 4 * 2
    for run in runs.values():
        assert run.keys() == first.keys()
        for key, (ids, lps) in run.items():
            assert ids == first[key][0]
            if lps is not None:
                assert [lp.top_ids for lp in lps] == [lp.top_ids for lp in first[key][1]]


def test_preemption_on_gpu_matches_reference(model_dir) -> None:
    path = model_dir("llama")
    prompts = random_prompts(10, 10, 40, 1000, seed=5)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    small = cuda_engine(
        path,
        dtype="float32",
        block_size=16,
        num_kv_blocks=12,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    got = tokens(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    ref = cuda_engine(path, dtype="float32", attention_backend="reference", cuda_graphs=False)
    assert got == tokens(ref, prompts, params)


def test_prefix_cache_on_gpu_matches_hf_and_the_cache_off(model_dir) -> None:
    """Triton prefill from cached blocks (start > 0), graphs, a small cache that evicts."""
    path = model_dir("llama")
    prefix = random_prompts(1, 70, 70, 1000, seed=8)[0]
    prompts = [prefix + t for t in random_prompts(12, 1, 30, 1000, seed=9)] + [prefix]
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    on = cuda_engine(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    got = tokens(on, prompts, greedy)
    assert on.cache_stats.cached_tokens >= 12 * 64
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy_cuda(path, prompt, 16), f"request {i}"
    seeded = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=1, n=2)
    runs = []
    for caching in (True, False):
        engine = cuda_engine(
            path, dtype="float32", num_kv_blocks=16, max_num_seqs=4,
            max_num_batched_tokens=64, enable_prefix_caching=caching,
        )  # fmt: skip
        outs = engine.generate(prompts, seeded, decode=False)
        runs.append({(o.request_id, o.sample_index): o.output_token_ids for o in outs})
    assert runs[0] == runs[1] and len(runs[0]) == 2 * len(prompts)


def test_bf16_overlap_equals_sync_and_capture_report(model_dir) -> None:
    path = model_dir("llama")
    prompts = random_prompts(40, 2, 100, 1000, seed=6)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    a = cuda_engine(path, dtype="bfloat16", overlap=True, max_num_seqs=32)
    report = a.runner.graphs.report
    assert report.sizes and report.seconds > 0
    b = cuda_engine(path, dtype="bfloat16", overlap=False, max_num_seqs=32)
    assert tokens(a, prompts, params) == tokens(b, prompts, params)


def test_graphs_captured_on_first_use_equal_those_captured_at_startup(
    model_dir, monkeypatch
) -> None:
    """first_use captures the largest size at start-up and (with CAPTURE_AT_STEP 1) each other
    size before its first step, between overlapped steps: the tokens and logprobs are those of
    start-up graphs."""
    from batchgen.engine import graphs as graphs_module

    monkeypatch.setattr(graphs_module, "CAPTURE_AT_STEP", 1)
    path = model_dir("llama")
    prompts = random_prompts(40, 2, 100, 1000, seed=11)
    items = [
        Prompt(p, sampling={"max_new_tokens": 4 + 3 * i, "temperature": 0.7 * (i % 2), "seed": i,
                            "logprobs": 1})
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    runs, engines = [], []
    for capture in ("first_use", "startup"):  # no model check: its steps would capture too
        engine = cuda_engine(
            path, dtype="bfloat16", max_num_seqs=32, cuda_graph_capture=capture, check_model=False
        )
        engines.append(engine)
        graphs = engine.runner.graphs
        decode = {pad.B for pad in graphs.graphs if pad.decode}
        tokens = {pad.T for pad in graphs.graphs if not pad.decode}
        assert decode == ({32} if capture == "first_use" else set(graphs.sizes))
        assert tokens == (set() if capture == "first_use" else set(graphs.tokens))
        outs = engine.generate(items, SamplingParams(), decode=False)
        runs.append({o.request_id: (o.output_token_ids, [lp.top_ids for lp in o.logprobs])
                     for o in outs})  # fmt: skip
    differ = sorted(k for k in runs[1] if runs[0].get(k) != runs[1][k])
    assert not differ and len(runs[0]) == 40, (differ, sorted(engines[0].runner.graphs.graphs))
    lazy = engines[0].runner.graphs
    assert len(lazy.graphs) > 4 and not lazy.eager  # the shrinking batch met several sizes
    assert any(not pad.decode for pad in lazy.graphs)  # a token size met twice


def test_decode_sizes_met_a_few_times_replay_a_larger_graph(model_dir) -> None:
    """first_use: a decode size replays the smallest larger graph captured until its
    CAPTURE_AT_STEP-th step, then its own: tokens equal to an engine without graphs, and only
    sizes met that often (and the largest) are captured."""
    import collections
    import warnings

    from batchgen.engine.graphs import CAPTURE_AT_STEP

    path = model_dir("llama")
    prompts = random_prompts(32, 20, 60, 1000, seed=13)
    # pairs of rows end one step apart (sizes 24, 16 and 8 meet a few steps each), the last
    # four run on long enough for size 4 to reach its capture step
    lengths = [2 + i // 2 for i in range(28)] + [40] * 4
    items = [
        Prompt(p, sampling={"max_new_tokens": n, "ignore_eos": True})
        for p, n in zip(prompts, lengths, strict=True)
    ]
    settings = {"dtype": "float32", "max_num_seqs": 32, "check_model": False}
    params = SamplingParams()
    eager = tokens(cuda_engine(path, cuda_graphs=False, **settings), items, params)
    engine = cuda_engine(path, **settings)
    graphs = engine.runner.graphs
    met, replayed = collections.Counter(), collections.Counter()
    padded_size, replay = graphs.padded_size, graphs.replay

    def chosen(batch):
        pad = padded_size(batch)
        if pad is not None and pad.decode:
            met[graphs._decode_pad(next(s for s in graphs.sizes if s >= len(batch.chunks)))] += 1
        return pad

    def replayed_at(flat, host):
        replayed[host.layout.B] += 1
        return replay(flat, host)

    graphs.padded_size, graphs.replay = chosen, replayed_at
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture that failed would warn
        assert tokens(engine, items, params) == eager
    captured = {pad for pad in graphs.graphs if pad.decode}
    largest = graphs._decode_pad(graphs.sizes[-1])
    assert captured == {p for p, n in met.items() if n >= CAPTURE_AT_STEP} | {largest}
    assert any(n < CAPTURE_AT_STEP for n in met.values())  # a size that never got its graph
    assert replayed[largest.B] > met[largest]  # ... replayed the largest graph instead
    assert met[graphs._decode_pad(4)] >= CAPTURE_AT_STEP  # and one captured between steps


def test_steps_stopped_at_token_sizes_replay_graphs_captured_between_steps(model_dir) -> None:
    """Prompts that arrive as sequences finish: the scheduler stops steps at token sizes
    (step_target), and their graphs, captured between overlapped steps, give the tokens of an
    engine without graphs."""
    import warnings

    path = model_dir("llama")
    prompts = random_prompts(48, 100, 300, 1000, seed=12)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    settings = {
        "dtype": "float32",
        "max_num_seqs": 16,
        "max_num_batched_tokens": 2048,
        "cuda_graph_token_sizes": (256, 512, 1024, 1536, 2048),
        "check_model": False,
    }
    eager = tokens(cuda_engine(path, cuda_graphs=False, **settings), prompts, params)
    engine = cuda_engine(path, **settings)
    steps = []
    schedule = engine.scheduler.schedule

    def recorded():
        steps.append(schedule())
        return steps[-1]

    engine.scheduler.schedule = recorded
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture that failed would warn
        got = tokens(engine, prompts, params)
    assert got == eager
    graphs = engine.runner.graphs
    cut = [b.num_tokens for b in steps if b.num_tokens > 1024 and not b.chunks[-1].samples]
    assert 1536 in cut and set(cut) <= {1536, 2048}, cut
    assert 1536 in {pad.T for pad in graphs.graphs if not pad.decode}  # met twice: captured
    assert not graphs.eager


def test_kv_cache_is_sized_from_free_memory(model_dir) -> None:
    engine = cuda_engine(model_dir("llama"), kv_cache_memory_fraction=0.05, num_kv_blocks=None)
    assert engine.num_blocks > 1000
    assert engine.runner.kv_cache.keys[0].is_cuda


def test_batchgen_run_job_on_gpu(model_dir, tmp_path: Path) -> None:
    from batchgen.job import run_job
    from batchgen.spec import load_spec

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"Item {i} is"}) + "\n" for i in range(50)))
    spec = load_spec(
        None,
        [
            f"model.path={json.dumps(str(model_dir('llama')))}",
            f"input.path={json.dumps(str(inp))}",
            f"output.dir={json.dumps(str(tmp_path / 'out'))}",
            "runtime.quiet=true",
            "runtime.device='cuda'",
            "sampling.max_new_tokens=16",
        ],
    )
    result = run_job(spec)
    assert result.complete and result.summary.rows_ok == 50


def test_sampler_is_capturable_in_a_cuda_graph() -> None:
    """The whole sampling path (penalties, bans, top-k/p, min-p, logprobs) replays in a CUDA
    graph with the same tokens as eager: it needs no host synchronization."""
    from batchgen.engine.sampler import PenaltyState, Sampler
    from batchgen.engine.step_inputs import SamplingFlags
    from tests.test_sampler import inputs

    device = torch.device("cuda")
    rows, vocab = 8, 1000
    sampler = Sampler(vocab, device)
    state = PenaltyState(rows + 1, vocab, device)
    state.counts[:rows, :50] = 1
    s = inputs(
        rows,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition=1.3,
        presence=0.2,
        frequency=0.1,
        track=0,
        logprobs_k=3,
    )
    s = s._replace(slots=torch.arange(rows), bans=torch.tensor([[0, 5], [1, 7]]))
    s = type(s)(*[t.to(device) for t in s])
    flags = SamplingFlags(True, True, True, True, 3)
    logits = torch.randn(rows, vocab, device=device)
    eager, eager_lp = sampler(logits, s, flags, state)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sampler(logits, s, flags, state)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured, captured_lp = sampler(logits, s, flags, state)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) and torch.allclose(captured_lp, eager_lp)


def test_closed_engine_gives_back_its_memory_and_blocks(model_dir) -> None:
    """close() frees the KV cache, graphs and their pool at once (no garbage collection runs
    meanwhile): after the process's one-time start-up (library handles, kernel modules: paid by
    the first engine), every further engine sizes the same cache, and device memory returns to
    where it was after each close."""
    import gc

    path = model_dir("llama")
    gc.collect()  # what earlier tests left behind goes now, not in the middle of this test
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    config = EngineConfig(device="cuda", kv_cache_memory_fraction=0.3)
    blocks, free = [], []
    gc.disable()
    try:
        for _ in range(3):
            engine = Engine(path, config)
            list(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4)))
            blocks.append(engine.num_blocks)
            engine.close()
            free.append(torch.cuda.mem_get_info()[0])
            left = torch.cuda.memory_allocated() - before
            assert left < 64 * 2**20, f"{left / 2**20:.0f} MiB still allocated after close()"
    finally:
        gc.enable()
    assert blocks[1] == blocks[2] and free[1] == free[2], (blocks, free)
    assert blocks[0] - blocks[1] < blocks[0] // 1000, "the first engine's start-up cost is small"


def test_a_callers_model_runs_under_graphs_and_keeps_its_attention(model_dir) -> None:
    from transformers import AutoModelForCausalLM

    path = model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    prompts = random_prompts(6, 3, 40, 1000, seed=5)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = Engine(model, EngineConfig(num_kv_blocks=1024))
    assert engine.runner.graphs is not None and engine.dtype == torch.bfloat16
    got = tokens(engine, prompts, params)
    engine.close()
    own = cuda_engine(path, dtype="bfloat16")
    assert tokens(own, prompts, params) == got
    own.close()
    assert model.config._attn_implementation == "sdpa" and model.dtype == torch.bfloat16
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]], device="cuda"), max_new_tokens=3, pad_token_id=0)


RUNNING_FAMILIES = sorted(f for f in FAMILIES if f not in REFUSED)


@pytest.fixture(scope="module")
def family_dir_gpu(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gpu-families")
    return lambda family: build_family_model(family, root / family)


def engine_or_skip(path: Path, **overrides) -> Engine:
    """A family the installed transformers cannot hand batchgen's attention is refused (a
    one-line BatchgenError, as the CPU tests check); that is not a GPU-path failure."""
    try:
        return cuda_engine(path, **overrides)
    except BatchgenError as exc:
        if "does not route attention" in str(exc):
            pytest.skip(f"refused by this transformers version: {exc}")
        raise


@pytest.mark.parametrize("family", RUNNING_FAMILIES)
def test_family_fp32_through_triton_fused_ops_and_graphs(family_dir_gpu, family: str) -> None:
    """Greedy tokens against HF (eager, fp32, on the GPU) for every family that runs: equal,
    or diverging only where HF's own top two logits are a rounding apart."""
    from transformers import AutoModelForCausalLM

    path = family_dir_gpu(family)
    engine = engine_or_skip(path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    assert type(engine.runner.backend).__name__ == "TritonBackend"
    prompts = random_prompts(8, 3, 80, 256, seed=2)
    got = tokens(engine, prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    engine.close()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").cuda().eval()
    for i, prompt in enumerate(prompts):
        assert_greedy_or_near_tie(model, prompt, got[str(i)], (family, i))


@pytest.mark.parametrize("family", RUNNING_FAMILIES)
def test_family_bf16_logprobs_match_hf_within_bf16_noise(family_dir_gpu, family: str) -> None:
    """Teacher-forced: batchgen's bf16 log-probabilities (Triton, fused ops, graphs) against
    the model's own bf16 forward pass with eager attention."""
    from batchgen.engine.probe import _difference

    engine = engine_or_skip(family_dir_gpu(family), dtype="bfloat16", max_num_seqs=8)
    prompts = [Prompt(p, f"r{i}") for i, p in enumerate(random_prompts(6, 3, 80, 256, seed=4))]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=5)
    outs = {o.request_id: o for o in engine.generate(prompts, params, decode=False)}
    worst = max(_difference(engine, p, outs[p.request_id]) for p in prompts)
    engine.close()
    assert worst < 0.1, (family, worst)


def test_a_refused_model_leaves_no_device_memory(model_dir) -> None:
    """Random weights this wide give bf16 log-probabilities the start-up probe rejects; the
    engine that refuses them frees its KV cache and graphs before the error reaches the caller,
    so a second attempt is refused the same way instead of running out of memory."""
    path = model_dir(
        "llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        with pytest.raises(BatchgenError, match="cannot run llama models exactly"):
            Engine(path, EngineConfig(device="cuda"))
        assert torch.cuda.memory_allocated() - before < 2**28


def test_roofline_figures_are_measured_on_this_gpu_and_leave_its_memory_free() -> None:
    """The bench's roofline divides by this GPU's copy bandwidth and matmul rate: figures of a
    real device (a copy is at most the spec's read + write, a matmul at most dense peak), and
    the buffers timed (1 GiB each for the copy) are given back before the engine sizes its KV
    cache; only cuBLAS's workspace may stay."""
    from batchgen.bench.roof import measure_roof

    reserved = torch.cuda.memory_reserved()
    roof = measure_roof()
    assert 0.1e12 < roof.copy_bandwidth < 10e12
    assert 10e12 < roof.matmul_peak < 2500e12
    assert torch.cuda.get_device_name() in roof.source
    assert torch.cuda.memory_reserved() <= reserved + (64 << 20)
