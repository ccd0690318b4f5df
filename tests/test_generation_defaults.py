"""A model's generation_config.json recommends sampling values (temperature, top_p, top_k,
min_p, repetition_penalty, max_new_tokens): taken where a call or a job sets none of them, as
vLLM's generation_config="auto" takes them; runtime.generation_config = "ignore" keeps
batchgen's own defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchgen import BatchgenError, Engine, EngineConfig, SamplingParams
from batchgen.job import run_job
from tests.test_job import read_rows, spec_for, write_jsonl

RECOMMENDED = {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.3, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def recommending(model_dir, tmp_path_factory) -> Path:
    """The tiny llama with sampling values in its generation_config.json."""
    folder = shutil.copytree(model_dir("llama"), tmp_path_factory.mktemp("gen") / "model")
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **RECOMMENDED, "do_sample": True}))
    return folder


def engine(path: Path, **config: object) -> Engine:
    return Engine(path, EngineConfig(device="cpu", num_kv_blocks=64, **config))


def test_a_call_without_params_takes_the_models_recommended_sampling(recommending) -> None:
    """None: the model's values over batchgen's defaults; a SamplingParams given is used as it
    is (as vLLM's generate uses one); "ignore": batchgen's defaults."""
    prompt = "Tell me about the weather."
    taking = engine(recommending)
    assert taking.generation_defaults == RECOMMENDED
    (out,) = taking.generate([prompt])
    # a fresh engine's first call draws what this one's first did (later calls draw anew)
    (same,) = engine(recommending).generate([prompt], SamplingParams(**RECOMMENDED))
    assert len(out.output_token_ids) <= 6 and out.output_token_ids == same.output_token_ids
    (given,) = taking.generate([prompt], SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert len(given.output_token_ids) == 9
    ignoring = engine(recommending, generation_config="ignore")
    assert ignoring.generation_defaults == {}
    (plain,) = ignoring.generate([prompt], None)
    assert len(plain.output_token_ids) > 6 or plain.finish_reason == "stop"
    (greedy,) = ignoring.generate([prompt], SamplingParams())
    assert plain.output_token_ids == greedy.output_token_ids


def test_a_job_takes_the_recommended_values_its_sampling_does_not_set(
    recommending, tmp_path: Path, capfd
) -> None:
    """[sampling] temperature=0: greedy, with the model's max_new_tokens and penalty; the job
    says which values it took, and records them: a run that would take others (the model's
    file edited, or "ignore") is another job, refused on resume."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(3)])
    out = tmp_path / "out"
    sets = ("sampling.temperature=0", "runtime.quiet=false", "runtime.num_kv_blocks=64")
    assert run_job(spec_for(recommending, inp, out, *sets)).complete
    err = capfd.readouterr().err
    assert (
        "taking the model's generation_config.json values max_new_tokens=6, "
        "repetition_penalty=1.3, top_k=5 where the job does not set them" in err
    ), err
    rows = read_rows(out)
    want = SamplingParams(temperature=0, top_k=5, repetition_penalty=1.3, max_new_tokens=6)
    check = engine(recommending)
    for row in rows:
        (alone,) = check.generate([f"Row {row['index']} says"], want)
        assert row["text"] == alone.text and row["num_generated_tokens"] <= 6
    manifest = json.loads((out / "job.json").read_text())
    taken = {"top_k": 5, "repetition_penalty": 1.3, "max_new_tokens": 6}
    assert manifest["identity"]["settings"]["model.generation_defaults"] == taken
    ignoring = spec_for(recommending, inp, out, *sets, "runtime.generation_config='ignore'")
    with pytest.raises(BatchgenError, match=r"model.generation_defaults changed"):
        run_job(ignoring)
    assert run_job(ignoring, force_resume=True).complete


def test_a_directory_that_took_none_names_the_setting_that_resumes_it_as_it_ran(
    model_dir, recommending, tmp_path: Path
) -> None:
    """A job run with batchgen's defaults (before this was so, or under "ignore"), resumed on
    a model that recommends values: refused, naming runtime.generation_config = "ignore",
    which resumes it as it ran; a model that recommends none resumes such a directory."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(2)])
    out = tmp_path / "out"
    sets = ("sampling.max_new_tokens=3", "runtime.num_kv_blocks=64")
    ignoring = spec_for(recommending, inp, out, *sets, "runtime.generation_config='ignore'")
    assert run_job(ignoring).complete
    manifest = json.loads((out / "job.json").read_text())
    del manifest["identity"]["settings"]["model.generation_defaults"]  # as written before
    (out / "job.json").write_text(json.dumps(manifest))
    with pytest.raises(BatchgenError) as refused:
        run_job(spec_for(recommending, inp, out, *sets))
    assert (
        "the model's generation_config.json values {'repetition_penalty': 1.3, 'temperature': "
        "0.7, 'top_k': 5} are taken now, and the earlier run took none (runtime.generation_config"
        ' = "ignore" runs it as it ran)' in str(refused.value)
    )
    assert run_job(ignoring).complete
    plain = spec_for(model_dir("llama"), inp, tmp_path / "plain", *sets)
    assert run_job(plain).complete
    manifest = json.loads((tmp_path / "plain" / "job.json").read_text())
    del manifest["identity"]["settings"]["model.generation_defaults"]
    (tmp_path / "plain" / "job.json").write_text(json.dumps(manifest))
    assert run_job(plain).complete


def test_sampling_keys_of_an_old_config_json_are_not_taken(model_dir, tmp_path) -> None:
    """A folder without generation_config.json whose config.json carries an old checkpoint's
    generation keys (temperature, top_k, do_sample false): none is taken (Hugging Face's
    AutoConfig and vLLM read none of them): greedy, as Hugging Face generates."""
    folder = shutil.copytree(model_dir("llama"), tmp_path / "model")
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    legacy = {"temperature": 0.7, "top_k": 50, "top_p": 1.0, "do_sample": False}
    (folder / "config.json").write_text(json.dumps({**config, **legacy}))
    loaded = engine(folder)
    assert loaded.generation_defaults == {}
    (out,) = loaded.generate(["Tell me"], None)
    (greedy,) = loaded.generate(["Tell me"], SamplingParams())
    assert out.output_token_ids == greedy.output_token_ids


def test_openai_batch_lines_take_the_models_values_before_openais(
    recommending, tmp_path: Path
) -> None:
    """A line's body that sets no max_tokens gets the model's max_new_tokens, as vLLM's
    run-batch gives it, where OpenAI's defaults would run to the context."""
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "ignore_eos": True}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "ignore_eos": True, "max_tokens": 9}},
    ]  # fmt: skip
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    sets = ("input.format='openai-batch'", "output.format='jsonl'", "runtime.num_kv_blocks=64")
    assert run_job(spec_for(recommending, inp, out, *sets)).complete
    got = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    usage = {x["custom_id"]: x["response"]["body"]["usage"]["completion_tokens"] for x in got}
    assert usage == {"a": 6, "b": 9}


