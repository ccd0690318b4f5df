"""Turning an input row into prompt token ids and per-row sampling overrides."""

from __future__ import annotations

import functools
import string
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from batchgen.content_format import ContentFormat, content_format, knows_developer
from batchgen.engine.prompt_text import (
    check_one_bos,
    check_unicode,
    keeps_every_character,
    two_bos,
)
from batchgen.engine.sampling_params import SamplingParams, resolve_aliases
from batchgen.errors import first_line
from batchgen.json_text import parse_json

PROMPT_SOURCES = ("column", "template", "messages_column")
TRUNCATE = ("error", "left", "right")
SYSTEM_ROLES = ("system", "developer")  # developer: OpenAI's newer name for the system role
CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# apply_chat_template's own arguments, which chat_template_kwargs may not set (the options
# above have keys of their own; the rest would change what the call returns, not the prompt)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        *CHAT_OPTIONS,
        "conversation",
        "messages",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatOptionError(ValueError):
    """A chat option's value that cannot render; field: the option at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ChatOptions(NamedTuple):
    """How chat messages are rendered, as Hugging Face's apply_chat_template and vLLM's
    LLM.chat take them: a new assistant turn opened after the messages, or the final message
    continued (its turn left open: an assistant prefill), and extra variables for the chat
    template (enable_thinking = false)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def checked(self, together: bool = True) -> ChatOptions:
        """self, or ChatOptionError naming what is wrong; together: with the rule between
        the two flags (a job's [prompt] checks it where its input's format is known)."""
        for name in CHAT_OPTIONS[:2]:
            if not isinstance(getattr(self, name), bool):
                raise ChatOptionError(
                    name, f"{name} must be true or false, not {getattr(self, name)!r}"
                )
        if together and self.add_generation_prompt and self.continue_final_message:
            raise ChatOptionError(
                "continue_final_message",
                "continue_final_message = true continues the last message, and "
                "add_generation_prompt = true opens a new assistant turn after it: set "
                "add_generation_prompt = false with it",
            )
        kwargs = self.chat_template_kwargs
        if kwargs is None:
            return self
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ChatOptionError(
                "chat_template_kwargs",
                "chat_template_kwargs must be an object of the chat template's variables "
                f'({{"enable_thinking": false}}), not {type(kwargs).__name__}',
            )
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            own = f" (give {reserved[0]} itself)" if reserved[0] in CHAT_OPTIONS else ""
            raise ChatOptionError(
                "chat_template_kwargs",
                f"chat_template_kwargs cannot set {reserved[0]!r}, an argument of the "
                f"template call itself{own}: remove it",
            )
        return self

    def replace(self, values: dict[str, Any]) -> ChatOptions:
        """These options with a row's own values (None: not given) over them; its template
        variables over these, key by key."""
        given = {k: v for k, v in values.items() if k in CHAT_OPTIONS and v is not None}
        if isinstance(given.get("chat_template_kwargs"), dict) and self.chat_template_kwargs:
            given["chat_template_kwargs"] = {
                **self.chat_template_kwargs,
                **given["chat_template_kwargs"],
            }
        return self._replace(**given).checked() if given else self

    def call_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of apply_chat_template."""
        out: dict[str, Any] = dict(self.chat_template_kwargs or {})
        out["add_generation_prompt"] = self.add_generation_prompt
        if self.continue_final_message:  # left out otherwise: any transformers takes the call
            out["continue_final_message"] = True
        return out


@dataclass(frozen=True)
class PromptConfig:
    """Where each row's prompt and id come from. Exactly one of column / template /
    messages_column is used; with none given, the text column "prompt" is."""

    column: str | None = None  # a text column used as the prompt
    template: str | None = None  # a format string over columns: "Summarize: {article}"
    messages_column: str | None = None  # chat messages rendered with the tokenizer's template
    system_prompt: str | None = None  # prepended as a system message (chat messages only)
    # how chat messages are rendered (ChatOptions): extra variables for the chat template,
    # a new assistant turn opened after the messages, or the final message continued
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    id_column: str | None = None  # None = the row's position in the input
    max_new_tokens_column: str | None = None
    temperature_column: str | None = None
    seed_column: str | None = None
    json_schema_column: str | None = None  # a JSON schema per row (object or JSON text)
    sampling_column: str | None = None  # a column of per-row sampling overrides (dict or JSON)
    passthrough: tuple[str, ...] = field(default=())  # input columns copied to the output
    truncate: str = "error"  # a prompt over the context: error row, or keep the left/right part

    def __post_init__(self) -> None:
        given = [name for name in PROMPT_SOURCES if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"prompt sources {given} are all set: give exactly one of "
                f"{', '.join(PROMPT_SOURCES)}"
            )
        named = {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith("column")}
        empty = [k for k, v in named.items() if v == ""] + ["passthrough"] * (
            "" in self.passthrough
        )
        if empty:
            raise ValueError(f"{empty[0]} is empty: give a column name (or leave it unset)")
        self.chat_options.checked(together=False)  # the input's format may not take them
        if self.truncate not in TRUNCATE:
            raise ValueError(f"truncate={self.truncate!r} is not allowed: use one of {TRUNCATE}")
        per_row = (
            self.seed_column,
            self.temperature_column,
            self.max_new_tokens_column,
            self.json_schema_column,
            self.sampling_column,
        )
        fixed = self.template is not None and not template_fields(self.template)  # or malformed
        if fixed and all(column is None for column in per_row):
            raise ValueError(
                f"template {self.template!r} names no column ({{column}}) and no per-row "
                "setting (seed_column, sampling_column, ...) is given: every row would get the "
                "same prompt and settings"
            )
        object.__setattr__(self, "passthrough", tuple(self.passthrough))

    @property
    def chat_options(self) -> ChatOptions:
        return ChatOptions(
            self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs
        )

    def chat_options_given(self) -> list[str]:
        """The chat options set to other than their defaults (chat messages only take them)."""
        return [
            name for name in CHAT_OPTIONS if getattr(self, name) != getattr(ChatOptions(), name)
        ]

    @property
    def text_column(self) -> str | None:
        if self.template is None and self.messages_column is None:
            return self.column or "prompt"
        return self.column

    def columns_used(self) -> list[str]:
        """Every input column the job reads (checked against the input before model work)."""
        cols = [
            self.sampling_column,
            self.text_column,
            self.messages_column,
            self.id_column,
            self.max_new_tokens_column,
            self.temperature_column,
            self.seed_column,
            self.json_schema_column,
            *self.passthrough,
        ]
        if self.template is not None:
            cols.extend(template_fields(self.template))
        return list(dict.fromkeys(c for c in cols if c is not None))

    def required_columns(self) -> list[str]:
        """The columns every row needs: its prompt and, when given, its id."""
        cols = [self.text_column, self.messages_column, self.id_column]
        if self.template is not None:
            cols.extend(template_fields(self.template))
        return list(dict.fromkeys(c for c in cols if c is not None))


CONVERSIONS = ("r", "s", "a")  # str.format's !r, !s and !a


def template_fields(template: str) -> list[str]:
    """The columns a template names; ValueError for anything str.format would fail on with
    every row (a nested field in a format spec, an unknown conversion)."""
    try:
        parsed = [p for p in string.Formatter().parse(template) if p[1] is not None]
    except ValueError as exc:
        raise ValueError(f"template {template!r} is malformed: {exc}") from exc
    names = [name for _, name, _, _ in parsed]
    for name in names:  # any other name is a column's, spaces and dashes too ({first name})
        if not name or name.isdigit() or "." in name or "[" in name:
            raise ValueError(
                f"template {template!r} has the field {{{name}}}, which str.format reads as a "
                "positional argument or as an attribute or item of a column: name a column, "
                "as {column}"
            )
    for _, name, spec, conversion in parsed:
        if spec and ("{" in spec or "}" in spec):
            raise ValueError(
                f"template {template!r}: field {{{name}}} has a field inside its format spec "
                f"({spec!r}): a format spec must be fixed text, such as {{{name}:>10}}"
            )
        if conversion is not None and conversion not in CONVERSIONS:
            raise ValueError(
                f"template {template!r}: field {{{name}}} has the conversion !{conversion}: "
                "use !r, !s or !a, or none"
            )
    return names


class RowPrompt(NamedTuple):
    """A row made ready for the engine, or the reason it cannot run."""

    index: int
    id: str
    prompt_ids: list[int] | None
    overrides: dict[str, Any]
    passthrough: dict[str, Any]
    error: str | None
    input_hash: str | None = None  # the row's hash, for sources checked row by row on resume


NOT_SCALAR = (list, tuple, dict, set, bytes, bytearray)  # values with no text of their own
MAX_NESTING = 32  # levels of lists/objects a pass-through value may have (Parquet reads ~45)
CHAR_SLACK = 4  # a prompt longer than slack x tokens x longest token (in characters) cannot fit
MARKER, MARKER_END = "\ue000", "\ue001"  # private-use characters around a text part's marker


class _Rendered(NamedTuple):
    """A checked row whose prompt text awaits tokenization."""

    index: int
    row_id: str
    text: str
    special: bool  # the tokenizer adds its special tokens (bos) to this text
    overrides: dict[str, Any]
    passthrough: dict[str, Any]
    max_new_tokens: int


class PromptBuilder:
    """Renders and tokenizes rows; thread-safe (used from the tokenizer pool).

    Everything a row brings is checked here, where it enters: its id, its pass-through values,
    its per-row sampling values (as the engine will see them) and its prompt. A row that fails
    a check becomes an error row that can always be written; the engine and the writer never
    see an invalid value.
    """

    def __init__(
        self,
        config: PromptConfig,
        tokenizer: Any,
        max_prompt_tokens: int,
        sampling: SamplingParams,
        chat_options_column: str | None = None,
    ) -> None:
        self.config = config
        self.chat_options = config.chat_options
        # a column of each row's own ChatOptions values over the config's (OpenAI Batch lines)
        self.chat_options_column = chat_options_column
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens  # the context minus one generated token
        self.sampling = sampling  # the job's defaults, which per-row values override
        self.short_prompt_chars = CHAR_SLACK * max_prompt_tokens  # fit whatever the tokens

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """Characters beyond which a prompt cannot fit; None where no count of characters
        tells (a tokenizer that can drop characters: WordPiece, whitespace splitting; such a
        prompt is tokenized whole). Computed only for a prompt longer than
        short_prompt_chars: reading the vocabulary takes 18 ms at 32k tokens, on the way to a
        job's first step."""
        if not keeps_every_character(self.tokenizer):
            return None
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return self.short_prompt_chars * max(longest, 1)

    @functools.cached_property
    def content_format(self) -> ContentFormat:
        """Whether the chat template takes a message's text parts as a list ("openai") or
        joined into text ("string")."""
        return content_format(self.tokenizer)

    @functools.cached_property
    def knows_developer(self) -> bool:
        """Whether the chat template renders developer messages as such."""
        return knows_developer(self.tokenizer)

    def build(self, index: int, values: dict[str, Any]) -> RowPrompt:
        return self.build_many([(index, values)])[0]

    def build_many(self, rows: list[tuple[int, dict[str, Any]]]) -> list[RowPrompt]:
        """build() for many rows, their texts tokenized in one batch call (the tokenizer's
        Rust side encodes them in parallel, without the GIL)."""
        out = [self._render(index, values) for index, values in rows]
        for special in (True, False):
            todo = [
                i for i, r in enumerate(out) if isinstance(r, _Rendered) and r.special is special
            ]
            for i, (ids, added) in zip(
                todo, self._encode([out[i].text for i in todo], special), strict=True
            ):
                r = out[i]
                try:
                    if special:  # a chat template's text is encoded without special tokens
                        check_one_bos(self.tokenizer, r.text, ids, "use messages_column")
                    ids = self._truncate(list(ids), added, r.max_new_tokens)
                except ValueError as exc:
                    out[i] = RowPrompt(r.index, r.row_id, None, {}, r.passthrough, str(exc))
                    continue
                out[i] = RowPrompt(r.index, r.row_id, ids, r.overrides, r.passthrough, None)
        return out

    def _encode(self, texts: list[str], special: bool) -> list[tuple[list[int], tuple[int, int]]]:
        """Each text's ids, and how many of them the tokenizer added before and after the
        text (its special tokens: a BOS, an EOS), which truncation keeps. Those are asked for
        only where a prompt may be cut: the mask that tells them costs ~10% of the encoding."""
        if not texts:
            return []
        masked = special and self.config.truncate != "error"
        encoded = self.tokenizer(
            texts, add_special_tokens=special, return_special_tokens_mask=masked
        )
        if not masked:
            return [(ids, (0, 0)) for ids in encoded.input_ids]
        masks = encoded.special_tokens_mask
        return [(ids, _added(mask)) for ids, mask in zip(encoded.input_ids, masks, strict=True)]

    def _render(self, index: int, values: dict[str, Any]) -> RowPrompt | _Rendered:
        """The row checked and its prompt text rendered, or its error row."""
        cfg = self.config
        given = None if cfg.id_column is None else values.get(cfg.id_column)
        compound = isinstance(given, NOT_SCALAR)  # its text would be Python's repr of it
        raw_id = _raw_id(cfg.id_column, index, values)
        row_id = writable(raw_id)
        passthrough, bad_column = _passthrough(values, cfg.passthrough)
        try:
            if compound:
                raise ValueError(
                    f"id column {cfg.id_column!r} holds {type(given).__name__}: an id is text "
                    "or a number"
                )
            if row_id != raw_id:
                raise ValueError(f"id {row_id!r} is not valid Unicode (a lone surrogate)")
            if not row_id:
                what = "is empty text" if given == "" else "is missing or null"
                raise ValueError(f"id column {cfg.id_column!r} {what}: every row needs an id")
            if bad_column is not None:
                raise ValueError(bad_column)
            overrides = self._overrides(values)
            params = _params(self.sampling, overrides)
            text, special = self._text(values)
        except ValueError as exc:
            return RowPrompt(index, row_id, None, {}, passthrough, writable(str(exc)))
        return _Rendered(
            index, row_id, text, special, overrides, passthrough, params.max_new_tokens
        )

    def _text(self, values: dict[str, Any]) -> tuple[str, bool]:
        """-> (the prompt text, whether the tokenizer adds its special tokens)."""
        cfg = self.config
        if cfg.messages_column is not None:
            messages = _messages(_value(values, cfg.messages_column), cfg.messages_column)
            given = len(messages)
            if cfg.system_prompt is not None and messages[0].get("role") not in SYSTEM_ROLES:
                messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
            messages = [self._for_template(message) for message in messages]
            options = self.chat_options
            if self.chat_options_column is not None:
                options = options.replace(values.get(self.chat_options_column) or {})
            text = self._chat_text(messages, options)
            self._check_parts_rendered(messages, len(messages) - given, text, options)
            return self._checked(text), False
        if cfg.template is not None:
            text = _fill(cfg.template, values)
        else:
            text = _value(values, cfg.text_column)
            if not isinstance(text, str):
                raise ValueError(
                    f"column {cfg.text_column!r} holds {type(text).__name__}, not text"
                )
        if not text:
            raise ValueError("prompt is empty")
        return self._checked(text), True

    def _chat_text(self, messages: list[dict[str, Any]], options: ChatOptions) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, **options.call_kwargs()
            )
        except Exception as exc:  # jinja errors on malformed messages
            raise ValueError(
                f"chat template failed on column {self.config.messages_column!r}: {exc}"
            ) from exc

    def _check_parts_rendered(
        self, messages: list[dict[str, Any]], first: int, text: str, options: ChatOptions
    ) -> None:
        """ValueError where the chat template left out a text part of a message of several
        (some templates read only a message's first part): the message would reach the model
        in part. Found by rendering the messages again with each part's text a marker of its
        own, which no other text holds: a part whose text is also elsewhere in the prompt
        cannot pass for rendered. first: the first of the row's own messages (the system
        prompt before it is batchgen's own)."""
        lead = MARKER
        while lead in text:  # the markers are in no text the template renders
            lead += MARKER
        marked, wanted = [], {}
        for i, message in enumerate(messages):
            parts = message.get("content")
            if i < first or not isinstance(parts, list) or len(parts) < 2:
                marked.append(message)
                continue
            own = [f"{lead}{i}.{j}{MARKER_END}" for j in range(len(parts))]
            wanted.update(
                (mark, (i - first, len(parts), p["text"]))
                for mark, p in zip(own, parts, strict=True)
                if p["text"].strip()
            )
            marked.append(
                {**message, "content": [{**p, "text": m} for p, m in zip(parts, own, strict=True)]}
            )
        if not wanted:
            return
        rendered = self._chat_text(marked, options)
        for mark, (i, count, part) in wanted.items():
            if mark not in rendered:
                raise ValueError(
                    f"the chat template renders only part of message {i}'s {count} text parts "
                    f"(not {part[:40]!r}): give its text as one string"
                )

    def _for_template(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message as the chat template takes it, as vLLM passes it: a developer message as a
        system one where the template does not name that role; text parts joined for a
        template that renders content as text, and for a tool message whatever the template
        (templates render a tool's result as text, some with tojson); text as one part for a
        template that loops over content."""
        if message.get("role") == "developer" and not self.knows_developer:
            message = {**message, "role": "system"}
        if self.content_format == "string" or message.get("role") == "tool":
            return _joined(message)
        content = message.get("content")
        if isinstance(content, str):
            return {**message, "content": [{"type": "text", "text": content}]}
        return message

    def _checked(self, text: str) -> str:
        """The prompt text, if it can be encoded and could fit; cut (by characters, to a
        length that still holds more tokens than fit) where it is truncated anyway."""
        check_unicode(text)
        if len(text) <= self.short_prompt_chars:
            return text
        bound = self.max_prompt_chars
        if bound is None or len(text) <= bound:
            return text
        mode = self.config.truncate
        if mode == "left":
            return text[-bound:]
        if mode == "right":
            return text[:bound]
        raise ValueError(
            f"prompt has {len(text):,} characters, more than the model's context of "
            f"{self.max_prompt_tokens + 1:,} tokens (max_model_len) can hold: shorten it, or "
            "set prompt.truncate"
        )

    def _overrides(self, values: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        columns = {
            "max_new_tokens": cfg.max_new_tokens_column,
            "temperature": cfg.temperature_column,
            "seed": cfg.seed_column,
            "json_schema": cfg.json_schema_column,
        }
        out = resolve_aliases(_sampling_dict(values.get(cfg.sampling_column), cfg.sampling_column))
        picked = {key: values.get(col) for key, col in columns.items() if col is not None}
        for key, value in picked.items():
            if value is None:
                continue
            if key in out:  # neither may silently win
                raise ValueError(
                    f"{key} is given both in column {cfg.sampling_column!r} and in column "
                    f"{columns[key]!r}: give it in one of them"
                )
            out[key] = value
        return out

    def _truncate(self, ids: list[int], added: tuple[int, int], max_new_tokens: int) -> list[int]:
        """A prompt over the context cut to leave room for max_new_tokens: its text's tokens
        are cut and the special tokens the tokenizer added around them (added: how many before
        and after, such as its BOS) kept, as Hugging Face truncates a text (and vLLM, which
        truncates with it); ValueError where that room leaves none of the text."""
        mode = self.config.truncate
        if mode == "error" or len(ids) <= self.max_prompt_tokens:
            return ids
        context = self.max_prompt_tokens + 1
        if mode == "right" and self.config.messages_column is not None:
            raise ValueError(
                f"prompt has {len(ids):,} tokens, more than the model's context of "
                f"{context:,} (max_model_len), and truncate='right' would cut off the chat "
                "template's turn for the reply: shorten the messages, or use truncate='left'"
            )
        before, after = added
        keep = context - max_new_tokens - before - after  # of the text's own tokens
        if keep < 1:
            beside = ""
            if before + after:
                beside = f" beside the {before + after} special token(s) the tokenizer adds"
            raise ValueError(
                f"prompt has {len(ids):,} tokens and max_new_tokens={max_new_tokens:,} fills "
                f"the whole context of {context:,} tokens (max_model_len){beside}, so "
                "truncating would leave no prompt: lower max_new_tokens"
            )
        text = ids[before : len(ids) - after]
        text = text[-keep:] if mode == "left" else text[:keep]
        return ids[:before] + text + ids[len(ids) - after :]


def _added(special_tokens_mask: list[int]) -> tuple[int, int]:
    """How many of a text's ids the tokenizer added before and after it: the leading and
    trailing 1s of its special tokens mask (a special token's text within the text is the
    text's own, 0)."""
    n = len(special_tokens_mask)
    before = next((i for i, added in enumerate(special_tokens_mask) if not added), n)
    after = next((i for i, added in enumerate(reversed(special_tokens_mask)) if not added), n)
    return before, min(after, n - before)


def _params(base: SamplingParams, overrides: dict[str, Any]) -> SamplingParams:
    """The row's sampling as the engine will build it; ValueError naming a bad value."""
    if not overrides:  # the job's own values, checked when they were read
        return base
    try:
        return base.replace(**overrides)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(str(exc)) from exc


def _messages(value: Any, column: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        raise ValueError(
            f"column {column!r} holds text, not a list of {{role, content}} messages: if it is "
            "JSON text, parse it into a list first"
        )
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else type(value).__name__
        raise ValueError(
            f"column {column!r} must hold a non-empty list of {{role, content}} messages, not {got}"
        )
    out = []
    for i, message in enumerate(value):
        if _map_pairs(message):  # an Arrow map (map<string, string>, as Spark writes one)
            message = dict(message)
        if not isinstance(message, dict):
            raise ValueError(
                f"column {column!r} message {i} must be an object with a string role and its "
                f"content, not {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str):
            got = "has no role" if role is None else f"has a role of {type(role).__name__}"
            raise ValueError(
                f"column {column!r} message {i} {got}: give each message a role as text "
                "(system, user, assistant, tool) and its content"
            )
        try:
            out.append(chat_message(message))
        except ValueError as exc:
            raise ValueError(f"column {column!r} message {i}: {exc}") from exc
    return out


def _map_pairs(value: Any) -> bool:
    """Whether value is an Arrow map as pyarrow gives it: a list of (key, value) tuples."""
    return isinstance(value, list) and all(
        isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) for pair in value
    )


def chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with a string role as the chat template gets it, as vLLM passes it: its
    content as message_content gives it, and an assistant's tool calls with their function
    arguments as objects (JSON text parsed: tool-use templates render them with tojson), an
    empty or null tool_calls left out; ValueError naming what is wrong. An assistant turn of
    tool calls only (content null, OpenAI's form) has no text parts. The message itself is left
    unchanged."""
    content = message.get("content")
    if content is None and message["role"] == "assistant" and message.get("tool_calls"):
        content = []
    out = {**message, "content": message_content(content)}
    if message["role"] == "assistant" and "tool_calls" in out:
        calls = out.pop("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ValueError(f"tool_calls must be a list of tool calls, not {type(calls).__name__}")
        if calls:
            out["tool_calls"] = [_tool_call(call, j) for j, call in enumerate(calls)]
    return out


def _tool_call(call: Any, index: int) -> dict[str, Any]:
    """One assistant tool call with its arguments as a JSON object (missing, null or "" as {},
    as vLLM takes them; any other value that is not an object, parsed or not, is refused)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise ValueError(
            f'tool_calls[{index}] must be a function call: {{"type": "function", "function": '
            '{"name", "arguments"}}'
        )
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    where = f"tool_calls[{index}].function.arguments"
    if isinstance(arguments, str):
        try:
            arguments = parse_json(arguments)
        except ValueError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where} must be a JSON object, not {type(arguments).__name__}")
    return {**call, "function": {**function, "arguments": arguments}}


def message_content(content: Any) -> str | list[dict[str, str]]:
    """A chat message's content checked: text, or a list of text parts (each made
    {"type": "text", "text": ...}, as vLLM makes them; joined or not by the builder, as the
    chat template expects); anything else (no content, an image) is a ValueError, never
    rendered as Python's repr of it by a template."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI's other text parts, as vLLM reads them
        content = [_as_text_part(p) for p in content]
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return [{"type": "text", "text": p["text"]} for p in content]
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PARTS:
                raise ValueError(
                    f"content part {i} is a {kind!r} part without a string {TEXT_PARTS[kind]!r}"
                )
            if kind != "text":
                what = f"a {kind!r} part" if isinstance(kind, str) else "not a typed part"
                raise ValueError(
                    f"content part {i} is {what}: batchgen runs text models, so content takes "
                    'text or parts {"type": "text", "text": ...}'
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} is a text part without a string 'text'")
    kind = "none" if content is None else type(content).__name__
    raise ValueError(f"content must be text or a list of text parts, not {kind}")


# part type -> its text's key, for parts vLLM reads as text: OpenAI's assistant refusal, the
# Responses API's input and output text, a reasoning model's thinking
TEXT_PARTS = {
    "refusal": "refusal",
    "input_text": "text",
    "output_text": "text",
    "thinking": "thinking",
}


def _as_text_part(part: Any) -> Any:
    """A part of TEXT_PARTS as a text part; any other part as it is."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get(TEXT_PARTS[kind]), str):
        return {"type": "text", "text": part[TEXT_PARTS[kind]]}
    return part


def _joined(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its text parts joined by newlines, as vLLM joins them for a template
    that renders content as text."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}


def writable(text: str) -> str:
    """text with lone surrogates (which no file can hold) escaped as \\udXXX."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _passthrough(
    values: dict[str, Any], columns: tuple[str, ...]
) -> tuple[dict[str, Any], str | None]:
    """-> (the values to copy, why one of them cannot be written); a bad value becomes None."""
    out, problem = {}, None
    for column in columns:
        value = values.get(column)
        reason = _unwritable(value, 0)
        if reason is not None:
            problem = problem or f"pass-through column {column!r} {reason}: it is left empty"
            value = None
        out[column] = value
    return out, problem


def _unwritable(value: Any, depth: int) -> str | None:
    if depth > MAX_NESTING:
        return f"is nested more than {MAX_NESTING} levels deep"
    if isinstance(value, str):
        return None if writable(value) == value else "holds a lone surrogate (not valid Unicode)"
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return None
    for item in items:
        reason = _unwritable(item, depth + 1)
        if reason is not None:
            return reason
    return None


def _sampling_dict(value: Any, column: str | None) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = parse_json(value)
        except ValueError as exc:
            raise ValueError(f"column {column!r} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"column {column!r} must hold an object of sampling settings")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items() if v is not None}


def _value(values: dict[str, Any], column: str | None) -> Any:
    value = values.get(column) if column is not None else None
    if value is None:
        raise ValueError(f"column {column!r} is missing or null")
    return value


def _field(values: dict[str, Any], column: str) -> Any:
    """A template field's value: text, a number, a date; a list, an object or bytes would be
    written into the prompt as Python's repr of it."""
    value = _value(values, column)
    if isinstance(value, NOT_SCALAR):
        raise ValueError(
            f"template field {column!r} holds {type(value).__name__}, not text or a number "
            "(it would be written as Python's repr): put its text into a column of its own"
        )
    return value


def _fill(template: str, values: dict[str, Any]) -> str:
    """The template filled in with the row's values, field by field as str.format fills it;
    ValueError naming the field whose value its conversion or format spec cannot take (a
    value's own __format__ raises what it likes: OverflowError for {b:.2f} of an integer
    too large for a float, TypeError for a spec a duration has no use for, ...)."""
    formatter, out = string.Formatter(), []
    for literal, name, spec, conversion in formatter.parse(template):
        out.append(literal)
        if name is None:
            continue
        value = _field(values, name)
        try:
            out.append(formatter.format_field(formatter.convert_field(value, conversion), spec))
        except Exception as exc:
            field = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(
                f"template field {{{field}}} cannot format column {name!r}, which holds "
                f"{type(value).__name__}: {first_line(exc)}; change the template's format spec "
                "or the column's values"
            ) from None
    return "".join(out)


def check_template_bos(config: PromptConfig, tokenizer: Any) -> None:
    """ValueError where prompt.template's own text begins with the BOS token's text and the
    tokenizer adds its own BOS: the model would see two in every row, so every row would be
    an error row."""
    if config.template is None:
        return
    head = ""  # the template's text before its first field: every prompt begins with it
    for literal, name, _, _ in string.Formatter().parse(config.template):
        head += literal
        if name is not None:
            break
    if two_bos(tokenizer, head, tokenizer(head, add_special_tokens=True).input_ids):
        raise ValueError(
            f"prompt.template {config.template!r} begins with the BOS token "
            f"{tokenizer.bos_token}, and the tokenizer adds its own, so the model would see two "
            "and every row would be an error row: remove it from the template"
        )


def _raw_id(id_column: str | None, index: int, values: dict[str, Any]) -> str:
    """A row's id as text: its position without an id column, else the column's value ("" for
    a missing one, or a list or an object, which is no id)."""
    if id_column is None:
        return str(index)
    given = values.get(id_column)
    return "" if given is None or isinstance(given, NOT_SCALAR) else str(given)


def row_id(id_column: str | None, index: int, values: dict[str, Any]) -> str:
    """The id a row's results are written under."""
    return writable(_raw_id(id_column, index, values))
