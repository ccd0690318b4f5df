"""Which form of a chat message's content a chat template expects, detected from the template
as vLLM detects it (its "auto" chat template content format).

"openai": the template loops over a message's content itself (`{% for part in
message['content'] %}`, as Llama 4's, Gemma 3's and the vision models' templates do), so a list
of text parts is passed to it as a list. "string": the template renders the content as text, so
text parts are joined by newlines first.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Literal

from jinja2 import nodes

ContentFormat = Literal["string", "openai"]
MESSAGES = "messages"  # the variable a chat template gets its messages in


def content_format(tokenizer: Any) -> ContentFormat:
    """The content format of the template the tokenizer's apply_chat_template uses ("string"
    where it has none, or where the template cannot be parsed)."""
    template = _template(tokenizer)
    return "string" if template is None else template_format(template)


def knows_developer(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template names the developer role (vLLM's check: the
    quoted role in its text); one that does not gets developer messages as system ones."""
    template = _template(tokenizer)
    return template is not None and ("'developer'" in template or '"developer"' in template)


def _template(tokenizer: Any) -> str | None:
    """The text of the chat template apply_chat_template uses; None where there is none."""
    try:
        template = tokenizer.get_chat_template()
    except Exception:  # no chat template: rendering fails on its own, naming it
        return None
    return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=32)
def template_format(template: str) -> ContentFormat:
    """The content format of one chat template's text (parsed once per template)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(template).environment.parse(template)
        return "openai" if any(_content_loops(ast)) else "string"
    except Exception:  # a template jinja cannot parse renders as text would
        return "string"


def _content_loops(ast: Any) -> Iterator[Any]:
    """The loops over a message's content: `for x in m.content` where m is a loop variable
    over the messages (or a variable set from them, such as `messages[1:]`)."""
    messages = _aliases(ast, MESSAGES)
    message_names = {
        loop.target.name
        for loop in ast.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, m) for m in messages)
    }
    for loop in ast.find_all(nodes.For):
        if any(_reads(loop.iter, m, "content") for m in message_names):
            yield loop


def _aliases(ast: Any, name: str) -> set[str]:
    """name and every variable set from it, one from another (`{% set rest = messages[1:] %}`)."""
    found, todo = {name}, [name]
    while todo:
        source = todo.pop()
        for assign in ast.find_all(nodes.Assign):
            target = assign.target
            named = isinstance(target, nodes.Name) and target.name not in found
            if named and _reads(assign.node, source):
                found.add(target.name)
                todo.append(target.name)
    return found


def _reads(node: Any, name: str, key: str | None = None) -> bool:
    """node is the variable `name` (or its `key` item: name.key, name['key']), through
    filters, tests and slices."""
    while _wraps(node):
        node = node.node
    if key is not None:
        if isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            if node.arg.value != key:
                return False
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _wraps(node: Any) -> bool:
    """node is a filter, test or slice of the node inside it (`messages[1:] | reverse`)."""
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None
    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
