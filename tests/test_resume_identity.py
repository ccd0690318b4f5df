"""A resume continues only the same job: same input content, same result-affecting settings,
same model; one run at a time; a damaged checkpoint is repaired or refused, never trusted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen import BatchgenError
from batchgen.io import OutputLayout
from batchgen.io.checkpoint import DirectoryLock
from batchgen.job import Hooks, run_job
from batchgen.models import build_tiny_model
from tests.test_job import read_rows, spec_for, write_jsonl

PROMPTS = [f"Row {i}: say something about the number {i}." for i in range(12)]
SAMPLED = ("sampling.temperature=1.0", "sampling.max_new_tokens=6")


def jsonl_rows(prompts: list[str]) -> list[dict]:
    return [{"uid": f"u{i}", "prompt": p} for i, p in enumerate(prompts)]


@pytest.fixture
def job(model_dir, tmp_path: Path):
    """job(*sets, inp=..., out=..., model=...) -> run_job result of a small sampled job."""
    model = model_dir("llama")
    default_inp = write_jsonl(tmp_path / "in.jsonl", jsonl_rows(PROMPTS))

    def run(
        *sets: str, inp: Path = default_inp, out: Path | None = None, model: Path = model, **kw
    ):
        spec = spec_for(model, inp, out or tmp_path / "out", *SAMPLED, *sets)
        return run_job(spec, **kw)

    return run


def test_changed_input_content_is_refused(job, tmp_path: Path) -> None:
    assert job().complete
    edited = [p.replace("number", "digit") for p in PROMPTS]  # same rows, other text
    write_jsonl(tmp_path / "in.jsonl", jsonl_rows(edited))
    with pytest.raises(BatchgenError, match=r"the input changed \('in.jsonl'.*--force-resume"):
        job()
    forced = job(force_resume=True)  # on purpose: keeps the old rows, as --force-resume says
    assert forced.complete and forced.summary.run_rows_ok == 0


def test_force_resume_refuses_an_input_whose_rows_moved(job, tmp_path: Path) -> None:
    """--force-resume keeps committed rows at their input positions: a row inserted before
    them (another id at a committed position), an input shorter than the committed rows, or a
    file put before the earlier one would leave a row without its result and give another
    two, so each is refused before any row is written; an edit in place or rows added at the
    end go on (the old rows stay)."""
    out = tmp_path / "out"
    ids = ("prompt.id_column='uid'",)
    stop = StopAfterShards(out, 1, rows=4)
    first = job(*ids, "output.shard_rows=2", stop=stop, hooks=stop.hooks)
    assert not first.complete and first.summary.rows_committed_total >= 2
    before = sorted(p.name for p in (out / "shards").iterdir())
    shifted = [{"uid": "new", "prompt": "Inserted first."}, *jsonl_rows(PROMPTS)]
    write_jsonl(tmp_path / "in.jsonl", shifted)
    with pytest.raises(BatchgenError, match=r"keeps committed rows at their input positions, "
                       r"but input row 0 now has id 'new' and its committed result is for id "
                       r"'u0' \(rows were inserted or removed\)"):  # fmt: skip
        job(*ids, force_resume=True)
    with pytest.raises(BatchgenError, match=r"the input changed"):  # the refusal kept the record
        job(*ids)
    write_jsonl(tmp_path / "in.jsonl", jsonl_rows(PROMPTS[:1]))
    with pytest.raises(BatchgenError, match=r"the input now has 1 rows and row \d+ is committed"):
        job(*ids, force_resume=True)
    assert sorted(p.name for p in (out / "shards").iterdir()) == before, "nothing written"
    folder = tmp_path / "parts"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", jsonl_rows(PROMPTS))
    assert job(inp=folder, out=tmp_path / "parts-out").complete
    write_jsonl(folder / "a.jsonl", [{"uid": "x", "prompt": "Sorted before b."}])
    with pytest.raises(BatchgenError, match=r"'a.jsonl' now comes where 'b.jsonl' came"):
        job(inp=folder, out=tmp_path / "parts-out", force_resume=True)
    edited = [p.replace("number", "digit") for p in PROMPTS]  # in place: positions kept
    write_jsonl(tmp_path / "in.jsonl", jsonl_rows([*edited, "Row 12: one more."]))
    forced = job(*ids, force_resume=True)
    assert forced.complete
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [f"u{i}" for i in range(len(PROMPTS) + 1)]


def test_a_streamed_input_whose_row_changed_is_refused_leaving_the_directory_as_it_was(
    model_dir, tmp_path: Path
) -> None:
    """An input without a fingerprint (a streamed IterableDataset) is read again row by row on
    resume: a changed row is refused before the directory changes (the result file and the
    manifest stay, with --force-resume and a new setting too), so the next runs are checked
    against the same record; the rows restored, the job resumes as it was."""
    datasets = pytest.importorskip("datasets")
    from batchgen.io import dataset_source

    def source(prompts: list[str]):
        rows = datasets.Dataset.from_dict({"prompt": prompts}).to_iterable_dataset()
        return dataset_source(rows, 4, "stream")

    out = tmp_path / "out"

    def run(prompts: list[str], *sets: str, **kw):
        spec = spec_for(model_dir("llama"), tmp_path / "unused.jsonl", out, *SAMPLED, *sets)
        return run_job(spec, source=source(prompts), **kw)

    assert run(PROMPTS).complete
    kept = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    edited = [*PROMPTS[:1], "Row 1: another text.", *PROMPTS[2:]]
    for sets, force in (((), False), (("sampling.max_new_tokens=7",), True)):
        with pytest.raises(BatchgenError, match="input row 1 is not the row the output directory"):
            run(edited, *sets, force_resume=force)
        now = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert {k: v for k, v in now.items() if k != "job.lock"} == {
            k: v for k, v in kept.items() if k != "job.lock"
        }, "nothing changed"
    with pytest.raises(BatchgenError, match=r"sampling.max_new_tokens changed \(6 -> 7\)"):
        run(PROMPTS, "sampling.max_new_tokens=7")  # the manifest still records 6
    resumed = run(PROMPTS)
    assert resumed.complete and resumed.summary.run_rows_ok == 0


def test_the_input_change_names_the_file_added_gone_or_edited() -> None:
    """Files are compared by name first: one added before the others, or one removed, is
    named as such, not as the file that now sits in its place in read order."""
    from batchgen.io.checkpoint import describe_input_change

    def files(*entries: tuple[str, int, str]) -> dict:
        return {
            "kind": "files",
            "files": [dict(zip(("name", "size", "sha256"), e, strict=True)) for e in entries],
        }

    b, c = ("b.jsonl", 3040, "bb"), ("c.jsonl", 1545, "cc")
    assert describe_input_change(files(b, c), files(("a.jsonl", 10, "aa"), b, c)) == (
        "1 file(s) added: 'a.jsonl'"
    )
    assert describe_input_change(files(b, c), files(c)) == "1 file(s) gone: 'b.jsonl'"
    assert describe_input_change(files(b, c), files(("a.jsonl", 10, "aa"), c)) == (
        "1 file(s) added: 'a.jsonl'; 1 file(s) gone: 'b.jsonl'"
    )
    edited = ("c.jsonl", 1545, "c2")
    assert describe_input_change(files(b, c), files(("a.jsonl", 1, "a"), b, edited)) == (
        "'c.jsonl': same size, other content"
    )
    renamed = ("x.jsonl", 3041, "b2"), ("y.jsonl", 1545, "cc")  # and one of them edited
    assert describe_input_change(files(b, c), files(*renamed)) == (
        "2 file(s) added: 'x.jsonl' ...; 2 file(s) gone: 'b.jsonl' ..."
    )


def test_a_row_inserted_at_the_top_is_refused(job, tmp_path: Path) -> None:
    assert job().complete
    write_jsonl(tmp_path / "in.jsonl", [{"uid": "new", "prompt": "first!"}, *jsonl_rows(PROMPTS)])
    with pytest.raises(BatchgenError, match="the input changed"):
        job()
    assert len(read_rows(tmp_path / "out")) == 12, "the output was not touched"


def test_changed_parquet_input_is_refused(job, tmp_path: Path) -> None:
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), inp)
    assert job(inp=inp).complete
    pq.write_table(pa.table({"prompt": list(reversed(PROMPTS))}), inp)
    with pytest.raises(BatchgenError, match="the input changed"):
        job(inp=inp)


def test_the_same_input_under_another_spelling_or_copy_resumes(
    job, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert job(inp=Path("in.jsonl")).complete
    assert job(inp=Path("./in.jsonl")).complete
    shutil.copy(tmp_path / "in.jsonl", tmp_path / "copy.jsonl")  # new mtime, same content
    again = job(inp=tmp_path / "copy.jsonl")
    assert again.complete and again.summary.resumed and again.summary.run_rows_ok == 0


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("runtime.seed=1", "runtime.seed"),
        ("runtime.dtype='bfloat16'", "runtime.dtype"),
        ("runtime.max_model_len=64", "runtime.max_model_len"),
        ("runtime.kv_cache_dtype='fp8'", "runtime.kv_cache_dtype"),  # refused before loading
        ("runtime.quantization='fp8'", "runtime.quantization"),
        ("sampling.top_p=0.5", "sampling.top_p"),
        ("prompt.template='Q: {prompt}'", "prompt.template"),
        ("output.include_token_ids=true", "output.include_token_ids"),
    ],
)
def test_a_result_affecting_setting_is_part_of_the_identity(
    job, tmp_path: Path, change: str, key: str
) -> None:
    stopped = job(
        "runtime.max_num_seqs=2", "output.shard_rows=2", **stop_after_shards(tmp_path / "out", 2)
    )
    assert not stopped.complete
    with pytest.raises(BatchgenError, match=rf"setting {key} changed"):
        job(change)


def test_another_output_format_is_refused_even_with_force(job, tmp_path: Path) -> None:
    """The final file is merged from the job's format's shards: a resume in another format,
    forced or not, would leave the other format's rows out of it while saying complete."""
    stopped = job(
        "runtime.max_num_seqs=2",
        "output.shard_rows=2",
        "output.format='jsonl'",
        **stop_after_shards(tmp_path / "out", 2),
    )
    assert not stopped.complete
    for force in (True, False):
        with pytest.raises(BatchgenError, match=r"holds jsonl shards: set output.format to jsonl"):
            job("output.format='parquet'", force_resume=force)
    assert not (tmp_path / "out" / "results.parquet").exists()
    result = job("output.format='jsonl'", force_resume=True)
    assert result.complete and len(read_rows(tmp_path / "out")) == len(PROMPTS)


