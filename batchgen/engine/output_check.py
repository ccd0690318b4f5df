"""The check of a complete structured output against its spec, on its text.

The grammar engine guarantees the syntax while the output is generated; this is the second
look, where the text is decoded (Engine.generate, or a job's writer thread), that turns what
the grammar engine cannot promise into an error row instead of a wrong one.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from decimal import Decimal
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from batchgen.engine.grammar import GrammarSpec

# keys whose values are data, not schemas: a "pattern" key inside them is not a regex
DATA_KEYWORDS = ("const", "enum", "default", "examples")


class OutputCheck(NamedTuple):
    """What a structured output that ended `stop` is checked against where its text is
    decoded: its spec, and whether its grammar was complete (it ended at end-of-sequence,
    the only token a complete grammar allows) or a stop string or stop token ended it first."""

    spec: GrammarSpec
    complete: bool
    failure: str | None = None  # the grammar engine's error on this output, if it had one


def output_problem(check: OutputCheck, text: str) -> str | None:
    """-> why a structured output that ended `stop` is not a whole output of its spec (one
    line), or None. One that a stop string or stop token ended before its grammar was
    complete passes only where its text (as cut) still matches its spec; a regex's, which is
    not checked again (spec_problem), never does: it is an error row, not a cut-off output
    under finish_reason `stop`."""
    spec = check.spec
    if check.failure is not None:  # its matcher stopped: whatever ended it, it is no match
        reason = (check.failure.strip().splitlines() or ["no reason given"])[0][:200]
        return f"the grammar engine failed on this output ({reason}): simplify the {spec.kind}"
    if check.complete and text == "" and spec.kind in ("json_schema", "json_object"):
        return admits_nothing(spec)  # the grammar allowed only the end from the start
    if check.complete:
        return spec_problem(spec, text)
    early = f"a stop string or stop token ended it before its {spec.kind} was complete"
    if spec.kind == "regex":
        return f"{early}, so it may not match the regex"
    problem = spec_problem(spec, text)
    return None if problem is None else f"{early}: {problem}"


def endless(spec: GrammarSpec, limit: int) -> str:
    """Why a spec whose grammar forces an output past the grammar engine's limit is refused."""
    return (
        f"its {spec.kind} forces an output of more than {limit:,} tokens (e.g. a property that "
        "requires an object of the same schema), which no row can finish: fix it"
    )


def admits_nothing(spec: GrammarSpec) -> str:
    """Why a spec that no output can match is refused (one line)."""
    if spec.kind == "regex":
        shown = spec.source if len(spec.source) <= 80 else spec.source[:77] + "..."
        return f"regex {shown!r} matches no text at all: fix it"
    return (
        f"its {spec.kind} admits no value (the grammar allows no output, e.g. a $ref that "
        "only refers to itself): fix the schema"
    )


def spec_problem(spec: GrammarSpec, text: str) -> str | None:
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
        value = json.loads(text, parse_float=Decimal)
    except json.JSONDecodeError as exc:
        return f"the output is not valid JSON ({' '.join(str(exc).split())[:200]})"
    except (ValueError, ArithmeticError):  # valid JSON, no check: an integer past Python's
        # digit limit for int(), a number whose exponent Decimal cannot hold
        return "the output holds a number too large to be read, so it could not be checked"
    if spec.kind == "json_object":
        return None if isinstance(value, dict) else "the output is not a JSON object"
    try:
        error = next(iter(_schema_validator(spec.source).iter_errors(value)), None)
    except Exception as exc:  # a check that cannot run is no pass: the row is an error row
        return f"the output could not be checked against its json_schema ({_line(exc)})"
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    return f"the output breaks its json_schema at {where}: {_line(error.message)}"


