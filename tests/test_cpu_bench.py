"""bench cpu's arithmetic (core/bench/cpu_bench.py) on hand-made token times, and its table."""

from __future__ import annotations

import pytest

from deepinfer.core.bench.cpu_bench import _summary, cpu_tables, rotated


def test_prefill_is_the_first_token_and_decode_the_rate_after_it():
    # one run: first token at 2 s, then 4 more tokens by 4 s -> 2 tok/s; another: 1 s, then 4 by 3 s
    summary = _summary([[2.0, 2.5, 3.0, 3.5, 4.0], [1.0, 1.5, 2.0, 2.5, 3.0]], prompt_len=100,
                       short_runs=[[0.1, 0.2, 0.3], [0.1, 0.3, 0.5]])
    assert summary["prefill_s"]["runs"] == [2.0, 1.0]
    assert summary["prefill_s"]["mean"] == pytest.approx(1.5)
    assert summary["prefill_tokens_per_s"]["runs"] == [50.0, 100.0]
    assert summary["long_context_decode_tokens_per_s"]["runs"] == [2.0, 2.0]
    assert summary["long_context_decode_tokens_per_s"]["std"] == 0.0
    assert summary["decode_tokens_per_s"]["runs"] == pytest.approx([10.0, 5.0])


def test_table_shows_decode_against_hf():
    def subject(decode: float) -> dict:
        return {"prefill_s": {"mean": 1.0, "std": None}, "prefill_tokens_per_s": {"mean": 100.0, "std": None},
                "decode_tokens_per_s": {"mean": decode, "std": None},
                "long_context_decode_tokens_per_s": {"mean": decode / 2, "std": None}}

    payload = {"threads": 2, "workload": {"prompt_len": 100, "output_len": 5},
               "subjects": {"deepinfer_gguf": subject(30.0), "hf_transformers": subject(12.0)}}
    from rich.console import Console

    console = Console(width=120, record=True)
    for table in cpu_tables(payload):
        console.print(table)
    text = console.export_text()
    assert "2.50x" in text and "1.00x" in text


def test_decode_cpu_time_is_per_token_after_the_first():
    # CPU seconds at each of 5 tokens: 0.5 s of CPU over the 4 tokens after the first -> 125 ms a token
    summary = _summary([[1.0, 2.0]], prompt_len=10, short_runs=[[0.1, 0.2, 0.3, 0.4, 0.5]],
                       short_cpu_runs=[[0.2, 0.3, 0.45, 0.6, 0.7]])
    assert summary["decode_cpu_ms_per_token"]["runs"] == pytest.approx([125.0])
    assert "decode_cpu_ms_per_token" not in _summary([[1.0, 2.0]], prompt_len=10, short_runs=[[0.1, 0.2]],
                                                     short_cpu_runs=[[]])


def test_each_repeat_starts_with_another_subject():
    names = ["deepinfer_gguf", "deepinfer_converted", "hf_transformers"]
    orders = [rotated(names, repeat) for repeat in range(4)]
    assert [order[0] for order in orders] == names + names[:1]
    assert all(sorted(order) == sorted(names) for order in orders)
