"""The check of a complete structured output against its spec, on its text.

The grammar engine guarantees the syntax while the output is generated; this is the second
look, where the text is decoded (Engine.generate, or a job's writer thread), that turns what
the grammar engine cannot promise into an error row instead of a wrong one.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from batchgen.engine.grammar import GrammarSpec


def output_problem(spec: GrammarSpec, text: str) -> str | None:
    """-> why a complete structured output does not match its spec (one line), or None.

    The grammar engine guarantees the syntax; a few schema semantics it counts on the text,
    not on the parsed value. An object may repeat a free key: parsers keep the last value (as
    Python, JavaScript and Go do), so an object with a repeated key holds fewer properties
    than the grammar counted (minProperties), and a format may accept values its definition
    refuses. So every complete JSON output is parsed and its value validated with jsonschema,
    and a choice must be one of the choices. A regex is not checked again (Python's re is
    another dialect than the grammar engine's).
    """
    if spec.kind == "regex":
        return None
    if spec.kind == "choice":
        return None if text in json.loads(spec.source) else "the output is not one of the choices"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"the output is not valid JSON ({' '.join(str(exc).split())[:200]})"
    if spec.kind == "json_object":
        return None if isinstance(value, dict) else "the output is not a JSON object"
    error = next(iter(_schema_validator(spec.source).iter_errors(value)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    return f"the output breaks its json_schema at {where}: {' '.join(error.message.split())[:200]}"


@functools.lru_cache(maxsize=256)
def _schema_validator(source: str) -> Any:
    import jsonschema  # present: grammar._llguidance refuses structured outputs without it

    schema = json.loads(source)
    return jsonschema.validators.validator_for(schema)(schema)
