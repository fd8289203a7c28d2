"""Reading JSON that is still being written: where a value ends, and an object's fields so far.

Tool calls stream token by token, so the parsers see `{"name": "get_weather", "argu` and must
tell what is settled. These scanners never guess: a value is complete only once its last
character is there, and a field's value text only ever grows as more text arrives (what the
streaming deltas rely on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_SCALAR_END = ",}] \t\n\r:"


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
    """text[pos] is '"': the index after the closing quote, or None if the string is unfinished."""
    i = pos + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """The index after the JSON value that starts at text[pos] (no leading whitespace), or None
    while it is unfinished. Only the nesting is checked, not the value's validity."""
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        return string_end(text, pos)
    if first not in "{[":
        end = pos
        while end < len(text) and text[end] not in _SCALAR_END:
            end += 1
        return end if end < len(text) else None  # a number may still grow
    depth, i = 0, pos
    while i < len(text):
        char = text[i]
        if char == '"':
            end = string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


@dataclass
class Field:
    start: int  # index of the value's first character
    end: int | None  # index after it; None while unfinished


@dataclass
class PartialObject:
    fields: dict[str, Field]  # the keys read so far, in order
    end: int | None  # index after the closing '}'; None while unfinished

    def string(self, text: str, key: str) -> str | None:
        """The field's value once it is a complete JSON string."""
        field = self.fields.get(key)
        if field is None or field.end is None or text[field.start] != '"':
            return None
        try:
            return json.loads(text[field.start:field.end])
        except ValueError:
            return None

    def raw(self, text: str, key: str) -> tuple[str, bool] | None:
        """The field's value text so far and whether it is complete; None if the key is not there yet."""
        field = self.fields.get(key)
        if field is None:
            return None
        return text[field.start:len(text) if field.end is None else field.end], field.end is not None


def read_object(text: str, pos: int) -> PartialObject | None:
    """The object that starts at text[pos] == '{', as far as the text goes; None if what follows is
    not an object's syntax."""
    fields: dict[str, Field] = {}
    i = skip_whitespace(text, pos + 1)
    while i < len(text):
        if text[i] == "}":
            return PartialObject(fields, i + 1)
        if text[i] != '"':
            return None
        key_end = string_end(text, i)
        if key_end is None:
            return PartialObject(fields, None)
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return None
        i = skip_whitespace(text, key_end)
        if i >= len(text):
            return PartialObject(fields, None)
        if text[i] != ":":
            return None
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return PartialObject(fields, None)
        end = value_end(text, i)
        fields[key] = Field(i, end)
        if end is None:
            return PartialObject(fields, None)
        i = skip_whitespace(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_whitespace(text, i + 1)
        elif i < len(text) and text[i] != "}":
            return None
    return PartialObject(fields, None)
