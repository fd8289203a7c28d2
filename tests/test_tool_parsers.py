"""Tool-call parsers and tool plans, without a model.

References: replies written by hand in each family's format (as Qwen2.5, Llama 3.1 and Mistral
write them), json.loads and jsonschema, transformers' own apply_chat_template. Streaming is checked
against the non-streaming parse for every way of cutting the reply into deltas; each format's
grammar is checked by random walks over SmolLM2's vocabulary: whatever the grammar lets through
parses into calls whose arguments validate.
"""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.core.structured.compiler import GrammarCompiler
from deepinfer.core.structured.tool_parsers import (
    TOOL_PARSERS,
    ToolCallStream,
    detect_tool_parser,
    make_tool_parser,
)
from deepinfer.core.structured.tools import ToolPlan, parse_tools, render_chat, template_messages
from deepinfer.core.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}, "strict": True}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}/[A-Z][a-z]{1,8}$"}}, "required": ["zone"],
        "additionalProperties": False},
    "strict": True}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}

REPLIES = {
    "hermes": ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
               '"Europe/Paris"}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}'),
    "mistral": ('I will check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                '"celsius"}}, {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]'),
    # as Qwen3-Coder writes them (the format its template describes)
    "qwen3_coder": ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>"),
    # as Llama 3.2 and 4 write them
    "pythonic": '[get_weather(city="Paris", unit=\'celsius\'), get_time(zone="Europe/Paris")]',
}
CONTENTS = {"hermes": "I will check.\n", "llama3_json": None, "mistral": "I will check.",
            "qwen3_coder": "I will check.\n", "pythonic": None}
PARSED_TOOLS = parse_tools([WEATHER, TIME])
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Europe/Paris"})]


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_extract_reads_the_familys_reply(name):
    content, calls = TOOL_PARSERS[name]().extract(REPLIES[name], tools=PARSED_TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED_CALLS
    assert content == CONTENTS[name]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    _, first_only = TOOL_PARSERS[name]().extract(REPLIES[name], parallel=False, tools=PARSED_TOOLS)
    assert [c.name for c in first_only] == ["get_weather"]


@pytest.mark.parametrize("name, reply", [
    ("hermes", "Just text, no call."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'),  # broken JSON
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut off by max_tokens
    ("llama3_json", 'The answer is {"name": "x"}.'),
    ("llama3_json", '{"title": "a JSON answer that is not a call"}'),
    ("mistral", "No calls here."),
])
def test_replies_without_valid_calls_stay_content(name, reply):
    content, calls = TOOL_PARSERS[name]().extract(reply)
    assert calls == [] and content == reply


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(REPLIES)), data=st.data())
def test_streamed_deltas_add_up_to_the_plain_answer(name, data):
    parser = TOOL_PARSERS[name]()
    whole = data.draw(st.booleans())
    reply = REPLIES[name] if whole else "Just " + REPLIES[name][:50]  # cut off inside the first call
    cuts = sorted(data.draw(st.sets(st.integers(1, len(reply) - 1), max_size=12)))
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    stream = ToolCallStream(parser, tools=PARSED_TOOLS)
    content, names, arguments, ids = "", {}, {}, {}
    for i, piece in enumerate(pieces):
        content_delta, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += content_delta
        for delta in deltas:
            index = delta["index"]
            if "id" in delta:
                assert index not in ids and delta["function"]["arguments"] == ""
                ids[index], names[index] = delta["id"], delta["function"]["name"]
            arguments[index] = arguments.get(index, "") + delta["function"]["arguments"]
    want_content, want_calls = parser.extract(reply, tools=PARSED_TOOLS)
    if not whole:  # a call cut off: the stream may have sent its start; the plain answer keeps it as text
        assert want_calls == [] and want_content.startswith(content)
        return
    assert content == (want_content or "")
    assert [names[i] for i in sorted(names)] == [c.name for c in want_calls]
    assert [arguments[i] for i in sorted(arguments)] == [c.arguments for c in want_calls]


