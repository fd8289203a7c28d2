"""Tool-call and reasoning parsers against the real chat templates of their families (tests/chat_templates).

References: transformers' own apply_chat_template on the same template (our sandboxed render must
equal it), and the calls each template writes into an earlier assistant turn, which the family's
parser must read back as the calls given.
"""

from __future__ import annotations

import copy
import json

import pytest
from reasoning_model import TEMPLATES

from deepinfer.core.reasoning import Opening, ReasoningSplit, detect_reasoning_parser, make_reasoning_parser
from deepinfer.core.structured.tool_parsers import ToolCallStream, detect_tool_parser, make_tool_parser
from deepinfer.core.structured.tools import ToolPlan, render_chat
from deepinfer.core.tokenizer import Tokenizer

FAMILIES = {"qwen3.jinja": ("hermes", "qwen3"), "qwen3_coder.jinja": ("qwen3_coder", None),
            "llama3.2_pythonic.jinja": ("pythonic", None)}
ROOM = {"type": "function", "function": {"name": "book_room", "description": "Book a hotel room", "parameters": {
    "type": "object", "properties": {"nights": {"type": "integer"}, "breakfast": {"type": "boolean"},
                                     "rate": {"type": "number"}}, "required": ["nights"]}}}
ARGUMENTS = {"nights": 3, "breakfast": True, "rate": 99.5}


def family_tokenizer(tiny_tokenizer, template: str) -> Tokenizer:
    hf_tokenizer = copy.deepcopy(tiny_tokenizer)
    hf_tokenizer.chat_template = (TEMPLATES / template).read_text()
    return Tokenizer(hf_tokenizer)


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_parsers_are_picked_from_the_template(tiny_tokenizer, template):
    tool_parser, reasoning_parser = FAMILIES[template]
    source = (TEMPLATES / template).read_text()
    assert detect_tool_parser(source) == tool_parser
    assert detect_reasoning_parser(source) == reasoning_parser
    tokenizer = family_tokenizer(tiny_tokenizer, template)
    assert make_tool_parser(None, tokenizer).name == tool_parser
    assert make_reasoning_parser("none", tokenizer) is None


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_the_templates_calls_read_back_as_the_calls_given(tiny_tokenizer, template):
    """An earlier call, rendered by the family's template (as transformers renders it), is what the
    family's parser reads back, whole and streamed in pieces."""
    tokenizer = family_tokenizer(tiny_tokenizer, template)
    parser = make_tool_parser(None, tokenizer)
    plan = ToolPlan.make([ROOM], "auto", None, parser)
    conversation = [{"role": "user", "content": "Book three nights."},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "book_room", "arguments": json.dumps(ARGUMENTS)}}]}]
    ours = render_chat(tokenizer, conversation, False, parser, plan)
    reference_turn = {**conversation[1], "content": "", "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "book_room", "arguments": ARGUMENTS}}]}
    reference = tokenizer.hf_tokenizer.apply_chat_template([conversation[0], reference_turn], tools=[ROOM],
                                                           tokenize=False, date_string="26 Jul 2024")
    assert ours.replace(_today(ours), "26 Jul 2024") == reference
    turn = reference.rsplit("assistant", 1)[1]
    reply = turn.split("<|im_end|>")[0].split("<|eot_id|>")[0].split("<|end_header_id|>\n\n")[-1].strip()
    thinking = make_reasoning_parser(None, tokenizer)
    if thinking is not None:  # Qwen3 writes an empty reasoning block before the calls
        _, reply = ReasoningSplit(thinking, Opening.OPTIONAL).split(reply)
    content, calls = parser.extract(reply, tools=plan.tools)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("book_room", ARGUMENTS)] and not content
    stream, arguments = ToolCallStream(parser, tools=plan.tools), ""
    for i in range(0, len(reply), 3):
        _, deltas = stream.feed(reply[i:i + 3], final=i + 3 >= len(reply))
        arguments += "".join(d["function"]["arguments"] for d in deltas)
    assert json.loads(arguments) == ARGUMENTS


def _today(prompt: str) -> str:
    """The date the Llama template wrote (strftime_now), or a string it does not hold."""
    marker = "Today Date: "
    return prompt.split(marker, 1)[1].split("\n", 1)[0] if marker in prompt else "\0"


def test_qwen3_template_decides_where_the_reasoning_starts(tiny_tokenizer):
    tokenizer = family_tokenizer(tiny_tokenizer, "qwen3.jinja")
    parser = make_reasoning_parser(None, tokenizer)
    ask = [{"role": "user", "content": "Hi"}]
    thinking = tokenizer.apply_chat_template(ask)
    closed = tokenizer.apply_chat_template(ask, template_variables={"enable_thinking": False})
    assert parser.opening(thinking) is Opening.OPTIONAL and parser.opening(closed) is Opening.CLOSED
    assert parser.opening(thinking + "<think>\n") is Opening.INSIDE  # a template that opens the block itself
    # the template drops an earlier turn's reasoning from the history, as Qwen3 expects
    history = ask + [{"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello!"},
                     {"role": "user", "content": "Again"}]
    assert "plan" not in tokenizer.apply_chat_template(history)


@pytest.mark.parametrize("opening, reply, split", [
    (Opening.OPTIONAL, "<think>\nStep one.\n\nStep two.\n</think>\n\nThe answer.", ("Step one.\n\nStep two.", "The answer.")),
    (Opening.OPTIONAL, "No thinking here.", (None, "No thinking here.")),
    (Opening.INSIDE, "Step one.\n</think>\n\nThe answer.", ("Step one.", "The answer.")),
    (Opening.INSIDE, "Cut off while thin", ("Cut off while thin", "")),
    (Opening.CLOSED, "<think>x</think>y", (None, "<think>x</think>y")),
])
def test_streamed_reasoning_adds_up_to_the_split(opening, reply, split):
    reasoning = ReasoningSplit(make_reasoning_parser("qwen3", None), opening)
    assert reasoning.split(reply) == split
    for size in (1, 2, 5):
        stream, thought, content = reasoning.stream(), "", ""
        for i in range(0, len(reply), size):
            thinking_delta, content_delta = stream.feed(reply[i:i + size], final=i + size >= len(reply))
            thought, content = thought + thinking_delta, content + content_delta
            assert not (thinking_delta and content)  # no reasoning once the content began
        assert (thought or None, content) == split


@pytest.mark.parametrize("unfolded", [False, True])
def test_chat_shows_thinking_dimmed_and_apart_from_the_answer(unfolded):
    from deepinfer.cli.thinking import DIM, RESET, ThinkingView

    reasoning = ReasoningSplit(make_reasoning_parser("qwen3", None), Opening.OPTIONAL)
    screen: list[str] = []
    view = ThinkingView(reasoning.stream(), screen.append, unfolded)
    reply = "<think>\nLet me see.\n</think>\n\nParis."
    for i in range(0, len(reply), 4):
        view.feed(reply[i:i + 4])
    view.finish()
    shown = "".join(screen)
    answer_at = shown.rindex("Paris.")
    assert shown.endswith("Paris.") and DIM in shown[:answer_at] and RESET in shown[:answer_at]
    assert ("Let me see." in shown) == unfolded  # folded: only a count of the thinking
    assert "<think>" not in shown and view.thinking == "Let me see."
