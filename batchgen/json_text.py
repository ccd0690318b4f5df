"""JSON text that an input brings (a JSONL line, a cell of JSON text): parsed, or one line
saying why not, the same for every caller."""

from __future__ import annotations

import json
from typing import Any


def parse_json(text: str) -> Any:
    """text parsed; ValueError saying why it is not JSON ("Expecting value at column 3").
    Text nested deeper than Python's parser can follow ("nested too deeply") is one too: the
    parser raises RecursionError there, which would otherwise end the job for one value."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
