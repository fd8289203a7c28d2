"""A constraint that starts where the reasoning ends: the grammar wrapped around a request's grammar.

A reasoning model writes `<think> ... </think>` before its answer, and a JSON schema or a tool
call constrains only the answer. The gate is one llguidance grammar, so the engine's matcher
and mask need nothing new: any tokens but the end marker (each of the vocabulary's ids, the
padded ones excluded) until the end-marker token, up to a few newlines, then the request's
own grammar. When the reply may open its reasoning itself (Qwen3's default) the whole block is
optional, so its first token may be the start marker or whatever the constraint allows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CONSTRAINT_GRAMMAR = "constraint"
MAX_NEWLINES_AFTER = 2  # "</think>\n\n" is how Qwen3 and DeepSeek-R1 end their reasoning


@dataclass(frozen=True)
class ReasoningSpan:
    """The reasoning a constrained reply may start with (token ids of its single-token markers)."""

    end_token_id: int
    start_token_id: int | None = None  # None: the prompt opened the reasoning; else the reply may open it


def gated_grammar(constraint_grammar: str, span: ReasoningSpan, num_tokens: int) -> str:
    """llguidance's grammar (its JSON form, or Lark text as llguidance.grammar_from writes it) for
    `constraint_grammar` after the reasoning `span`; `num_tokens`: the tokenizer's real ids."""
    if constraint_grammar.lstrip().startswith("{"):
        grammars = json.loads(constraint_grammar)["grammars"]
    else:
        grammars = [{"lark_grammar": constraint_grammar}]
    grammars = [dict(g) for g in grammars]
    grammars[0]["name"] = grammars[0].get("name") or CONSTRAINT_GRAMMAR
    end = span.end_token_id
    free = ",".join(f"{a}-{b}" for a, b in ((0, end - 1), (end + 1, num_tokens - 1)) if a <= b)
    block = f"<[{free}]>* <[{end}]> /\\n{{0,{MAX_NEWLINES_AFTER}}}/"
    if span.start_token_id is not None:
        block = f"(<[{span.start_token_id}]> {block})?"
    gate = f"start: {block} @{grammars[0]['name']}\n"
    return json.dumps({"grammars": [{"name": "reasoning_gate", "lark_grammar": gate}, *grammars]})
