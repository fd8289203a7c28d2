"""A constraint that starts where the reasoning ends: the grammar wrapped around a request's grammar.

A reasoning model writes `<think> ... </think>` before its answer, and a JSON schema or a tool
call constrains only the answer. The gate is one llguidance grammar, so the engine's matcher
and mask need nothing new: any tokens but the end marker (each of the vocabulary's ids, the
padded ones excluded) until the end-marker token, up to a few newlines, then the request's
own grammar. When the reply may open its reasoning itself (Qwen3's default) the whole block is
optional, so its first token may be the start marker or whatever the constraint allows.

A reasoning budget (`thinking_token_budget`, the Messages API's `thinking.budget_tokens`) bounds
the block: at most that many tokens between the markers, then the end marker is the one token
allowed, as vLLM's and llama-server's budgets force it. A budget needs no constraint: without
one the answer after the end marker is free (any token, the end of sequence too), and a reply
that may open its reasoning and does not is free from its first token.
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
    budget: int | None = None  # at most this many tokens between the markers; None: unbounded


def _tokens_but(excluded: int, num_tokens: int) -> str:
    """A Lark token-set terminal: every real id except `excluded`."""
    ranges = ((0, excluded - 1), (excluded + 1, num_tokens - 1))
    return "<[" + ",".join(f"{a}-{b}" for a, b in ranges if a <= b) + "]>"


def gated_grammar(constraint_grammar: str | None, span: ReasoningSpan, num_tokens: int) -> str:
    """llguidance's grammar (its JSON form, or Lark text as llguidance.grammar_from writes it) for
    `constraint_grammar` after the reasoning `span` (None: the answer is free, and only the span's
    budget constrains the reply); `num_tokens`: the tokenizer's real ids."""
    length = "*" if span.budget is None else f"{{0,{span.budget}}}"
    block = f"{_tokens_but(span.end_token_id, num_tokens)}{length} <[{span.end_token_id}]>"
    opens = span.start_token_id is not None
    if constraint_grammar is None:
        anything = f"<[0-{num_tokens - 1}]>*"
        if opens:  # a first token other than the start marker: no reasoning, the whole reply is free
            block = f"(<[{span.start_token_id}]> {block} | {_tokens_but(span.start_token_id, num_tokens)})"
        body = f"({block} {anything})?" if opens else f"{block} {anything}"
        return json.dumps({"grammars": [{"name": "reasoning_gate", "lark_grammar": f"start: {body}\n"}]})
    if constraint_grammar.lstrip().startswith("{"):
        grammars = json.loads(constraint_grammar)["grammars"]
    else:
        grammars = [{"lark_grammar": constraint_grammar}]
    grammars = [dict(g) for g in grammars]
    grammars[0]["name"] = grammars[0].get("name") or CONSTRAINT_GRAMMAR
    block = f"{block} /\\n{{0,{MAX_NEWLINES_AFTER}}}/"
    if opens:
        block = f"(<[{span.start_token_id}]> {block})?"
    gate = f"start: {block} @{grammars[0]['name']}\n"
    return json.dumps({"grammars": [{"name": "reasoning_gate", "lark_grammar": gate}, *grammars]})