def test_a_recommended_value_no_request_could_take_is_one_line_where_taken(
    model_dir, tmp_path
) -> None:
    """top_p: 0 in the model's file: a call or a job that would take it is refused in one
    line naming the file; one that sets top_p itself runs, as vLLM reads the file."""
    folder = shutil.copytree(model_dir("llama"), tmp_path / "model")
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "top_p": 0.0}))
    loaded = engine(folder)
    with pytest.raises(BatchgenError, match=r"generation_config.json recommends top_p=0.0 must "):
        list(loaded.generate(["Hi"]))
    assert len(list(loaded.generate(["Hi"], SamplingParams(max_new_tokens=2)))) == 1
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    sets = ("sampling.max_new_tokens=2", "runtime.num_kv_blocks=64")
    with pytest.raises(BatchgenError, match=r"recommends top_p=0.0 must .*set the field, or"):
        run_job(spec_for(folder, inp, tmp_path / "o1", *sets))
    assert run_job(spec_for(folder, inp, tmp_path / "o2", *sets, "sampling.top_p=0.9")).complete
    assert engine(folder, generation_config="ignore").generation_defaults == {}


def test_the_python_api_names_its_own_remedy(recommending, tmp_path: Path) -> None:
    """A checkpoint_dir run under "ignore", then with the model's values: refused with the
    API's remedy (another checkpoint_dir), not the command line's --force-resume."""
    datasets = pytest.importorskip("datasets")
    from batchgen import generate

    ds = datasets.Dataset.from_dict({"prompt": ["Hi", "Yo"]})
    options = {"checkpoint_dir": tmp_path / "ck", "progress": False}
    ignoring = EngineConfig(device="cpu", num_kv_blocks=64, generation_config="ignore")
    generate(ds, str(recommending), engine_config=ignoring, **options)
    with pytest.raises(BatchgenError) as refused:
        generate(ds, str(recommending), engine_config=EngineConfig(device="cpu"), **options)
    assert "checkpoint_dir" in str(refused.value) and "--force-resume" not in str(refused.value)


def test_validate_names_the_values_the_run_will_take(recommending, tmp_path: Path) -> None:
    """The printed spec is the job's; validate says which of the model's values the run takes
    beside it (none where the job sets them all, or under "ignore"), and the run says so
    quiet or not."""
    from click.testing import CliRunner

    from batchgen.cli import main

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    base = ["validate", "--model", str(recommending), "--input", str(inp)]
    base += ["--output", str(tmp_path / "out"), "--temperature", "0"]
    result = CliRunner().invoke(main, base)
    assert result.exit_code == 0, result.output
    assert (
        "batchgen: the run takes the model's generation_config.json values max_new_tokens=6, "
        "repetition_penalty=1.3, top_k=5 where the job does not set them" in result.output
    )
    ignoring = CliRunner().invoke(main, [*base, "--set", "runtime.generation_config='ignore'"])
    assert ignoring.exit_code == 0 and "generation_config.json values" not in ignoring.output
    ran = CliRunner().invoke(main, ["run", *base[1:], "--quiet", "--set", "runtime.device='cpu'"])
    assert ran.exit_code == 0, ran.output
    assert "batchgen: taking the model's generation_config.json values" in ran.output
