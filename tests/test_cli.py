"""The command line: user errors end in one line and a non-zero exit, before model work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input", "/nonexistent/x.jsonl"], "does not exist"),
        (["--template", "S: {article}"], "no column 'article'"),
        (["--set", "sampling.temprature=0.5"], "unknown key sampling.temprature"),
        (["--set", "sampling.top_p=0"], "top_p=0.0 must be in (0, 1]"),
        (["--set", "runtime.max_num_seqs='many'"], "runtime.max_num_seqs = 'many'"),
        (
            ["--set", "sampling.max_new_tokens=5", "--set", "sampling .max_new_tokens=6"],
            "sampling.max_new_tokens is given twice (--set 'sampling.max_new_tokens=5' and "
            "--set 'sampling .max_new_tokens=6'): give it once",
        ),
    ],
)
def test_user_errors_are_one_line(
    tmp_path: Path, prompts: Path, extra: list[str], message: str
) -> None:
    args = [
        "run",
        "--model",
        "/nonexistent-model",
        "--input",
        str(prompts),
        "--output",
        str(tmp_path / "out"),
        *extra,
    ]
    code, output = invoke(*args)
    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, output
    assert lines[0].startswith("batchgen: error:") and message in lines[0]
    assert not (tmp_path / "out").exists(), "nothing written before the checks pass"


def test_missing_model_and_busy_output_dir(tmp_path: Path, prompts: Path) -> None:
    code, output = invoke(
        "run",
        "--model",
        str(tmp_path / "nope"),
        "--input",
        str(prompts),
        "--output",
        str(tmp_path / "out"),
    )
    assert code == 2 and "model path" in output and "does not exist" in output
    assert not (tmp_path / "out").exists(), "a typo in the model path claims no output dir"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("x")
    code, output = invoke("run", "--input", str(prompts), "--output", str(busy))
    assert code == 2 and "holds no batchgen job" in output
    (busy / "summary.json").write_text("mine")  # a name a job writes: never written over
    for command in ("validate", "run"):
        code, output = invoke(
            command, "--input", str(prompts), "--output", str(busy), "--force-resume"
        )
        assert code == 2 and "holds no batchgen job" in output, output
        assert "--force-resume adopts only a batchgen job's shards" in output
    assert (busy / "summary.json").read_text() == "mine" and not (busy / "job.json").exists()


def test_a_model_folder_whose_config_is_not_a_json_object_is_one_line(
    tmp_path: Path, prompts: Path, model_dir
) -> None:
    """A damaged or hand-edited config.json: validate and run say so in one line (exit 2),
    before anything reads its fields."""
    import shutil

    for text, why in (("{bad", "is not valid JSON ("), ("[]", "is not a JSON object")):
        model = tmp_path / "model"
        shutil.rmtree(model, ignore_errors=True)
        shutil.copytree(model_dir("llama"), model)
        (model / "config.json").write_text(text)
        for command in ("validate", "run"):
            args = ("--model", str(model), "--input", str(prompts))
            code, output = invoke(command, *args, "--output", str(tmp_path / "out"))
            assert code == 2, output
            assert f"model folder '{model}': config.json {why}" in output
            assert "replace it with the model's own" in output
        assert not (tmp_path / "out").exists()


def test_validate_prints_the_resolved_spec(prompts: Path, tmp_path: Path) -> None:
    code, output = invoke(
        "validate",
        "--input",
        str(prompts),
        "--output",
        str(tmp_path / "o"),
        "--set",
        "sampling.top_k=5",
    )
    assert code == 0
    spec = json.loads(output[: output.rindex("}") + 1])
    assert spec["sampling"]["top_k"] == 5 and spec["sampling"]["top_p"] == 1.0
    assert "ok:" in output and "1 rows" in output


def test_a_job_file_runs_from_any_directory(tmp_path: Path, monkeypatch) -> None:
    """Relative paths in a job file are the file's folder's, not the working directory's."""
    jobs = Path(__file__).resolve().parent.parent / "jobs"
    monkeypatch.chdir(tmp_path)
    code, output = invoke("validate", str(jobs / "demo.toml"))
    assert code == 0, output
    spec = json.loads(output[: output.rindex("}") + 1])
    assert Path(spec["input"]["path"]).resolve() == jobs / "demo_prompts.jsonl"
    assert Path(spec["output"]["dir"]).resolve() == jobs.parent / "out" / "demo"