def test_a_setting_an_older_manifest_lacks_is_named_not_guessed(job, tmp_path: Path) -> None:
    """A result-affecting setting added to the identity later: an earlier run's manifest does
    not say which value it ran with, so resuming it is refused (--force-resume keeps it)."""
    assert not job(
        "runtime.max_num_seqs=2", "output.shard_rows=2", **stop_after_shards(tmp_path / "out", 2)
    ).complete
    manifest = tmp_path / "out" / "job.json"
    data = json.loads(manifest.read_text())
    del data["identity"]["settings"]["runtime.kv_cache_dtype"]
    manifest.write_text(json.dumps(data))
    with pytest.raises(BatchgenError, match=r"runtime\.kv_cache_dtype was not recorded"):
        job()
    assert job(force_resume=True).complete


def test_settings_that_cannot_change_a_row_may_change(job, tmp_path: Path) -> None:
    assert not job(
        "runtime.max_num_seqs=2", "output.shard_rows=2", **stop_after_shards(tmp_path / "out", 2)
    ).complete
    sets = ("runtime.max_num_seqs=5", "runtime.max_num_batched_tokens=300", "runtime.block_size=8")
    result = job(*sets, "runtime.tokenizer_threads=1", "output.shard_rows=3")
    assert result.complete and result.summary.resumed


