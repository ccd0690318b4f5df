"""Job specs: what a job file, --set and the shortcut options may say, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen import BatchgenError
from batchgen.prompts import PromptConfig
from batchgen.spec import load_spec

BASE = ["input.path='in.jsonl'", "output.dir='out'"]


@pytest.mark.parametrize(
    "item",
    [
        "sampling.stop=[END, STOP]",
        'sampling.regex="\\d+"',
        "sampling.stop=['a', b]",
        "prompt.template='unclosed",
        "sampling.logit_bias={1: 2}",
        'sampling.stop= ["x"',
    ],
)
def test_a_set_value_meant_as_toml_that_does_not_parse_is_refused(item: str) -> None:
    """Never kept as raw text (brackets and quotes in a stop string, a regex, a template)."""
    with pytest.raises(BatchgenError, match=r"not valid TOML.*quote"):
        load_spec(None, [*BASE, item])


def test_a_bare_word_set_value_is_a_string() -> None:
    spec = load_spec(None, [*BASE, "sampling.stop=END", "prompt.template=Q: {prompt}"])
    assert spec.sampling.stop == ("END",) and spec.prompt.template == "Q: {prompt}"
    spec = load_spec(None, [*BASE, "sampling.stop=['[a', '{b']", "sampling.regex='\\d+'"])
    assert spec.sampling.stop == ("[a", "{b") and spec.sampling.regex == "\\d+"


def test_text_and_json_that_open_a_bracket_are_taken_as_given() -> None:
    """A key that takes text keeps a value opening with a bracket ({question}, [INST]); a JSON
    value (a schema written as JSON) is read as JSON."""
    sets = [
        "prompt.template=[INST] {prompt} [/INST]",
        'sampling.json_schema={"type": "object"}',
        'sampling.stop=["a", "b"]',
    ]
    spec = load_spec(None, [*BASE, *sets])
    assert spec.prompt.template == "[INST] {prompt} [/INST]"
    assert json.loads(spec.sampling.json_schema) == {"type": "object"}
    assert spec.sampling.stop == ("a", "b")
    spec = load_spec(None, [*BASE, "prompt.template={prompt}"])
    assert spec.prompt.template == "{prompt}"


@pytest.mark.parametrize("template", ["Summarize: {{prompt}}", "", "just text"])
def test_a_template_that_names_no_column_is_refused(template: str) -> None:
    """Every row would get the same prompt."""
    with pytest.raises(BatchgenError, match="names no column"):
        load_spec(None, BASE, {"prompt.template": template})
    if template:  # one fixed prompt, each row with its own seed: many samples, all different
        spec = load_spec(None, [*BASE, "prompt.seed_column='seed'"], {"prompt.template": template})
        assert spec.prompt.template == template


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{x:{y}}", r"field \{x\} has a field inside its format spec"),
        ("Q: {x:>{width}} {y}", r"field \{x\} has a field inside its format spec"),
        ("{x:{{}}}", r"field \{x\} has a field inside its format spec"),
        ("{x!z}", r"field \{x\} has the conversion !z: use !r, !s or !a"),
        ("{x} {y!q:>3}", r"field \{y\} has the conversion !q"),
    ],
)
def test_a_template_that_every_row_would_fail_is_refused(template: str, message: str) -> None:
    """A nested field in a format spec or an unknown conversion: str.format fails on every
    row, so the spec is refused when it is read (validate too), in one line."""
    with pytest.raises(BatchgenError, match=message) as info:
        load_spec(None, BASE, {"prompt.template": template})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        PromptConfig(template=template)
    spec = load_spec(None, BASE, {"prompt.template": "{x!r:>12} {y!s} {z:.3}"})
    assert spec.prompt.columns_used() == ["x", "y", "z"]


@pytest.mark.parametrize(
    "item",
    [
        "output.shard_seconds=inf",
        "runtime.heartbeat_timeout_s=nan",
        "runtime.rank_timeout_s=inf",
        "runtime.cpu_kv_cache_gib=inf",
        "runtime.kv_cache_memory_fraction=-nan",
        "sampling.temperature=1e400",
        "sampling.top_p=nan",
    ],
)
def test_a_number_that_is_not_finite_is_refused_naming_its_key(item: str) -> None:
    key = item.split("=")[0]
    with pytest.raises(BatchgenError, match=rf"{key} = .*expected a finite number"):
        load_spec(None, [*BASE, item])


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("cpu_kv_cache_gib", 1e9),  # more memory than any machine has
        ("cpu_kv_cache_gib", 1e30),  # more blocks than a tensor's size can say
        ("cpu_kv_cache_gib", 1e300),  # more bytes than a float holds
        ("max_num_batched_tokens", 10**13),
    ],
)
def test_an_allocation_the_settings_make_too_large_names_the_setting(
    model_dir, setting: str, value: float
) -> None:
    from batchgen import Engine, EngineConfig

    config = EngineConfig(device="cpu", check_model=False, **{setting: value})
    with pytest.raises(BatchgenError, match=f"cannot allocate .*: lower runtime.{setting}"):
        Engine(str(model_dir("llama")), config)


@pytest.mark.parametrize(
    ("text", "args", "values"),
    [
        ('model = "default"\n', ["model.path='x'"], {}),
        ('model = "default"\n', [], {"model.path": "x"}),
        ('model = "default"\n', [], {}),
        ("sampling = 3\n", ["sampling.temperature=0.5"], {}),
        ('runtime = ["a"]\n', [], {"runtime.max_num_seqs": 4}),
        ('input = "x.jsonl"\n', [], {}),
        ('input = "x.jsonl"\n', [], {"input.format": "jsonl"}),
        ('output = "out"\n', [], {}),
    ],
)
def test_a_section_written_as_a_plain_value_is_refused(
    tmp_path, text: str, args: list[str], values: dict
) -> None:
    section = text.split(" ")[0]
    rest = {"input": '[input]\npath = "x.jsonl"\n', "output": '[output]\ndir = "out"\n'}
    job = tmp_path / "job.toml"
    job.write_text(text + "".join(v for k, v in rest.items() if k != section))
    with pytest.raises(BatchgenError, match=rf"\[{section}\] must be a table of keys, not"):
        load_spec(job, args, values)


def test_a_value_of_the_wrong_type_names_the_types_in_toml_words() -> None:
    with pytest.raises(BatchgenError) as excinfo:
        load_spec(None, [*BASE, "sampling.json_schema=[]"])
    assert str(excinfo.value) == (
        "sampling.json_schema = []: expected a string or a table or nothing"
    )


def test_an_option_replaces_the_job_files_value_under_its_other_name(tmp_path) -> None:
    """[sampling] max_tokens = 10 in the job file (vLLM's name), --max-new-tokens 5 or --set
    sampling.max_new_tokens=7 on the command line: the option wins, as over the same name; two
    options of one setting stay an error."""
    job = tmp_path / "job.toml"
    job.write_text('[input]\npath = "x.jsonl"\n[output]\ndir = "o"\n[sampling]\nmax_tokens = 10\n')
    assert load_spec(job).sampling.max_new_tokens == 10
    assert load_spec(job, values={"sampling.max_new_tokens": 5}).sampling.max_new_tokens == 5
    assert load_spec(job, ["sampling.max_new_tokens=7"]).sampling.max_new_tokens == 7
    job.write_text(
        '[input]\npath = "x.jsonl"\n[output]\ndir = "o"\n[sampling]\nmin_new_tokens = 2\n'
    )
    assert load_spec(job, ["sampling.min_tokens=3"]).sampling.min_new_tokens == 3
    with pytest.raises(BatchgenError, match="max_tokens and max_new_tokens are the same"):
        load_spec(job, ["sampling.max_tokens=4"], values={"sampling.max_new_tokens": 5})


def test_file_urls_from_options_name_the_local_path(tmp_path) -> None:
    """input.path, model.path and output.dir given as file:// (or ~) on the command line name
    the local path, as they do in a job file."""
    spec = load_spec(
        None,
        [f"input.path=file://{tmp_path}/in.jsonl", "output.dir=file:///tmp/out"],
        values={"model.path": f"file://{tmp_path}/model"},
    )
    assert spec.input.path == f"{tmp_path}/in.jsonl" and spec.output.dir == "/tmp/out"
    assert spec.model.path == f"{tmp_path}/model"
    home = load_spec(None, ["input.path=~/in.jsonl", "output.dir=o"]).input.path
    assert home == str(Path("~/in.jsonl").expanduser())


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("sampling.choice=[]", "sampling.choice = []: give at least one string"),
        ('sampling.choice="yes"', "sampling.choice = 'yes': expected"),
        ("runtime.max_num_seqs=100000000", "use an integer in [1, 1,048,576]"),
        ("runtime.max_num_seqs=99999999999999999999", "max_num_seqs"),
        ("runtime.cpu_threads=100000", "use an integer in [1, 1024]"),
        ("runtime.rank_timeout_s=1e300", "rank_timeout_s=1e+300 must be in (0, 1e+07]"),
        ("runtime.heartbeat_timeout_s=1e10", "must be in [2, 1e+07]"),
        ("runtime.max_model_len=2", "max_model_len=2 is not allowed: use >= 3"),
        ("model.path='  '", "path='  ' is not allowed"),
        ("output.dir='   '", "dir='   ' is not allowed"),
    ],
)  # fmt: skip
def test_values_no_engine_could_start_with_or_that_mean_nothing_are_refused(
    item: str, words: str
) -> None:
    """Refused by the spec (validate and run alike) in one line, never taken as something
    else (one choice string as a list, an empty choice as no constraint) or left to crash
    the run (allocations, threads, timeouts past what torch takes)."""
    base = [b for b in BASE if not b.startswith(item.partition("=")[0])]
    with pytest.raises(BatchgenError) as caught:
        load_spec(None, [*base, item])
    assert words in str(caught.value) and "\n" not in str(caught.value), caught.value


def test_one_string_is_a_list_of_one_only_where_the_field_says_so() -> None:
    spec = load_spec(
        None, [*BASE, "sampling.stop=END", "prompt.passthrough=url", "model.served_model_name=m"]
    )
    assert spec.sampling.stop == ("END",) and spec.prompt.passthrough == ("url",)
    assert spec.model.served_model_name == ("m",)


def test_an_empty_choice_given_is_refused_where_a_list_is_given() -> None:
    """choice=[] would be a constraint with no option: refused (the Python API, a row's
    sampling column), while no choice at all stays no constraint."""
    from batchgen import SamplingParams

    with pytest.raises(ValueError, match=r"choice=\[\] must list at least one string"):
        SamplingParams(choice=[])
    with pytest.raises(ValueError, match=r"choice=\[\] must list"):
        SamplingParams().replace(choice=[])
    assert not SamplingParams().structured


def test_a_key_above_every_section_says_where_it_belongs(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('max_new_tokens = 5\n[input]\npath = "in.jsonl"\n[output]\ndir = "out"\n')
    with pytest.raises(BatchgenError) as caught:
        load_spec(str(job), [])
    assert str(caught.value).startswith(
        "max_new_tokens = 5 is outside any [section]: it belongs under [sampling]"
    )


def test_engine_cpus_with_the_engine_in_a_thread_is_refused() -> None:
    with pytest.raises(BatchgenError, match="engine_cpus=2 places the engine's own process"):
        load_spec(None, [*BASE, "runtime.engine_cpus=2", "runtime.engine_process='thread'"])
    assert load_spec(None, [*BASE, "runtime.engine_cpus=2"]).pipeline.engine_cpus == 2
