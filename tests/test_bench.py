"""The benchmark's CPU-side parts: the roofline bound with prefix reuse, the table, the CLI."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from batchgen.bench import run
from batchgen.bench.roof import H200_REFERENCE, DeviceRoof
from batchgen.bench.run import table
from batchgen.bench.systems import CudaTimeline, RunResult, batchgen_name, idle_breakdown
from batchgen.bench.workloads import SHAPES, WORKLOADS, roofline_seconds
from batchgen.cli import main
from batchgen.engine import EngineConfig


def bound(shape: str, workload: str, reuse: bool) -> float:
    w = WORKLOADS[workload]
    lens = [len(p) for p in w.prompts(SHAPES[shape].vocab)]
    return roofline_seconds(SHAPES[shape], lens, w.output_tokens, w.shared_prefix if reuse else 0)


def test_bound_without_reuse_is_the_recorded_one() -> None:
    """The bounds benchmarks/RESULTS.md printed before reuse was counted."""
    assert bound("8b", "W1", reuse=True) == pytest.approx(3.41, abs=0.005)
    assert bound("1b", "W4", reuse=False) == pytest.approx(5.25, abs=0.005)


def test_reuse_computes_the_shared_prefix_once() -> None:
    shape = SHAPES["1b"]
    one = roofline_seconds(shape, [1200], 16)
    assert roofline_seconds(shape, [1200], 16, shared_prefix=1024) == pytest.approx(one)
    # n copies of a prompt: the prefill of one, then only each copy's own 176 tokens
    many = roofline_seconds(shape, [1200] * 8, 0, shared_prefix=1024)
    alone = roofline_seconds(shape, [1200], 0) + 7 * (
        roofline_seconds(shape, [1200], 0) - roofline_seconds(shape, [1024], 0)
    )
    assert many == pytest.approx(alone)
    assert bound("1b", "W4", reuse=True) < 0.5 * bound("1b", "W4", reuse=False)


def test_bound_divides_by_the_device_figures_given() -> None:
    """Half the bandwidth doubles each bandwidth-bound decode step; half the matmul rate
    doubles the prefill and leaves bandwidth-bound steps as they were."""
    shape, lens = (
        SHAPES["8b"],
        [300] * 4,
    )  # 4 rows: every decode step reads far more than it computes
    ref = H200_REFERENCE
    slow_copy = DeviceRoof(ref.copy_bandwidth / 2, ref.matmul_peak, "half the bandwidth")
    slow_mm = DeviceRoof(ref.copy_bandwidth, ref.matmul_peak / 2, "half the matmul rate")
    prefill = roofline_seconds(shape, lens, 0)
    decode = roofline_seconds(shape, lens, 64) - prefill
    assert roofline_seconds(shape, lens, 0, roof=slow_mm) == pytest.approx(2 * prefill)
    assert roofline_seconds(shape, lens, 64, roof=slow_copy) == pytest.approx(prefill + 2 * decode)
    assert roofline_seconds(shape, lens, 64, roof=slow_mm) == pytest.approx(2 * prefill + decode)
    assert roofline_seconds(shape, lens, 64) == roofline_seconds(shape, lens, 64, roof=ref)


def test_table_names_its_figures_and_the_reference_share() -> None:
    report = {
        "shape": "8b",
        "workload": "W1",
        "requests": 1,
        "roofline_s": 3.0,
        "rooflines": {"bf16": 3.0, "fp8": 2.0},
        "roof": "NVIDIA H100 80GB HBM3, measured: device copy 3.00 TB/s, bf16 matmul 700 TFLOP/s",
        "reference_rooflines": {"bf16": 2.0, "fp8": 1.5},
        "infos": {},
        "results": [
            result("batchgen overlapped", [[1, 2]], 4.0, None),
            result("batchgen overlapped [fp8]", [[1, 2]], 3.0, None),
            result("HF generate", [[1, 2]], 40.0, None),
        ],
    }
    text = table(report)
    assert text.splitlines()[0] == f"8b W1 (1 requests), roofline 3.00 s ({report['roof']})"
    assert "| batchgen overlapped | 0 | 10.00x | 75.0% |" in text
    assert "| batchgen overlapped [fp8] | 1 | 13.33x | 66.7% |" in text
    line = next(x for x in text.splitlines() if "reference" in x)
    assert line == (
        "- of roofline at the H200 reference: device copy 4.25 TB/s, bf16 matmul 790 TFLOP/s: "
        "batchgen overlapped 50.0%; batchgen overlapped [fp8] 50.0%"
    )


def result(name: str, tokens: list[list[int]], seconds: float, hits: float | None) -> RunResult:
    return RunResult(name, seconds, sum(map(len, tokens)), tokens, [], None, hits)


def test_table_shows_hit_rates_and_compares_cache_on_and_off() -> None:
    report = {
        "shape": "1b",
        "workload": "W4",
        "requests": 2,
        "roofline_s": 1.0,
        "infos": {},
        "results": [
            result("batchgen overlapped", [[1, 2], [3]], 2.0, 0.75),
            result("batchgen overlapped, no prefix cache", [[1, 2], [3]], 4.0, 0.0),
        ],
    }
    text = table(report)
    assert "| batchgen overlapped | 2 | - | 50.0% | - | - | 75.0% |" in text
    assert "| batchgen overlapped, no prefix cache | 1 | - | 25.0% | - | - | 0.0% |" in text
    assert "prefix cache on == off tokens: True; speed-up 2.00x" in text


def test_prefix_caching_given_twice_is_one_line_error() -> None:
    args = ["bench", "--prefix-caching", "both", "--set", "runtime.enable_prefix_caching=false"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2
    assert "give one" in out.output and len(out.output.strip().splitlines()) == 1


def test_the_results_file_is_checked_before_the_run_and_its_folder_made_after(
    monkeypatch, tmp_path
) -> None:
    """Run outside the repository (no benchmarks/ folder): the table is printed and recorded,
    the folder made; a --results that cannot be written is refused before the run, which
    never starts."""
    import batchgen.bench.run as bench_run

    ran: list[str] = []
    monkeypatch.setattr(bench_run, "run_job_bench", lambda *a: ran.append("job") or "| table |")
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(main, ["bench", "--job", "8"])
    assert out.exit_code == 0, out.output
    assert (
        "| table |" in out.output
        and "| table |" in (tmp_path / "benchmarks" / "RESULTS.md").read_text()
    )
    (tmp_path / "afile").write_text("x")
    refused = CliRunner().invoke(main, ["bench", "--job", "8", "--results", "afile/r.md"])
    assert refused.exit_code == 2 and ran == ["job"], refused.output
    assert (
        refused.output.strip()
        == "batchgen: error: --results 'afile/r.md' cannot be written: give another file"
    )


def test_fp8_lines_compare_kv_capacity_in_tokens() -> None:
    """Blocks may differ in size between precisions (64 tokens for an FP8 cache on Hopper):
    the capacity compares in tokens."""
    infos = {
        "overlap": {"kv_blocks": 1000, "kv_block_size": 16, "kv_tokens": 16000},
        "overlap [fp8-kv]": {"kv_blocks": 520, "kv_block_size": 64, "kv_tokens": 33280},
    }
    line = run._kv_capacity(infos, "fp8-kv")
    assert line == "overlap [fp8-kv] KV cache 33,280 tokens (520 blocks of 64), 2.08x bf16's"


def test_both_runs_each_loop_with_and_without_the_cache(monkeypatch) -> None:
    seen: list[EngineConfig] = []

    def fake_run(model, prompts, output_tokens, config):
        seen.append(config)
        return result(batchgen_name(config), [[1]], 1.0, 0.5), {"kv_blocks": 1}

    monkeypatch.setattr(run, "run_batchgen", fake_run)
    config = EngineConfig(device="cpu", enable_prefix_caching=False)
    results, infos = run._run_systems(None, [[1, 2]], 1, ("overlap", "sync"), config, (True, False))
    assert [(c.overlap, c.enable_prefix_caching) for c in seen] == [
        (True, True),
        (True, False),
        (False, True),
        (False, False),
    ]
    assert [r.system for r in results] == [
        "batchgen overlapped", "batchgen overlapped, no prefix cache",
        "batchgen synchronous", "batchgen synchronous, no prefix cache",
    ]  # fmt: skip
    assert list(infos) == ["overlap", "overlap, no prefix cache", "sync", "sync, no prefix cache"]


class _At:
    """A stand-in CUDA event recorded at time t (ms)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: _At) -> float:
        return other.t - self.t