def unchecked_problem(spec: GrammarSpec) -> str | None:
    """-> why complete outputs of a json_schema spec could not be checked (one line), or None.
    The check validates with Python's re, whose dialect is not the grammar engine's (Rust's
    regex, ECMA-262 for schemas): a pattern Python reads differently or not at all would turn
    right outputs into error rows, or stop the check, so its schema is refused up front."""
    if spec.kind != "json_schema":
        return None
    schema = json.loads(spec.source)
    for key, bound in _integer_bounds(schema):
        if not -(2**63) <= bound <= 2**63 - 1:
            return (
                f"its integer bound {key} = {bound} is beyond the 64-bit integers the grammar "
                "engine enforces (it would clamp the range and write integers outside it): keep "
                "integer bounds within -2^63 .. 2^63-1"
            )
    for pattern in _patterns(schema):
        try:
            nested = _set_in_set(pattern)
            if nested is not None:  # Python reads it otherwise (and warns of a nested set)
                raise re.error(f"{nested!r} inside a character class")
            re.compile(pattern)
        except re.error as exc:
            return (
                f"its pattern {pattern!r} cannot be checked with Python's re ({_line(exc)}): "
                "write it in the syntax both share (no named groups, POSIX classes or \\p{..})"
            )
    try:
        _schema_validator(spec.source).check_schema(schema)
    except Exception as exc:  # a schema of another draft: the check would fail on every output
        what = getattr(exc, "message", None) or exc  # a SchemaError's first line
        return (
            f"it is not a valid schema of its JSON Schema draft, so its outputs cannot be "
            f"checked ({_line(what)}): fix it, or name its draft with $schema (without one it "
            "is read as 2020-12, where a list of item schemas is prefixItems, not items)"
        )
    return None


def _set_in_set(pattern: str) -> str | None:
    """What Python's re would warn of as a possible nested set or set operation inside a
    character class ("[", "--", "&&", "~~", "||": a POSIX class such as [[:digit:]]), read by
    scanning the pattern (warnings' filters are the whole process's: not touched here)."""
    inside, first, i = False, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if inside:
            pair = pattern[i : i + 2]
            if c == "[" or pair in ("--", "&&", "~~", "||"):
                return c if c == "[" else pair
            if c == "]" and not first:
                inside = False
            first = False
        elif c == "[":
            inside, first = True, True
            if pattern[i + 1 : i + 2] == "^":
                i += 1
        i += 1
    return None


def _nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object of a schema, at any depth (not inside const, enum, default or examples,
    which hold data)."""
    if isinstance(schema, list):
        for item in schema:
            yield from _nodes(item)
    if not isinstance(schema, dict):
        return
    yield schema
    for key, value in schema.items():
        if key not in DATA_KEYWORDS:
            yield from _nodes(value)


def _patterns(schema: Any) -> Iterator[str]:
    """Every regex of a schema: "pattern" values and "patternProperties" keys."""
    for node in _nodes(schema):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from node["patternProperties"]


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _integer_bounds(schema: Any) -> Iterator[tuple[str, int | float]]:
    """(keyword, value) of every bound of an integer-typed schema."""
    for node in _nodes(schema):
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
            for key in _BOUNDS:
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield key, value


def _line(exc: object) -> str:
    return " ".join(str(exc).split())[:200]


@functools.lru_cache(maxsize=256)
def _schema_validator(source: str) -> Any:
    """A validator of the schema with its numbers read exactly (Decimal), as the outputs' are:
    multipleOf 0.01 holds for 4.94, which binary floats would refuse."""
    import jsonschema  # present: grammar._llguidance refuses structured outputs without it

    schema = json.loads(source, parse_float=Decimal)
    base = jsonschema.validators.validator_for(schema)
    plain = base.TYPE_CHECKER

    def is_integer(checker: Any, instance: Any) -> bool:
        """A number with a fraction or exponent (a Decimal) as the draft counts its float."""
        if isinstance(instance, Decimal):
            if not instance.is_finite() or instance != instance.to_integral_value():
                return False
            instance = float(instance)
        return plain.is_type(instance, "integer")

    checker = plain.redefine("integer", is_integer)
    return jsonschema.validators.extend(base, type_checker=checker)(schema)