def test_a_rebuilt_model_at_the_same_path_is_refused(job, tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", seed=0)
    assert job(model=model).complete
    shutil.rmtree(model)
    build_tiny_model(tmp_path / "model", seed=1)  # same config and tokenizer, other weights
    with pytest.raises(BatchgenError, match=r"the model changed \(weights_checksum differ\)"):
        job(model=model)
    copy = tmp_path / "copy"
    build_tiny_model(copy, seed=1)  # the same weights elsewhere: the same model
    assert job(model=copy, force_resume=True).complete
    assert job(model=model).complete


def test_a_model_with_one_weight_edited_is_refused(job, tmp_path: Path) -> None:
    """Every element of every weight counts (here one element of the embedding, away from
    any evenly spaced sample of it)."""
    import torch
    from safetensors.torch import load_file, save_file

    model = build_tiny_model(tmp_path / "model", seed=0)
    assert job(model=model).complete
    weights = load_file(model / "model.safetensors")
    name = next(k for k in weights if "embed_tokens" in k)
    flat = weights[name].view(-1)
    spot = 1 + flat.numel() // 127  # between two of 64 evenly spaced elements
    flat[spot] = flat[spot] + torch.tensor(0.5, dtype=flat.dtype)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BatchgenError, match=r"the model changed \(weights_checksum differ\)"):
        job(model=model)