def test_idle_breakdown_puts_each_gap_where_it_falls() -> None:
    timeline = CudaTimeline()
    timeline.opened, timeline.closed = _At(0), _At(40)
    timeline.steps = [  # (start, end, graphed): two eager steps, then three graphed ones
        (_At(2), _At(10), False),
        (_At(11), _At(20), False),
        (_At(24), _At(27), True),
        (_At(27.5), _At(30), True),
        (_At(31), _At(33), True),
    ]
    idle = idle_breakdown(timeline)
    assert idle == {
        "before_first_step": 2.0,
        "next_to_other_steps": 5.0,  # 10 -> 11 and 20 -> 24
        "between_decode_steps": 1.5,  # 27 -> 27.5 and 30 -> 31
        "after_last_step": 7.0,
    }
    busy = sum(start.elapsed_time(end) for start, end, _ in timeline.steps)
    assert busy + sum(idle.values()) == 40  # the run's span, all of it accounted for
    assert idle_breakdown(CudaTimeline()) == {}  # nothing recorded: nothing to split


def test_job_path_rows_split_steps_into_decode_graphs_token_graphs_and_eager() -> None:
    from batchgen.bench.job_path import _result, table

    report = {  # CudaTimeline.report()'s: 12 steps not decode-graphed, 9 at token sizes
        "gpu_idle_share": 0.01,
        "first_launch": 1.5,
        "last_launch": 9.0,
        "busy_s": 7.0,
        "graphed_steps": 30,
        "other_steps": 12,
        "token_graph_steps": 9,
        "idle_ms": {"before_first_step": 1.0},
    }
    row = _result("engine alone (token ids)", 1.0, 10.0, 900, report)
    assert (row.graphed_steps, row.token_graph_steps, row.eager_steps) == (30, 9, 3)
    assert "| 30 / 9 / 3 |" in table("1b", 10, 90, [row], 32000)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--new-tokens", "5"], "--new-tokens goes with --job"),
        (["--job", "8", "--systems", "sync"], "--systems does not apply to --job"),
        (["--job", "8", "--precisions", "fp8"], "--precisions does not apply to --job"),
        (["--job", "8", "--prefix-caching", "on"], "--prefix-caching does not apply to --job"),
        (["--job", "8", "--requests", "3"], "--requests does not apply to --job"),
        (["--systems", ","], "no system in ','"),
        (["--results", ""], "--results is empty"),
    ],
)
def test_bench_options_it_would_not_use_are_refused_before_the_run(
    monkeypatch, args: list[str], line: str
) -> None:
    """An option the chosen bench ignores, no system at all, or an empty --results: one line,
    and nothing runs."""
    import batchgen.bench.run as bench_run

    ran: list[str] = []
    monkeypatch.setattr(bench_run, "run_job_bench", lambda *a: ran.append("job") or "| t |")
    monkeypatch.setattr(bench_run, "run_bench", lambda *a: ran.append("loops") or {})
    out = CliRunner().invoke(main, ["bench", *args])
    assert out.exit_code == 2 and not ran, out.output
    assert len(out.output.strip().splitlines()) == 1 and line in out.output, out.output


@pytest.mark.parametrize("option", ["--requests", "--job", "--new-tokens"])
def test_bench_counts_below_one_are_refused(option: str) -> None:
    args = ["bench", option, "0"] + (["--job", "8"] if option == "--new-tokens" else [])
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2 and "x>=1" in out.output, out.output
