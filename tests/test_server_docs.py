"""docs/SERVER.md against the server: the refused-field table is core/server/unsupported.py's, and
the metric names, types and exposition format are what a running server's /metrics sends."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.errors import InvalidParameter
from deepinfer.core.server.unsupported import CHAT, COMPLETIONS, UNSUPPORTED_FIELDS, reject_unsupported

DOC = (Path(__file__).resolve().parents[1] / "docs" / "SERVER.md").read_text()
LEGACY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # a metric name the 0.0.4 text format can carry


def section(title: str) -> str:
    start = DOC.index(f"\n## {title}\n")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end != -1 else len(DOC)]


def refused_field_rows() -> list[str]:
    rows = ["| field | on | what it asks for | accepted no-op values |", "| --- | --- | --- | --- |"]
    for field, entry in UNSUPPORTED_FIELDS.items():
        on = ", ".join(endpoint for endpoint in (CHAT, COMPLETIONS) if endpoint in entry.endpoints)
        no_op = ", ".join(f"`{json.dumps(value)}`" for value in entry.no_op)
        rows.append(f"| `{field}` | {on} | {entry.feature} | {no_op} |")
    return rows


def test_the_refused_field_table_is_the_servers():
    begin, end = "<!-- refused-fields:begin -->", "<!-- refused-fields:end -->"
    table = DOC[DOC.index(begin) + len(begin):DOC.index(end)].strip().splitlines()
    expected = refused_field_rows()
    assert table == expected, "docs/SERVER.md is out of date; its table should read:\n" + "\n".join(expected)


@pytest.mark.parametrize("field", list(UNSUPPORTED_FIELDS))
def test_each_documented_field_is_refused_naming_itself_and_its_no_ops_pass(field):
    entry = UNSUPPORTED_FIELDS[field]
    for endpoint in entry.endpoints:
        with pytest.raises(InvalidParameter) as refused:
            reject_unsupported({field: "something"}, endpoint)
        assert refused.value.param == field
        for value in entry.no_op:
            reject_unsupported({field: value}, endpoint)


def test_the_features_the_docs_call_implemented_are_not_refused():
    implemented = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                   "tool_choice": "required", "response_format": {"type": "json_object"},
                   "structured_outputs": {"regex": "[0-9]+"}, "guided_json": {"type": "object"},
                   "guided_regex": "a+", "guided_choice": ["a", "b"], "guided_grammar": "root ::= \"a\"",
                   "grammar": "root ::= \"a\""}
    request_fields = section("Routes").split("### Request fields")[1].split("<!-- refused-fields:begin -->")[0]
    for field in implemented:
        assert f"`{field}`" in request_fields or f"`{field.split('_')[0]}_" in request_fields, field
    reject_unsupported(implemented, CHAT)
    reject_unsupported({k: v for k, v in implemented.items() if not k.startswith("tool")}, COMPLETIONS)


def documented_metrics() -> dict[str, str]:
    """{metric family name: type} from the Metrics section's table."""
    families = {}
    for row in section("Metrics").splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")] if row.startswith("| `deepinfer:") else None
        if cells:
            kind = cells[-1].split()[0].rstrip(":")
            for name in re.findall(r"`(deepinfer:[a-z0-9_]+)", row.rsplit("|", 2)[0]):
                families[name] = kind
    return families


@pytest.fixture(scope="module")
def metrics_response(tiny_llama_dir) -> httpx.Response:
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256,
                          num_gpu_blocks=32)
    server = ServerThread(config, ServerConfig(served_model_name="docs")).start()
    try:
        httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        yield httpx.get(server.base_url + "/metrics", timeout=30)
    finally:
        server.stop()


def test_the_documented_metrics_are_the_served_ones(metrics_response):
    served = {family.name: family.type for family in text_string_to_metric_families(metrics_response.text)}
    documented = documented_metrics()
    assert len(documented) >= 15
    assert documented == served


def test_metrics_speak_the_documented_text_format(metrics_response):
    content_type = re.search(r"`(text/plain; version=[^`]+)`", section("Routes").split("GET /metrics")[1]).group(1)
    assert metrics_response.headers["content-type"] == content_type == "text/plain; version=0.0.4; charset=utf-8"
    for line in metrics_response.text.splitlines():  # 0.0.4: comments, then `name{labels} value` lines
        if line.startswith("# "):
            assert line.split()[1] in ("HELP", "TYPE"), line
        else:
            name = re.match(r"[^{ ]+", line).group(0)
            assert LEGACY_NAME.fullmatch(name), line
            float(line.rsplit(" ", 1)[1])