@pytest.mark.parametrize(
    "edit",
    ["split_special_tokens", "clean_up_tokenization_spaces", "bos_and_pad_swapped"],
)
def test_a_tokenizer_setting_edited_in_the_model_folder_is_refused(
    job, tmp_path: Path, edit: str
) -> None:
    """Settings in tokenizer_config.json that change a prompt's ids or an output's text (special
    tokens' text split into pieces, spaces before punctuation dropped, another token rendered
    for {{ bos_token }}) make another model: a resume would mix rows of both."""
    model = build_tiny_model(tmp_path / "model", seed=0)
    assert job(model=model).complete
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if edit == "bos_and_pad_swapped":
        config["bos_token"], config["pad_token"] = config["pad_token"], config["bos_token"]
    else:
        config[edit] = True
    config_path.write_text(json.dumps(config))
    with pytest.raises(BatchgenError, match=r"the model changed \(tokenizer_settings differ\)"):
        job(model=model)


def test_a_model_fingerprint_from_an_older_batchgen_asks_for_force_resume(
    job, tmp_path: Path
) -> None:
    assert job().complete
    manifest = tmp_path / "out" / "job.json"
    data = json.loads(manifest.read_text())
    model = data["identity"]["model"]
    model["weights"] = model.pop("weights_checksum")[:16]  # as an older batchgen recorded it
    del model["tokenizer_settings"]  # which older ones did not record
    manifest.write_text(json.dumps(data))
    match = r"recorded by an older batchgen.*tokenizer_settings and weights_checksum.*--force"
    with pytest.raises(BatchgenError, match=match):
        job()
    assert job(force_resume=True).complete
    assert job().complete  # the manifest now holds this batchgen's fingerprint


def test_two_runs_cannot_write_one_directory(job, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with (
        DirectoryLock(OutputLayout(out)),
        pytest.raises(BatchgenError, match=rf"in use by another batchgen run \(pid {os.getpid()}"),
    ):
        job()
    assert job().complete  # released


def test_a_lock_left_by_a_dead_process_is_taken_over(job, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "job.lock").write_text(json.dumps({"pid": 999999, "host": "elsewhere"}))
    assert job().complete
    assert not (out / "job.lock").exists()


def test_a_second_cli_run_exits_with_one_line(model_dir, tmp_path: Path) -> None:
    model = model_dir("llama")
    inp = write_jsonl(tmp_path / "in.jsonl", jsonl_rows(PROMPTS * 400))  # runs for minutes
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "batchgen", "run", "--model", str(model), "--input", str(inp)]
    cmd += ["--output", str(out), "--quiet", "--set", "runtime.device='cpu'"]
    cmd += ["--set", "sampling.max_new_tokens=128", "--set", "sampling.ignore_eos=true"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while not (out / "job.json").exists() and first.poll() is None:
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[1][-2000:]
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first run still holds the directory"
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "in use by another batchgen run" in lines[0], second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)


