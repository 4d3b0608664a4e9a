"""The base of every JSON request body: unknown fields refused, strict types, and text that is valid Unicode.

Strict types, as the docs promise: an integer field takes a JSON integer (not true / false, a string or 2.0), a
number field a JSON number (an integer too), a flag only true or false, a string only a string. Lax parsing would
take "true" or 1 for a flag and true for a count, and quietly run something the client did not ask for.

Valid Unicode: JSON's \\ud800-style escapes can carry a lone UTF-16 surrogate, which Python keeps in the str but
no tokenizer (nor UTF-8) can encode. Such a string is a 400 that names the field, found before anything tokenizes it.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

_SURROGATE = re.compile("[\ud800-\udfff]")


class InvalidTextError(Exception):
    """A string of the request body holds a lone surrogate. Not a ValueError on purpose: pydantic lets it through
    to the app's handler, which answers 400 with `param` naming the field (server/error_responses.py)."""

    def __init__(self, param: str | None) -> None:
        where = param or "the request body"
        super().__init__(
            f"{where}: the text is not valid Unicode (it holds a lone UTF-16 surrogate, such as the escape "
            f"\\ud800 alone, which no tokenizer can encode); send valid UTF-8 text"
        )
        self.param = param


def lone_surrogate_at(value: Any) -> str | None:
    """The dotted path (pydantic's `loc` style: messages.0.content) of the first string, key or value, in a parsed
    JSON value that holds a lone surrogate ("" for the value itself); None when every string is valid Unicode.
    Walked with a stack of its own, so that no nesting depth can overflow Python's."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return ".".join(path)
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append((child, (*path, str(key))))
                stack.append((key, path))
        elif isinstance(item, list):
            stack.extend((child, (*path, str(i))) for i, child in reversed(list(enumerate(item))))
    return None


class StrictBody(BaseModel):
    """A request body (or a part of one): extra fields forbidden, strict types, valid Unicode."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise InvalidTextError(where or None)
        return data
