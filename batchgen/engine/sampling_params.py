"""Per-request sampling settings, validated on construction (names and meanings as in vLLM)."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

from batchgen.json_text import parse_json


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. temperature == 0 means greedy.

    Filters apply in vLLM's order penalties -> temperature -> min_p -> top_k -> top_p; logprobs
    are those of the model's own distribution (log_softmax of the raw logits).
    """

    max_new_tokens: int = 256
    min_new_tokens: int = 0  # end-of-sequence and stop tokens are banned before this many
    temperature: float = 0.0
    top_k: int = 0  # keep the k most likely tokens; 0 (or vLLM's -1) = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None  # None = derived from the engine seed and the request id
    n: int = 1  # samples of one prompt, each its own result with a sample index
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = the chosen token's and the top k's logprobs
    # structured outputs (at most one): the output must match it (see engine/grammar.py)
    json_schema: str | dict | None = None  # a JSON schema, as an object or its JSON text
    regex: str | None = None  # the whole output matches this regular expression
    choice: tuple[str, ...] = ()  # the output is exactly one of these strings
    json_object: bool = False  # the output is any JSON value

    def __post_init__(self) -> None:
        """Lists become tuples and a lone stop string a one-element tuple; anything else that
        is not what a field takes is a ValueError naming it (never a TypeError)."""
        for f in fields(self):  # NumPy's numbers (a seed drawn by a Generator) as Python's
            object.__setattr__(self, f.name, _plain(getattr(self, f.name)))
        if isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", tuple(map(_plain, self.stop_token_ids)))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.choice, list):
            if not self.choice:  # given, unlike the default (): a constraint with no option
                raise ValueError("choice=[] must list at least one string (or leave it out)")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.top_k == -1 and not isinstance(self.top_k, bool):  # vLLM's "off" is our 0
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.json_schema, dict):  # kept as text: hashable, the order kept
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def structured(self) -> bool:
        """The output must match a schema, regex, choice or be JSON."""
        return (
            bool(self.json_schema is not None or self.regex is not None or self.choice)
            or self.json_object is True
        )

    def replace(self, **overrides: Any) -> SamplingParams:
        """A copy with some fields changed; unknown fields are an error naming them. vLLM's
        names (max_tokens, min_tokens) are accepted for ours."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return SamplingParams(**{**values, **resolve_aliases(overrides)})


ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}  # vLLM's names
# the fields a model's generation config may give defaults for (vLLM takes these same ones)
MODEL_DEFAULT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


def generation_defaults(generation_config: Any) -> dict[str, Any]:
    """The sampling defaults a model's GenerationConfig recommends: its MODEL_DEFAULT_FIELDS
    that differ from GenerationConfig's own defaults (to_diff_dict, as vLLM reads them; those
    defaults are None in transformers 5), in that order; do_sample is not read: a temperature
    given is a temperature used. Checked where taken (with_defaults)."""
    given = generation_config.to_diff_dict()
    return {name: value for name in MODEL_DEFAULT_FIELDS if (value := given.get(name)) is not None}


def with_defaults(params: SamplingParams, taken: dict[str, Any]) -> SamplingParams:
    """params with the model's recommended values `taken`; ValueError naming the model's file
    for a value no request could take (only where it is taken: a field set is never read)."""
    try:
        return params.replace(**taken)
    except ValueError as exc:
        raise ValueError(
            f"the model's generation_config.json recommends {exc}: fix it, set the field, or "
            'set runtime.generation_config = "ignore"'
        ) from None


_fields_init = SamplingParams.__init__


def _init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    """SamplingParams(...) takes vLLM's names too (max_tokens, min_tokens); an unknown name is
    a ValueError naming the fields, as for replace()."""
    kwargs = resolve_aliases(kwargs)
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown sampling field(s) {unknown}: use {sorted(known)}")
    _fields_init(self, *args, **kwargs)


SamplingParams.__init__ = _init  # type: ignore[method-assign]


def _plain(value: Any) -> Any:
    """A number of another type (NumPy's int64, float32) as Python's int or float; anything
    else as it is."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def resolve_aliases(values: dict[str, Any]) -> dict[str, Any]:
    """vLLM's field names -> ours; ValueError when both name one field."""
    out = dict(values)
    for alias, name in ALIASES.items():
        if alias in out:
            if name in out:
                raise ValueError(f"{alias} and {name} are the same setting: give one")
            out[name] = out.pop(alias)
    return out


MAX_LOGPROBS = 20  # alternatives a request may ask for (the transfer buffers hold this many)
MAX_N = 128  # samples of one prompt, as the OpenAI API allows
MAX_TOKENS = 2**31 - 1  # any token count or id
MAX_SEED = 2**63 - 1  # seeds are int64 on the device
MAX_STOP = 64  # stop strings or stop token ids of one request
MAX_CHOICES = 1024  # strings of one `choice`
# largest temperature or repetition penalty (smallest penalty: its inverse): logits divided or
# multiplied by it stay finite in float32 (beyond, inf / inf makes NaN and a wrong token)
MAX_SCALE = 1e30
STRUCTURED = ("json_schema", "regex", "choice", "json_object")


def _is_int(v: Any, low: int = 0, high: int = MAX_TOKENS) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _all(values: Any, ok: Any) -> bool:
    return isinstance(values, tuple) and len(values) <= MAX_STOP and all(ok(v) for v in values)


def _problems(p: SamplingParams) -> list[str]:
    """Every rule a field breaks, as 'field=value must ...' messages."""
    rules = [
        ("max_new_tokens", _is_int(p.max_new_tokens, 1), f"be an integer in [1, {MAX_TOKENS}]"),
        ("min_new_tokens", _is_int(p.min_new_tokens), f"be an integer in [0, {MAX_TOKENS}]"),
        (
            "temperature",
            _is_num(p.temperature) and 0 <= p.temperature <= MAX_SCALE,
            f"be a number in [0, {MAX_SCALE:g}]",
        ),
        ("top_k", _is_int(p.top_k), f"be an integer in [0, {MAX_TOKENS}] (0 or -1 = off)"),
        ("top_p", _is_num(p.top_p) and 0 < p.top_p <= 1, "be in (0, 1]"),
        ("min_p", _is_num(p.min_p) and 0 <= p.min_p <= 1, "be in [0, 1]"),
        (
            "repetition_penalty",
            _is_num(p.repetition_penalty) and 1 / MAX_SCALE <= p.repetition_penalty <= MAX_SCALE,
            f"be a number in [{1 / MAX_SCALE:g}, {MAX_SCALE:g}]",
        ),
        (
            "presence_penalty",
            _is_num(p.presence_penalty) and -2 <= p.presence_penalty <= 2,
            "be in [-2, 2]",
        ),
        (
            "frequency_penalty",
            _is_num(p.frequency_penalty) and -2 <= p.frequency_penalty <= 2,
            "be in [-2, 2]",
        ),
        (
            "seed",
            p.seed is None or _is_int(p.seed, -MAX_SEED - 1, MAX_SEED),
            "be an integer in [-2**63, 2**63)",
        ),
        ("n", _is_int(p.n, 1, MAX_N), f"be an integer in [1, {MAX_N}]"),
        (
            "stop_token_ids",
            _all(p.stop_token_ids, _is_int),
            f"be a list of at most {MAX_STOP} token ids in [0, {MAX_TOKENS}]",
        ),
        (
            "stop",
            _all(p.stop, lambda s: isinstance(s, str) and s),
            f"be a string or a list of at most {MAX_STOP} non-empty strings",
        ),
        (
            "include_stop_str_in_output",
            isinstance(p.include_stop_str_in_output, bool),
            "be true/false",
        ),
        ("ignore_eos", isinstance(p.ignore_eos, bool), "be true/false"),
        (
            "logprobs",
            p.logprobs is None or _is_int(p.logprobs, 0, MAX_LOGPROBS),
            f"be an integer in [0, {MAX_LOGPROBS}] or unset",
        ),
    ]
    out = [f"{name}={_show(getattr(p, name))} must {rule}" for name, ok, rule in rules if not ok]
    if not out and p.min_new_tokens > p.max_new_tokens:
        out.append(
            f"min_new_tokens={p.min_new_tokens} must be <= max_new_tokens={p.max_new_tokens}"
        )
    return out or _structured_problems(p)


def _structured_problems(p: SamplingParams) -> list[str]:
    """json_schema / regex / choice / json_object: their values and what they cannot go with."""
    rules = [
        (
            "json_schema",
            p.json_schema is None or _schema_ok(p.json_schema),
            "be a JSON object (a JSON schema), or its JSON text",
        ),
        (
            "regex",
            p.regex is None or (isinstance(p.regex, str) and p.regex),
            "be a non-empty string",
        ),
        (
            "choice",
            isinstance(p.choice, tuple)
            and len(p.choice) <= MAX_CHOICES
            and all(isinstance(c, str) and c for c in p.choice),
            f"be a list of at most {MAX_CHOICES} non-empty strings",
        ),
        ("json_object", isinstance(p.json_object, bool), "be true/false"),
    ]
    out = [f"{name}={_show(getattr(p, name))} must {rule}" for name, ok, rule in rules if not ok]
    given = [name for name in STRUCTURED if getattr(p, name) not in (None, (), False)]
    if out or not given:
        return out
    if len(given) > 1:
        return [f"{' and '.join(given)} are given: a request takes at most one of them"]
    if p.min_new_tokens:
        return [
            f"min_new_tokens={p.min_new_tokens} cannot be combined with {given[0]}: the "
            "grammar decides where the output ends (set min_new_tokens to 0)"
        ]
    if p.ignore_eos:
        return [
            f"ignore_eos cannot be combined with {given[0]}: a structured output ends with "
            "the end-of-sequence token once its grammar is complete"
        ]
    return []


def _schema_text(schema: dict) -> str | dict:
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return schema  # not JSON: _problems names it


def _schema_ok(schema: Any) -> bool:
    if not isinstance(schema, str):
        return False
    try:
        return isinstance(parse_json(schema), dict)
    except ValueError:
        return False


def _show(value: Any) -> str:
    """A value for a message: repr, cut short, lone surrogates escaped."""
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