def test_a_failed_model_load_leaves_the_output_untouched(job, model_dir, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = tmp_path / "out"
    with pytest.raises(BatchgenError, match="could not load model"):
        job(model=broken)
    assert not out.exists(), "nothing claimed"
    out.mkdir()
    with pytest.raises(BatchgenError, match="could not load model"):
        job(model=broken)
    assert list(out.iterdir()) == [], "an existing empty directory stays empty"
    assert job().complete  # the corrected rerun works


def test_a_damaged_manifest_is_refused_then_adopted_with_force(job, tmp_path: Path) -> None:
    assert not job(
        "output.shard_rows=2", "runtime.max_num_seqs=2", **stop_after_shards(tmp_path / "out", 2)
    ).complete
    manifest = tmp_path / "out" / "job.json"
    for damage in (b"", b"{not json", b'{"spec": 1}', b'{"version": 2, "spec": {}}'):
        manifest.write_bytes(damage)
        with pytest.raises(BatchgenError, match=r"job.json cannot be used .*--force-resume"):
            job()
    manifest.unlink()
    with pytest.raises(BatchgenError, match=r"holds shards but no job\.json"):
        job()
    result = job(force_resume=True)
    assert result.complete
    rows = read_rows(tmp_path / "out")
    assert [r["index"] for r in rows] == list(range(12))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_damaged_shard_is_regenerated_exactly(job, tmp_path: Path, fmt: str) -> None:
    sets = ("prompt.id_column='uid'", f"output.format='{fmt}'", "runtime.seed=3")
    reference = job(*sets, out=tmp_path / "ref")
    assert reference.complete
    expected = {r["id"]: r["text"] for r in read_rows(tmp_path / "ref")}
    assert job(*sets, "output.shard_rows=3").complete
    out = tmp_path / "out"
    shards = sorted((out / "shards").glob("part-*"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])  # truncated
    shards[2].unlink()  # deleted
    (out / f"results.{fmt}").unlink()
    result = job(*sets, "output.shard_rows=3")
    assert result.complete and result.summary.run_rows_ok == 6 and result.summary.rows_ok == 12
    rows = read_rows(out)
    assert [r["id"] for r in rows] == [f"u{i}" for i in range(12)]
    assert {r["id"]: r["text"] for r in rows} == expected
    assert (out / "damaged" / shards[1].name).exists()


def test_derived_seeds_follow_the_row_id_not_its_position(job, tmp_path: Path) -> None:
    """A seeded job gives the same text for an id wherever the row is in the input."""
    rows = jsonl_rows(PROMPTS)
    assert job("prompt.id_column='uid'", "runtime.seed=7", out=tmp_path / "a").complete
    mixed = [{"uid": "x1", "prompt": "an extra row"}, *reversed(rows), {"uid": "x2", "prompt": "z"}]
    other = write_jsonl(tmp_path / "mixed.jsonl", mixed)
    assert job("prompt.id_column='uid'", "runtime.seed=7", inp=other, out=tmp_path / "b").complete
    first = {r["id"]: r["text"] for r in read_rows(tmp_path / "a")}
    second = {r["id"]: r["text"] for r in read_rows(tmp_path / "b")}
    assert all(first[uid] == second[uid] for uid in first)
    assert len(set(first.values())) > 6, "sampled texts differ between rows"


def test_result_files_of_any_jobs_concatenate(job, tmp_path: Path) -> None:
    """One fixed schema: the error column is a string column also when no row failed."""
    assert job(out=tmp_path / "clean").complete
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"uid": "a", "prompt": "hi"}, {"uid": "b"}])
    assert job(inp=bad, out=tmp_path / "bad").complete
    clean = pq.read_table(tmp_path / "clean" / "results.parquet")
    failed = pq.read_table(tmp_path / "bad" / "results.parquet")
    assert clean.schema == failed.schema and clean.schema.field("error").type == pa.string()
    assert pa.concat_tables([clean, failed]).num_rows == 14
    import pyarrow.dataset as pads

    files = [str(tmp_path / d / "results.parquet") for d in ("clean", "bad")]
    assert pads.dataset(files).to_table().num_rows == 14