@pytest.fixture(scope="module")
def smol_compiler(smollm2_gguf):
    tokenizer = Tokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return tokenizer, GrammarCompiler(tokenizer, 49152, tokenizer.eos_token_ids)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_call_grammars_only_let_valid_calls_through(smol_compiler, name, tool_choice):
    """Random walks over the whole vocabulary under the tool_choice grammar: every finished walk is
    a list of calls (one of get_time for the named choice) whose arguments validate."""
    import torch

    tokenizer, compiler = smol_compiler
    parser = make_tool_parser(name, tokenizer)
    plan = ToolPlan.make([WEATHER, TIME], tool_choice, parallel_tool_calls=True, parser=parser)
    compiled = compiler.compile(plan.constraint)
    eos = sorted(tokenizer.eos_token_ids)
    finished = 0
    for seed in range(4):
        rng, grammar, output = random.Random(seed), compiled.new_request_grammar(), []
        for _ in range(300):
            words = torch.frombuffer(bytearray(grammar.matcher.compute_bitmask()), dtype=torch.int32)
            bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)
            token = rng.choice(bits.nonzero().flatten().tolist())
            if token in eos:
                break
            output.append(token)
            grammar.catch_up(output)
        else:
            continue
        finished += 1
        content, calls = parser.extract(tokenizer.decode(output), tools=plan.tools)
        assert content is None and calls, tokenizer.decode(output)
        if isinstance(tool_choice, dict):
            assert [c.name for c in calls] == ["get_time"]
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert finished >= 2


def test_detect_tool_parser_from_templates():
    assert detect_tool_parser("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_tool_parser("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]") == "mistral"
    assert detect_tool_parser("<|start_header_id|>ipython<|end_header_id|>{{ tools }}") == "llama3_json"
    assert detect_tool_parser("<|im_start|>{{ m['content'] }}") == "hermes"  # no tools: deepinfer's fallback
    assert detect_tool_parser(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_tool_parser("nope", None)


@pytest.mark.parametrize("tools, tool_choice, message", [
    ([WEATHER], {"type": "function", "function": {"name": "missing"}}, "not among the tools"),
    ([], "required", "at least one tool"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([WEATHER, WEATHER], "auto", "used twice"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "letters, digits"),
    ([{"type": "retrieval"}], "auto", "only tools of type 'function'"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "JSON Schema object"),
])
def test_tool_plan_refuses_what_openai_refuses(tools, tool_choice, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ToolPlan.make(tools, tool_choice, None, TOOL_PARSERS["hermes"]())


def test_tool_choice_defaults_and_none():
    parser = TOOL_PARSERS["hermes"]()
    assert ToolPlan.make([WEATHER], None, None, parser).choice == "auto"
    assert ToolPlan.make(None, None, None, parser).choice == "none"
    none = ToolPlan.make([WEATHER], "none", None, parser)
    assert none.tools == [] and not none.parses_calls and none.constraint is None
    assert ToolPlan.make([WEATHER], "auto", None, parser).constraint is None


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_templates_without_tools_get_them_described_in_the_parsers_format():
    parser = TOOL_PARSERS["hermes"]()
    plan = ToolPlan.make([WEATHER], "auto", None, parser)
    messages = template_messages(CONVERSATION, parser, plan, supports_tools=False)
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": parser.format_call(
        "get_weather", {"city": "Paris", "unit": "celsius"})}
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"temperature": 21}\n</tool_response>'}


QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_templates_with_tools_render_them_as_transformers_does(tiny_tokenizer):
    hf_tokenizer = copy.deepcopy(tiny_tokenizer)  # the session's tokenizer keeps its own template
    hf_tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    tokenizer = Tokenizer(hf_tokenizer)
    parser = make_tool_parser(None, tokenizer)
    assert parser.name == "hermes"
    plan = ToolPlan.make([WEATHER], "auto", None, parser)
    ours = render_chat(tokenizer, CONVERSATION, True, parser, plan)
    reference_messages = [dict(m) for m in CONVERSATION]
    reference_messages[1] = {**CONVERSATION[1], "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    reference = hf_tokenizer.apply_chat_template(reference_messages, tools=[WEATHER_RENDERED], tokenize=False,
                                                 add_generation_prompt=True)
    assert ours == reference
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}' in ours


WEATHER_RENDERED = {"type": "function", "function": {k: v for k, v in WEATHER["function"].items() if k != "strict"}}