def test_an_output_dir_under_home_is_written_and_read_there(
    model_dir, tmp_path: Path, prompts: Path, monkeypatch
) -> None:
    """~ in output.dir (an option or a job file) is the home folder, for every file the job
    writes and reads back; never a folder named '~' in the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    common = ["--model", str(model_dir("llama")), "--input", str(prompts), "--max-new-tokens", "2"]
    common += ["--quiet", "--set", "runtime.device='cpu'"]
    for fmt in ("parquet", "jsonl"):
        code, output = invoke("run", *common, "--output", f"~/out-{fmt}", "--output-format", fmt)
        assert code == 0, output
        assert (home / f"out-{fmt}" / f"results.{fmt}").is_file()
        summary = json.loads((home / f"out-{fmt}" / "summary.json").read_text())
        assert summary["complete"] and summary["rows_ok"] == 1
    assert not (work / "~").exists()
    job = tmp_path / "jobs" / "job.toml"
    job.parent.mkdir()
    job.write_text(f'[input]\npath = "{prompts}"\n[output]\ndir = "~/from-job"\n')
    code, output = invoke("validate", str(job))
    assert code == 0, output
    spec = json.loads(output[: output.rindex("}") + 1])
    assert spec["output"]["dir"] == str(home / "from-job")


def test_a_file_url_output_dir_in_a_job_file_is_that_folder(tmp_path: Path, prompts: Path) -> None:
    job = tmp_path / "jobs" / "job.toml"
    job.parent.mkdir()
    target = tmp_path / "elsewhere" / "out"
    job.write_text(f'[input]\npath = "file://{prompts}"\n[output]\ndir = "file://{target}"\n')
    code, output = invoke("validate", str(job))
    assert code == 0, output
    spec = json.loads(output[: output.rindex("}") + 1])
    assert spec["output"]["dir"] == str(target) and spec["input"]["path"] == str(prompts)


def test_validate_refuses_what_run_refuses_before_model_work(
    model_dir, tmp_path: Path, prompts: Path
) -> None:
    """The same one line from `validate` as from `run`, and validate writes nothing."""
    import os

    model = str(model_dir("llama", max_position_embeddings=64))
    base = ["--model", model, "--input", str(prompts), "--max-new-tokens", "2"]
    base += ["--set", "runtime.device='cpu'"]
    done = str(tmp_path / "done")
    assert invoke("run", *base, "--output", done, "--quiet")[0] == 0
    (tmp_path / "notjob").mkdir()
    (tmp_path / "notjob" / "notes.txt").write_text("x")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "out")
    two = tmp_path / "two.jsonl"  # another row before this input's one
    two.write_text(json.dumps({"prompt": "first"}) + "\n" + prompts.read_text())
    longer = ["--input", str(two), "--output", str(tmp_path / "longer"), "--quiet"]
    assert invoke("run", *base, *longer, "--set", "output.shard_rows=1")[0] == 0
    foreign = tmp_path / "foreign"  # `done` with a shard of the longer job's row 1 copied in
    shutil.copytree(done, foreign)
    row_1 = next(
        p for p in (tmp_path / "longer" / "shards").iterdir()
        if pq.read_table(p, columns=["index"])["index"].to_pylist() == [1]
    )  # fmt: skip
    shutil.copy(row_1, foreign / "shards")
    twice = tmp_path / "twice"  # `done` with its shard copied under another name
    shutil.copytree(done, twice)
    (shard,) = (twice / "shards").iterdir()
    shutil.copy(shard, shard.with_name(shard.name.replace("-000", "-900")))
    cases = {
        "does not exist": ["--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o1")],
        "holds no batchgen job": ["--output", str(tmp_path / "notjob")],
        "is a file": ["--output", str(tmp_path / "afile")],
        "afile is a file": ["--output", str(tmp_path / "afile" / "sub")],
        "max_new_tokens changed": ["--output", done, "--max-new-tokens", "3"],
        "holds parquet shards": ["--output", done, "--output-format", "jsonl"],
        "setting runtime.max_model_len changed (64 -> 32)": [
            *("--output", done, "--set", "runtime.max_model_len=32"),
        ],
        "keeps committed rows at their input positions, but 'two.jsonl' now comes where": [
            *("--output", done, "--input", str(two), "--force-resume"),
        ],
        "holds a result for row 1 but the input has 1 rows: a shard in": ["--output", str(foreign)],
        "is committed in two shards": ["--output", str(twice)],
        "dangling is a symbolic link to": ["--output", str(tmp_path / "dangling")],
        "context of 64 tokens": [
            "--output",
            str(tmp_path / "o2"),
            "--set",
            "runtime.max_model_len=65",
        ],
        "needs max_num_batched_tokens (32) >= max_model_len (64)": [
            *("--output", str(tmp_path / "o3"), "--set", "runtime.max_num_seqs=8"),
            *("--set", "runtime.enable_chunked_prefill=false"),
            *("--set", "runtime.max_num_batched_tokens=32"),
        ],
        "num_kv_blocks=2 is too small": [
            *("--output", str(tmp_path / "o4"), "--set", "runtime.num_kv_blocks=2"),
        ],
        "stop_token_ids holds 100000, outside the model's vocabulary": [
            *("--output", str(tmp_path / "o5"), "--set", "sampling.stop_token_ids=[3, 100000]"),
        ],
        "regex cannot be compiled": [
            *("--output", str(tmp_path / "o6"), "--set", "sampling.regex='(ab'"),
        ],
        "json_schema cannot be compiled": [
            *("--output", str(tmp_path / "o7"), "--set", """sampling.json_schema='{"type":"x"}'"""),
        ],
        "matches no text at all": [  # found with the model's tokenizer
            *("--output", str(tmp_path / "o8"), "--set", r"sampling.regex='a[^\s\S]'"),
        ],
        "forces an output of more than 50,000 tokens": [
            *("--output", str(tmp_path / "o9"), "--set"),
            """sampling.json_schema='{"type":"object","properties":{"a":{"$ref":"#"}},"""
            """"required":["a"]}'""",
        ],
        "begins with the BOS token": [
            *("--output", str(tmp_path / "o10"), "--template", "<|begin_of_text|>Q: {prompt}"),
        ],
    }
    if os.geteuid() != 0:  # root writes into a folder without write permission
        (tmp_path / "ro").mkdir(mode=0o500)
        cases["is not writable"] = ["--output", str(tmp_path / "ro" / "out")]
    before = sorted(tmp_path.rglob("*"))
    for message, extra in cases.items():
        args = [*base, *extra]
        code, checked = invoke("validate", *args)
        assert code == 2 and message in checked, (message, checked)
        assert sorted(tmp_path.rglob("*")) == before, "validate writes nothing"
        code, ran = invoke("run", *args, "--quiet")
        assert code == 2 and ran.strip().splitlines()[-1] == checked.strip(), (message, ran)
    code, output = invoke("validate", *base, "--output", done)
    assert code == 0, output
    code, output = invoke("validate", *base, "--output", done, "--max-new-tokens", "3",
                          "--force-resume")  # fmt: skip
    assert code == 0, output