def stop_after_shards(out: Path, count: int) -> dict:
    """run_job arguments that stop a job of shards of 2 rows after `count` shards."""
    stop = StopAfterShards(out, count, rows=2 * count)
    return {"stop": stop, "hooks": stop.hooks}


class StopAfterShards(threading.Event):
    """A job's stop event that sets itself once `count` shards are committed in `out`. Pass
    its hooks too: they hold back the rows past the first `rows`, so that the job cannot have
    finished every row before it stops (a stop after that leaves the job complete)."""

    def __init__(self, out: Path, count: int, rows: int = 4) -> None:
        super().__init__()
        self.shards, self.count = out / "shards", count
        self.hooks = Hooks(admit=lambda index: index < rows)

    def is_set(self) -> bool:
        if not super().is_set() and len(list(self.shards.glob("part-*"))) >= self.count:
            self.set()
        return super().is_set()


def test_a_result_file_is_never_left_beside_rows_it_lacks(job, tmp_path: Path) -> None:
    """A completed job's result file, then the input grows and a --force-resume run stops
    part way: the old result file (without the new rows) is gone, not left looking whole;
    the run that completes the job writes it again with every row."""
    out = tmp_path / "out"
    assert job("output.format='jsonl'").complete
    assert len((out / "results.jsonl").read_text().splitlines()) == len(PROMPTS)
    grown = [*PROMPTS, *(f"Row {i}: one more." for i in range(len(PROMPTS), 30))]
    write_jsonl(tmp_path / "in.jsonl", jsonl_rows(grown))
    stop = StopAfterShards(out, 1, rows=len(PROMPTS) + 4)
    forced = job(
        "output.format='jsonl'", "output.shard_rows=2", force_resume=True, stop=stop,
        hooks=stop.hooks,
    )  # fmt: skip
    assert not forced.complete and forced.result_file is None
    assert not (out / "results.jsonl").exists()
    assert job("output.format='jsonl'", "output.shard_rows=2").complete
    assert len((out / "results.jsonl").read_text().splitlines()) == len(grown)


def test_an_input_without_fingerprint_is_checked_row_by_row(model_dir, tmp_path: Path) -> None:
    """A streamed source (an IterableDataset here, a hub stream in a job) has no fingerprint up
    front: each committed row's input hash is compared before anything is generated."""
    datasets = pytest.importorskip("datasets")
    from batchgen.io import dataset_source

    def source(prompts: list[str]):
        ds = datasets.Dataset.from_dict({"prompt": prompts}).to_iterable_dataset()
        return dataset_source(ds, 4, "stream")

    model = model_dir("llama")
    out = tmp_path / "out"
    spec = spec_for(model, tmp_path / "unused", out, *SAMPLED, "output.shard_rows=2")
    first = run_job(spec, source=source(PROMPTS), **stop_after_shards(out, 2))
    assert not first.complete
    changed = [f"{p} (edited)" for p in PROMPTS]
    with pytest.raises(BatchgenError, match=r"input row \d+ is not the row"):
        run_job(spec, source=source(changed))
    assert run_job(spec, source=source(PROMPTS)).complete
    assert [r["index"] for r in read_rows(out)] == list(range(12))
