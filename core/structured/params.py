"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's fields).

Exactly one of:
- `json`: a JSON Schema (a dict, or its JSON text); the output is one JSON value that validates;
- `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`);
- `regex`: the whole output matches this regular expression (Rust `regex` syntax: no look-around,
  no backreferences);
- `choice`: the output is exactly one of these strings;
- `grammar`: a context-free grammar, in llama.cpp's GBNF or llguidance's Lark syntax.

`reasoning`: the reasoning the reply may start with, which the constraint does not apply to
(reasoning_gate.py); the server sets it for a reasoning model's chat requests. A span with a
budget may also stand alone, with none of the kinds above (kind "free"): the reasoning is capped
and the answer is free.

`strict` (JSON only): True refuses a schema that uses a keyword the grammar engine cannot enforce
(the request gets a 400 that names it); False ignores such keywords, as a best effort (OpenAI's
`strict: false`). Checked here: the kind and the size (so a huge constraint never reaches the
compiler); the compiler (compiler.py) checks the rest.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

from deepinfer.core.structured.reasoning_gate import ReasoningSpan

# Largest constraint text accepted (a JSON schema as compact JSON, a regex, a grammar, the choices).
MAX_CONSTRAINT_CHARS = 128 * 1024  # room for an agent's many tools (each parameters schema is in the grammar)
MAX_CHOICES = 1024

KINDS = ("json", "json_object", "regex", "choice", "grammar")
FREE = "free"  # no constraint of its own: only the reasoning span's budget


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    strict: bool = True
    reasoning: ReasoningSpan | None = None

    def __post_init__(self) -> None:
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningSpan):
            raise TypeError("reasoning must be a ReasoningSpan")
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        budget_alone = not given and self.reasoning is not None and self.reasoning.budget is not None
        if len(given) != 1 and not budget_alone:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, grammar"
                             + (f"; got {', '.join(given)}" if given else ""))
        if isinstance(self.json, str):
            _check_size("json", len(self.json))
            try:
                self.json = jsonlib.loads(self.json)
            except (ValueError, RecursionError) as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("grammar must be a string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"choice has {len(self.choice)} entries; at most {MAX_CHOICES} are accepted")
            self.choice = list(self.choice)
        if not isinstance(self.json_object, bool) or not isinstance(self.strict, bool):
            raise TypeError("json_object and strict must be booleans")
        _check_size(self.kind, len(self.text))

    @property
    def kind(self) -> str:
        return next((kind for kind in KINDS if getattr(self, kind) not in (None, False)), FREE)

    @property
    def text(self) -> str:
        """The constraint as one string: a schema as compact JSON (key order kept: it is the
        order the output writes properties in), the choices as a JSON list."""
        if self.json is not None:
            try:
                return jsonlib.dumps(self.json, separators=(",", ":"), ensure_ascii=False)
            except (ValueError, RecursionError) as err:
                raise ValueError(f"the JSON schema cannot be serialized: {err}") from None
        if self.json_object or self.kind == FREE:
            return ""
        if self.choice is not None:
            return jsonlib.dumps(self.choice, ensure_ascii=False)
        return self.regex if self.regex is not None else self.grammar

    @property
    def cache_key(self) -> tuple[str, str, bool, ReasoningSpan | None]:
        """Equal keys compile to the same grammar."""
        return self.kind, self.text, self.strict, self.reasoning

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams:
        """A StructuredOutputsParams from itself or from a dict of its fields (the Python API takes both)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {*KINDS, "strict"}
            if unknown:
                raise ValueError(f"unknown structured outputs field(s): {', '.join(sorted(unknown))}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


def _check_size(kind: str, num_chars: int) -> None:
    if num_chars > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"the {kind} constraint has {num_chars} characters; at most {MAX_CONSTRAINT_CHARS} "
                         f"are accepted")
