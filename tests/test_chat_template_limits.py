"""Chat templates render as transformers renders them, within limits on time, loops and size.

The reference for what a template renders is transformers' own `apply_chat_template` on the same
tokenizer. Hostile templates (each a known way to hang a renderer or grow it to gigabytes) must
raise ChatTemplateError (a 400 at the server), the memory-hungry ones in a fresh interpreter whose
peak-RSS growth is recorded; a template that does not parse fails the model load in one line.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import CHATML_TEMPLATE
from hostile_probe import run_probe

from deepinfer.core.chat_template import ChatTemplate, ChatTemplateError, TemplateLimits
from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import InvalidRequestError, ModelLoadError
from deepinfer.core.models.loader import load_model
from deepinfer.core.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be  brief."}, {"role": "user", "content": "What is the capital?"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]

RICH_TEMPLATE = """
{%- set ns = namespace(system='', count=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = ns.system ~ m.content -%}{%- continue -%}{%- endif -%}
  {%- set ns.count = ns.count + 1 -%}
{%- endfor -%}
{{ bos_token }}{% if ns.system %}[SYS]{{ ns.system | trim | replace('  ', ' ') }}[/SYS]{% endif %}
{%- macro tag(role) -%}<{{ role | upper }}>{%- endmacro -%}
{%- for m in messages if m.role != 'system' -%}
{{ tag(m.role) }}{{ m.content }}{% if loop.last %} (last of {{ ns.count }}){% endif %}
{{- eos_token if m.role == 'assistant' else '' }}
{%- endfor -%}
{%- if add_generation_prompt %}{% generation %}<ASSISTANT>{% endgeneration %}{% endif -%}
{{ '%s|%d' % ('x', 3) }}{{ '{}-{}'.format('a', 2) }}{{ ('ab' * 2) ~ (range(3) | join(',')) }}
{{- dict(k=1) | tojson }}{{ messages[-1].content[:5] | center(9) }}{{ [1, 2] + [3] }}{{ 2 ** 10 }}
{%- for item in [{'n': 'a', 'kids': [{'n': 'b', 'kids': []}]}] recursive %}{{ item.n }}{{ loop(item.kids) }}
{%- endfor %}{{ messages | map(attribute='role') | unique | list | length }}{{ 'x\ty'.expandtabs(2) }}
"""


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, RICH_TEMPLATE], ids=["chatml", "rich"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_what_transformers_renders(tiny_tokenizer, template, add_generation_prompt):
    hf_tokenizer = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer,
                                            bos_token="<|im_start|>", eos_token="<|im_end|>")
    hf_tokenizer.chat_template = template
    ours = Tokenizer(hf_tokenizer).apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    reference = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False)
    assert ours == reference


def render(source: str, limits: TemplateLimits | None = None) -> str:
    return ChatTemplate(source, limits=limits).render(MESSAGES)


@pytest.mark.parametrize(("source", "message"), [
    ("{{ raise_exception('roles must alternate') }}", "TemplateError: roles must alternate"),
    ("{{ ''.__class__.__mro__ }}", "failed on these messages"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore attributes"),
    ("{{ range(100001) | length }}", "range() of 100001 items is more than the 100000"),
    ("{{ range(0, 10**12, 10**6) | list }}", "range() of 1000000 items"),
    ("{{ 10 ** 10 ** 10 }}", "integer of more than 64 bits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(20) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     "integer of more than 64 bits"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
    ("{{ messages | tojson(indent=1000) }}", "tojson indent must be an integer in [0, 64]"),
])
def test_hostile_templates_raise_a_clear_error(source, message):
    with pytest.raises(ChatTemplateError) as err:
        render(source)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, InvalidRequestError)  # the server's 400


def test_loops_are_bounded_by_their_total_iterations():
    limits = TemplateLimits(max_iterations=1000)
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="more than 1000 loop iterations"):
        render(nested, limits)
    recursive = "{% for x in [[[]] * 40] * 40 recursive %}{{ loop(x) }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="more than 1000 loop iterations"):
        render(recursive, limits)
    assert render("{% for i in range(999) %}{% endfor %}ok", limits) == "ok"


def test_a_render_is_bounded_in_time():
    quiet = "{% for i in range(900) %}{% for j in range(900) %}{% set x = i * j %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="ran past its time limit of 0.05 s"):
        render(quiet, TemplateLimits(max_seconds=0.05))


def test_the_rendered_prompt_is_bounded_in_size():
    limits = TemplateLimits(max_output_chars=1000)
    with pytest.raises(ChatTemplateError, match="rendered more than"):
        render("{% for i in range(50) %}{{ 'x' * 100 }}{% endfor %}", limits)
    long_message = [{"role": "user", "content": "y" * 5000}]  # the bound grows with the messages
    assert len(ChatTemplate("{{ messages[0].content }}", limits=limits).render(long_message)) == 5000


def test_the_server_answers_a_template_past_its_limits_with_a_400(tiny_tokenizer):
    from deepinfer.core.server.chat_format import render_chat_prompt
    from deepinfer.core.server.errors import InvalidParameter
    from deepinfer.core.server.protocol import ChatMessage

    hf_tokenizer = tiny_tokenizer.__class__(tokenizer_object=tiny_tokenizer.backend_tokenizer,
                                            eos_token="<|im_end|>")
    hf_tokenizer.chat_template = "{{ 'a' * 10**10 }}"
    with pytest.raises(InvalidParameter, match="built more than"):
        render_chat_prompt(Tokenizer(hf_tokenizer), [ChatMessage(role="user", content="hi")])


def test_a_template_that_does_not_parse_fails_the_load(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "llama"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ModelLoadError, match="the chat template does not parse: line 1") as err:
        load_model(EngineConfig(model=str(model_dir)), "cpu", torch.float32)
    assert str(model_dir) in str(err.value) and "\n" not in str(err.value)


# Templates that would grow a renderer by gigabytes: run in a fresh interpreter (tests/hostile_probe.py)
# under an address-space limit, each must stop at the allocation budget with little RSS growth.
MEMORY_CASES = {
    "str_times": "{{ 'a' * 10**10 }}",
    "list_times": "{{ ['a'] * 10**9 }}",
    "concat_doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "plus_doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "pow_bignum": "{{ 2 ** (10 ** 10) }}",
    "center_method": "{{ 'a'.center(10**10) }}",
    "ljust_method": "{{ 'a'.ljust(10**10) }}",
    "expandtabs_method": "{{ ('\t' * 100000).expandtabs(10**6) }}",
    "replace_method": "{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}",
    "join_method": "{% set s = 'a' * 100000 %}{{ s.join([s] * 100000) }}",
    "format_method": "{{ '{:1000000000}'.format(1) }}",
    "percent_operator": "{{ '%1000000000d' % 1 }}",
    "center_filter": "{{ 'a' | center(10**10) }}",
    "indent_filter": "{{ ('a\n' * 1000) | indent(10**6) }}",
    "replace_filter": "{% set s = 'a' * 100000 %}{{ s | replace('a', s) }}",
    "join_filter": "{% set s = 'a' * 1000000 %}{{ ([s] * 100000) | join }}",
    "sum_filter": "{{ ([[1] * 1000] * 100000) | sum(start=[]) | length }}",
    "wordwrap_filter": "{{ ('a' * 100000) | wordwrap(1, wrapstring='b' * 1000) }}",
    "format_filter": "{{ '%.1000000000f' | format(1.0) }}",
    "batch_filter": "{{ [1] | batch(10**9, 0) | list }}",
    "literal_in_loops": "{% set x %}{% for i in range(100000) %}{% for j in range(9) %}" + "a" * 4000
                        + "{% endfor %}{% endfor %}{% endset %}",
    "live_strings": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                    "{% set ns.l = ns.l + [('a' * 100000) ~ i] %}{% endfor %}",
    "live_lists": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                  "{% set ns.l = ns.l + [range(100000) | list] %}{% endfor %}",
    "live_split": "{% set s = 'a ' * 1000000 %}{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                  "{% set ns.l = ns.l + [s.split()] %}{% endfor %}",
}


@pytest.fixture(scope="module")
def memory_probe():
    setup = ("from deepinfer.core.chat_template import ChatTemplate\n"
             "MESSAGES = [{'role': 'user', 'content': 'hi'}]\n"
             "ChatTemplate('{{ 1 }}').render(MESSAGES)")
    return run_probe(setup, {name: f"ChatTemplate({source!r}).render(MESSAGES)"
                             for name, source in MEMORY_CASES.items()})


@pytest.mark.parametrize("name", list(MEMORY_CASES))
def test_hostile_templates_stop_at_the_allocation_budget_in_bounded_memory(memory_probe, name):
    result = memory_probe[name]
    assert result["error"] == "ChatTemplateError", f"{name}: {result}"
    expected = "integer of more than 64 bits" if name == "pow_bignum" else "built more than"
    assert expected in result["message"] and "\n" not in result["message"], result["message"]
    assert result["rss_growth_mb"] < 200, f"{name} grew peak RSS by {result['rss_growth_mb']:.0f} MB"
