"""Job specs: what a job file, --set and the shortcut options may say, and what is refused."""

from __future__ import annotations

import pytest

from batchgen import BatchgenError
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


@pytest.mark.parametrize("template", ["Summarize: {{prompt}}", "", "just text"])
def test_a_template_that_names_no_column_is_refused(template: str) -> None:
    """Every row would get the same prompt."""
    with pytest.raises(BatchgenError, match="names no column"):
        load_spec(None, BASE, {"prompt.template": template})