def test_small_user_errors_are_one_line(tmp_path: Path, prompts: Path, monkeypatch) -> None:
    """A shortcut and --set for one key name the option given; an empty column name, a
    negative --top and an unusable BATCHGEN_HOME are refused (exit 2)."""
    base = ["validate", "--input", str(prompts), "--output", str(tmp_path / "o")]
    for option, key in (("--output", "output.dir"), ("--input", "input.path")):
        code, output = invoke(*base, option, str(prompts), "--set", f"{key}='x'")
        assert code == 2 and f"and {option})" in output, output
    code, output = invoke(*base, "--template", "{prompt}", "--set", "prompt.template='{p}'")
    assert code == 2 and "and --template)" in output, output
    for extra in (["--prompt-column", ""], ["--set", "prompt.id_column=''"]):
        code, output = invoke(*base, *extra)
        assert code == 2 and "is empty: give a column name" in output, output
    code, output = invoke("report", str(tmp_path), "--top", "-1")
    assert code == 2 and "-1 is not in the range" in output
    for args, line in (
        (["report", str(prompts)], f"output directory '{prompts}' is not a folder"),
        (["report", str(tmp_path / "gone")], "does not exist: give a job's output directory"),
        (["validate", "/dev/null"], "job file '/dev/null' is not a file: give a TOML job file"),
        (["validate", str(tmp_path / "no.toml")], "no.toml' does not exist: give a TOML job"),
    ):
        code, output = invoke(*args)
        assert code == 2 and output.count("\n") == 1 and line in output, output
    home = tmp_path / "home-is-a-file"
    home.write_text("x")
    monkeypatch.setenv("BATCHGEN_HOME", str(home))
    for args in (["model", "build-default"], ["run", "--input", str(prompts), "--output", "o"]):
        code, output = invoke(*args)
        assert code == 2 and "set BATCHGEN_HOME to a writable folder" in output, output


