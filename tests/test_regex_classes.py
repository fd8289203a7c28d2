"""Regex class escapes as clients mean them (ECMA-262): \\d is [0-9], \\w is [0-9A-Za-z_], \\s is
ECMA-262's white space and line terminators, in regex constraints and JSON Schema patterns.

The reference is Python's `re` with re.ASCII (its \\d and \\w are ECMA-262's) and, for \\s, an
explicit class of ECMA-262's white space written out here from the standard; the engine side is
what llguidance's compiled matcher accepts, fed the string's UTF-8 bytes over a byte vocabulary.
Random regexes (hypothesis) mix the escapes with literals and ranges inside and outside character
classes, negated classes included; every string is checked against the reference.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.core.structured.compiler import GrammarCompiler, GrammarError
from deepinfer.core.structured.params import StructuredOutputsParams
from deepinfer.core.tokenizer import ByteTokenizer

# ECMA-262 WhiteSpace (TAB, VT, FF, SP, NBSP, ZWNBSP, Zs) and LineTerminator (LF, CR, LS, PS).
ECMA_SPACE = "\t\x0b\x0c \xa0\ufeff\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
             "\u202f\u205f\u3000\n\r\u2028\u2029"
PY_SPACE = "[" + "".join(f"\\U{ord(c):08x}" for c in ECMA_SPACE) + "]"
PY_NOT_SPACE = "[^" + PY_SPACE[1:]

# Characters the strings are made of: ASCII digits, letters, "_" and punctuation, Unicode digits
# (Arabic-Indic, fullwidth, segmented), letters, and white space in and out of each definition.
ALPHABET = list("059aZ_-.!") + ["\u0663", "\uff15", "\U0001fbf8", "\u00e9", "\u0436", "\u00b2"] + \
    [" ", "\t", "\n", "\x0b", "\x0c", "\r", "\xa0", "\u2028", "\u3000", "\ufeff", "\x85", "\u180e", "\x1c"]
LITERALS = list("09aZ_-")
ESCAPES = ["\\d", "\\D", "\\w", "\\W", "\\s", "\\S"]
PY_ESCAPE = {"\\d": "\\d", "\\D": "\\D", "\\w": "\\w", "\\W": "\\W", "\\s": PY_SPACE, "\\S": PY_NOT_SPACE}


@pytest.fixture(scope="module")
def compiler():
    tokenizer = ByteTokenizer(260)
    return GrammarCompiler(tokenizer, 260, {259})


def engine_accepts(compiler, params: StructuredOutputsParams, text: str) -> bool:
    matcher = compiler.compile(params).new_request_grammar().matcher
    for byte in text.encode("utf-8"):
        if not matcher.consume_token(byte):
            return False
    return matcher.is_accepting()


# Random regexes, each as (Rust-syntax regex for the engine, Python regex for the reference) ------------

def _literal(char: str) -> tuple[str, str]:
    return ("\\-" if char == "-" else char), re.escape(char)


@st.composite
def class_parts(draw) -> tuple[str, str]:
    kind = draw(st.sampled_from(["literal", "escape", "range"]))
    if kind == "literal":
        return _literal(draw(st.sampled_from(LITERALS)))
    if kind == "escape":
        escape = draw(st.sampled_from(ESCAPES))
        return escape, PY_ESCAPE[escape]
    low, high = draw(st.sampled_from([("0", "5"), ("a", "z"), ("A", "Z")]))
    return f"{low}-{high}", f"[{low}-{high}]"


@st.composite
def pieces(draw) -> tuple[str, str]:
    kind = draw(st.sampled_from(["literal", "escape", "class", "negated class"]))
    if kind == "literal":
        return _literal(draw(st.sampled_from(LITERALS)))
    if kind == "escape":
        escape = draw(st.sampled_from(ESCAPES))
        return escape, PY_ESCAPE[escape]
    parts = draw(st.lists(class_parts(), min_size=1, max_size=3))
    union = "(?:" + "|".join(py for _, py in parts) + ")"  # one character matching any part
    if kind == "class":
        return "[" + "".join(rust for rust, _ in parts) + "]", union
    return "[^" + "".join(rust for rust, _ in parts) + "]", f"(?!{union})(?s:.)"


@st.composite
def regexes(draw) -> tuple[str, str]:
    drawn = draw(st.lists(pieces(), min_size=1, max_size=3))
    quantifier = draw(st.sampled_from(["", "", "+", "?"]))
    rust = "".join(r for r, _ in drawn)
    py = "".join(f"(?:{p})" for _, p in drawn)
    return (f"(?:{rust}){quantifier}", f"(?:{py}){quantifier}") if quantifier else (rust, py)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regex=regexes(), strings=st.lists(st.lists(st.sampled_from(ALPHABET), max_size=4).map("".join),
                                         min_size=8, max_size=8))
def test_random_regexes_match_as_python_re_ascii_does(compiler, regex, strings):
    rust, py = regex
    params = StructuredOutputsParams(regex=rust)
    try:
        compiler.compile(params)
    except GrammarError:  # llguidance refuses a regex that matches nothing ("[^\\d\\D]")
        assert not any(re.fullmatch(py, text, re.ASCII) for text in strings + ALPHABET + [""]), rust
        return
    for text in strings:
        expected = re.fullmatch(py, text, re.ASCII) is not None
        assert engine_accepts(compiler, params, text) == expected, (rust, py, text)


@pytest.mark.parametrize("regex", ESCAPES + [f"[{e}]" for e in ESCAPES] + [f"[^{e}]" for e in ESCAPES]
                         + ["[\\d_]", "[^\\d_]", "[\\S\\d]", "[^\\W\\d]", "[a\\s]", "[^a\\s]"])
def test_every_character_of_one_class(compiler, regex):
    """Each single-character class against the whole alphabet (U+1FBF8 and the Arabic-Indic digits included)."""
    params = StructuredOutputsParams(regex=regex)
    for char in ALPHABET:
        expected = _reference_one_char(regex, char)
        assert engine_accepts(compiler, params, char) == expected, (regex, repr(char))


def _reference_one_char(regex: str, char: str) -> bool:
    """Whether `char` is in the class `regex` (an escape, or [..] / [^..] of literals and escapes)."""
    negated = regex.startswith("[^")
    body = regex[2:-1] if negated else (regex[1:-1] if regex.startswith("[") else regex)
    items = re.findall(r"\\.|.", body)
    hit = any(re.fullmatch(PY_ESCAPE.get(item, re.escape(item)), char, re.ASCII) for item in items)
    return hit != negated


def test_a_phone_number_regex_refuses_unicode_digits(compiler):
    params = StructuredOutputsParams(regex="\\d{3}-\\d{4}")
    assert engine_accepts(compiler, params, "555-1234")
    assert not engine_accepts(compiler, params, "555-123\U0001fbf8")
    assert not engine_accepts(compiler, params, "\u0663\u0663\u0663-1234")


@pytest.mark.parametrize("pattern", ["^\\d+$", "^\\w+$", "^\\s+$", "^\\S+$", "^\\D+$", "^\\W+$", "^[\\s_]+$",
                                     "^[^\\s]+$", "^[^\\d\\s]+$"])
def test_json_schema_patterns(compiler, pattern):
    """`pattern` in a JSON Schema: the string's value (JSON-escaped in the output) against Python's re."""
    params = StructuredOutputsParams(json={"type": "string", "pattern": pattern})
    py = pattern.replace("\\s", PY_SPACE).replace("\\S", PY_NOT_SPACE)
    for char in ALPHABET:
        for text in (char, char * 2):
            if "[" in pattern:  # a class: decide each character against the items, as above
                expected = _reference_one_char(pattern[1:-2], char)
            else:
                expected = re.fullmatch(py[1:-1], text, re.ASCII) is not None
            assert engine_accepts(compiler, params, json.dumps(text, ensure_ascii=False)) == expected, \
                (pattern, repr(text))


def test_patterns_inside_a_schema_and_not_in_its_data(compiler):
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": "^\\s$"}},
              "patternProperties": {"^\\d$": {"type": "integer"}}, "additionalProperties": False,
              "default": {"pattern": "\\s"}}
    params = StructuredOutputsParams(json=schema)
    assert engine_accepts(compiler, params, json.dumps({"pattern": "\ufeff"}, ensure_ascii=False))
    assert not engine_accepts(compiler, params, json.dumps({"pattern": "\x85"}, ensure_ascii=False))
    assert engine_accepts(compiler, params, json.dumps({"7": 1}))
    assert not engine_accepts(compiler, params, json.dumps({"\u0663": 1}, ensure_ascii=False))
