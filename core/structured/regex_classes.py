"""The regex class escapes \\d \\w \\s (and \\D \\W \\S) as OpenAI-style clients mean them.

Clients write regexes and JSON Schema `pattern`s in the ECMA-262 sense (JSON Schema says so, and
vLLM, xgrammar and Outlines read them so): `\\d` is [0-9], `\\w` is [0-9A-Za-z_], `\\s` is
ECMA-262's WhiteSpace and LineTerminator set. llguidance reads a regex constraint in Rust `regex`
syntax, where the three are Unicode classes (`\\d` takes "٣" and "🯸"), so each escape is spelled
out as an explicit class before the regex goes to it:

- `ecma_regex_classes(regex)`: a regex constraint (Rust syntax). Outside a character class an
  escape becomes a class (`\\D` -> `[^0-9]`); inside one it becomes a nested class, which Rust's
  syntax unites with the rest (`[^\\d.]` -> `[^[0-9].]`), so negated forms stay exact.
- `ecma_schema_patterns(schema)`: the `pattern`s and `patternProperties` of a JSON Schema.
  llguidance already reads `\\d` and `\\w` there as ECMA-262 does; its `\\s` is Unicode's
  White_Space, which differs from ECMA-262's in U+0085 and U+FEFF, so only `\\s` is spelled out,
  and `\\S` outside classes (ECMA-262 has no nested classes to hold `\\S` inside one, which is left
  to llguidance).

The written-out classes use escapes only (`\\x{...}`), so they mean the same under the `x` flag.
"""

from __future__ import annotations

from typing import Any

DIGIT = r"0-9"
WORD = r"0-9A-Za-z_"
# ECMA-262 WhiteSpace (TAB VT FF SP NBSP ZWNBSP, category Zs) and LineTerminator (LF CR LS PS).
SPACE = (r"\x{9}\x{A}\x{B}\x{C}\x{D}\x{20}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}"
         r"\x{205F}\x{3000}\x{FEFF}")
_ITEMS = {"d": DIGIT, "w": WORD, "s": SPACE}


def ecma_regex_classes(regex: str) -> str:
    """The Rust-syntax regex with \\d \\w \\s \\D \\W \\S replaced by their ECMA-262 classes."""
    out: list[str] = []
    depth = 0  # nesting of character classes at this point
    i, n = 0, len(regex)
    while i < n:
        char = regex[i]
        if char == "\\" and i + 1 < n:
            letter = regex[i + 1]
            if letter.lower() in _ITEMS:
                negated = "^" if letter.isupper() else ""
                out.append(f"[{negated}{_ITEMS[letter.lower()]}]")
            else:
                out.append(regex[i:i + 2])  # any other escape; a payload ({...}, hex digits) follows as text
            i += 2
            continue
        if char == "[":
            if depth and regex.startswith("[:", i):  # an ASCII class like [:alpha:] inside a class
                end = regex.find(":]", i + 2)
                if end >= 0:
                    out.append(regex[i:end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(char)
            i += 1
            # A "]" first in a class (after an optional "^") is a literal.
            if i < n and regex[i] == "^":
                out.append("^")
                i += 1
            if i < n and regex[i] == "]":
                out.append("]")
                i += 1
            continue
        if char == "]" and depth:
            depth -= 1
        out.append(char)
        i += 1
    return "".join(out)


def ecma_pattern_spaces(pattern: str) -> str:
    """An ECMA-262 pattern with \\s (everywhere) and \\S (outside classes) spelled out."""
    out: list[str] = []
    in_class = False
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\" and i + 1 < n:
            letter = pattern[i + 1]
            if letter == "s":
                out.append(SPACE if in_class else f"[{SPACE}]")
            elif letter == "S" and not in_class:
                out.append(f"[^{SPACE}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


# Keywords whose values are data, not schemas: their "pattern" keys are not regexes.
_DATA_KEYWORDS = ("const", "enum", "default", "examples")
# Keywords whose values map names to schemas: a name is not a keyword.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")


def ecma_schema_patterns(schema: Any) -> Any:
    """A copy of the JSON Schema with `ecma_pattern_spaces` applied to each `pattern` and each
    `patternProperties` key."""
    if isinstance(schema, list):
        return [ecma_schema_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            result[key] = value
        elif key == "pattern" and isinstance(value, str):
            result[key] = ecma_pattern_spaces(value)
        elif key == "patternProperties" and isinstance(value, dict):
            result[key] = {ecma_pattern_spaces(k): ecma_schema_patterns(v) for k, v in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            result[key] = {name: ecma_schema_patterns(v) for name, v in value.items()}
        else:
            result[key] = ecma_schema_patterns(value)
    return result