def test_usage_errors_are_one_line_naming_the_help() -> None:
    """An unknown option or command and a value out of range are one line (exit 2) that says
    what was wrong and which --help to read; no usage block."""
    for args, line in (
        (["run", "--temprature", "1"], "No such option '--temprature'"),
        (["nosuch"], "No such command 'nosuch'"),
        (["run", "--gpus", "0"], "Invalid value for '--gpus': 0 is not in the range x>=1"),
        (["model", "build-default", "--x"], "No such option '--x'"),
    ):
        code, output = invoke(*args)
        assert code == 2 and output.count("\n") == 1, output
        assert output.startswith("batchgen: error: ") and line in output, output
        assert output.rstrip().endswith(" --help)"), output
    code, output = invoke("run", "--help")
    assert code == 0 and "Usage:" in output


def test_validate_does_not_hash_the_input_for_a_new_output(tmp_path: Path, monkeypatch) -> None:
    """A fingerprint (a hash of every input file) matters only against an earlier run's: a
    check of a new output directory does not read a large input whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import batchgen.io.readers as readers

    pq.write_table(pa.table({"prompt": ["hi", "there"]}), tmp_path / "in.parquet")

    def hashed(*args: object, **kwargs: object) -> None:
        raise AssertionError("the input was hashed")

    monkeypatch.setattr(readers, "fingerprint_files", hashed)
    args = ["validate", "--model", "default", "--input", str(tmp_path / "in.parquet")]
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output


def test_ctrl_c_while_the_command_line_imports_is_one_line(tmp_path: Path) -> None:
    """SIGINT that arrives while `batchgen` is still importing its command line (the
    process signals itself as the import starts): one line, exit 130, no traceback."""
    import subprocess
    import sys

    script = (
        "import builtins, os, signal, sys\n"
        "real = builtins.__import__\n"
        "def hooked(name, *args, **kwargs):\n"
        "    if name == 'batchgen.cli':\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = hooked\n"
        "sys.argv = ['batchgen', '--help']\n"
        "from batchgen.__main__ import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "batchgen: interrupted" and not done.stdout, done.stderr


def test_ctrl_c_outside_a_run_does_not_speak_of_rows(
    tmp_path: Path, prompts: Path, monkeypatch
) -> None:
    """A Ctrl-C during `validate` ends it with "interrupted" (exit 130): it has no rows to keep
    or resume."""
    import batchgen.job

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(batchgen.job, "check_job", interrupted)
    code, output = invoke("validate", "--input", str(prompts), "--output", str(tmp_path / "o"))
    assert code == 130 and output.strip() == "batchgen: interrupted", output


def test_under_gpus_only_rank_0_says_a_ctrl_c_stopped_the_command(
    tmp_path: Path, prompts: Path, monkeypatch
) -> None:
    """The ranks `--gpus N` starts share their launcher's terminal: a Ctrl-C before the job
    runs (all of them get it) is said once, by rank 0; every rank exits 130."""
    import batchgen.job
    from batchgen.distributed import LAUNCHED

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(batchgen.job, "check_job", interrupted)
    monkeypatch.setenv(LAUNCHED, "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        code, output = invoke("validate", "--input", str(prompts), "--output", str(tmp_path))
        assert code == 130
        said[rank] = output.strip()
    assert said == {"0": "batchgen: interrupted", "1": ""}


def test_the_stop_line_offers_a_second_ctrl_c_only_after_a_ctrl_c(capsys) -> None:
    """SIGTERM (a scheduler, the launcher of a lost rank) stops after the step in flight; only
    a Ctrl-C's line offers another Ctrl-C to abort."""
    import signal
    import threading

    from batchgen.cli import _stop_on_signals

    lines = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        stop = threading.Event()
        _stop_on_signals(stop, [])._handle(signum, None)
        assert stop.is_set()
        lines.append(capsys.readouterr().err.strip())
    assert lines == [
        "batchgen: stopping after the step in flight",
        "batchgen: stopping after the step in flight (Ctrl-C again to abort)",
    ]


def test_a_flag_and_a_set_of_its_key_name_what_was_typed(tmp_path: Path, prompts: Path) -> None:
    """--quiet with --set runtime.quiet=false: refused naming --quiet, not a --set never typed."""
    base = ["run", "--input", str(prompts), "--output", str(tmp_path / "o")]
    for flag, key in (("--quiet", "runtime.quiet"), ("--profile", "runtime.profile")):
        code, output = invoke(*base, flag, "--set", f"{key}=false")
        assert code == 2, output
        assert output.strip() == (
            f"batchgen: error: {key} is given twice (--set {key}=... and {flag}): give it once"
        )
