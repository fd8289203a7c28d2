"""Benchmarks: statistics against hand-computed cases, the HF peer, and both commands end to end (CPU)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from deepinfer.core.bench.jitter import JitterWorkload, choose_chunk_size, window_itls
from deepinfer.core.bench.latency import RequestTiming, mean_std, percentiles, summarize_requests
from deepinfer.core.bench.workload import default_num_requests, make_prompts
from deepinfer.core.errors import InvalidRequestError


def test_percentiles_match_hand_computed_linear_interpolation():
    # 1..10: the q-quantile sits at index q*(n-1) = 9q, interpolated linearly between neighbours.
    stats = percentiles([float(v) for v in range(10, 0, -1)])
    assert stats["p50"] == pytest.approx(5.5)  # index 4.5 -> between 5 and 6
    assert stats["p95"] == pytest.approx(9.55)  # index 8.55 -> 9 + 0.55
    assert stats["p99"] == pytest.approx(9.91)  # index 8.91 -> 9 + 0.91
    assert stats["mean"] == pytest.approx(5.5)
    assert stats["max"] == 10.0
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None, "mean": None, "max": None}


def test_request_timing_ttft_tpot_itl():
    timing = RequestTiming("r", prompt_len=7, sent_s=10.0)
    timing.record(10.5, 1)  # first token after 0.5 s
    timing.record(10.7, 1)
    timing.record(11.3, 3)  # three tokens in one delivery: the 0.6 s gap is split over them
    timing.record(11.4, 0)  # an empty delivery (e.g. the final one) changes nothing
    assert timing.output_len == 5
    assert timing.ttft_s == pytest.approx(0.5)
    assert timing.tpot_s == pytest.approx((11.3 - 10.5) / 4)
    assert timing.itls_s() == pytest.approx([0.2, 0.2, 0.2, 0.2])
    assert timing.e2e_s == pytest.approx(1.3)

    summary = summarize_requests([timing, RequestTiming("failed", 7, 10.0, error="boom")], wall_s=2.0)
    assert summary["num_requests"] == 2 and summary["num_failed"] == 1
    assert summary["output_tokens"] == 5
    assert summary["output_tokens_per_s"] == pytest.approx(2.5)
    assert summary["requests_per_s"] == pytest.approx(0.5)
    assert summary["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert summary["itl_ms"]["p99"] == pytest.approx(200.0)


def test_mean_std_over_repeats_is_sample_std():
    runs = [{"tok_s": 10.0, "ttft_ms": {"p50": 1.0}}, {"tok_s": 14.0, "ttft_ms": {"p50": 3.0}},
            {"tok_s": 12.0, "ttft_ms": {"p50": None}}]
    result = mean_std(runs)
    assert result["tok_s"]["mean"] == pytest.approx(12.0)
    assert result["tok_s"]["std"] == pytest.approx(2.0)  # sqrt(((-2)^2 + 2^2 + 0) / 2)
    assert result["ttft_ms.p50"]["mean"] == pytest.approx(2.0)  # missing values are skipped
    assert result["ttft_ms.p50"]["std"] == pytest.approx(math.sqrt(2.0))
    assert mean_std([{"x": 3.0}])["x"] == {"mean": 3.0, "std": None}


def test_prompts_have_exact_lengths_a_shared_prefix_and_are_reproducible():
    prompts = make_prompts(5, 40, 1000, shared_prefix_len=24, seed=[0, 4, 1])
    assert [len(p) for p in prompts] == [40] * 5
    assert all(p[:24] == prompts[0][:24] for p in prompts)
    assert len({tuple(p[24:]) for p in prompts}) == 5
    assert all(16 <= t < 1000 for p in prompts for t in p)
    assert prompts == make_prompts(5, 40, 1000, shared_prefix_len=24, seed=[0, 4, 1])
    assert prompts != make_prompts(5, 40, 1000, shared_prefix_len=24, seed=[0, 4, 2])
    assert default_num_requests(1) == 8 and default_num_requests(32) == 64
    with pytest.raises(InvalidRequestError, match="shared prefix"):
        make_prompts(2, 8, 1000, shared_prefix_len=8)


def test_request_counts_are_one_for_every_level_or_one_per_level():
    from deepinfer.core.bench.concurrency import ConcurrencyWorkload

    per_level = ConcurrencyWorkload([1, 32, 256], num_requests=[16, 512, 1024])
    assert [per_level.requests_at(c) for c in (1, 32, 256)] == [16, 512, 1024]
    assert [ConcurrencyWorkload([1, 32], num_requests=40).requests_at(c) for c in (1, 32)] == [40, 40]
    assert [ConcurrencyWorkload([1, 32]).requests_at(c) for c in (1, 32)] == [8, 64]
    for counts in ([16, 512], [16, 0, 4], 0):
        with pytest.raises(InvalidRequestError, match="--num-requests"):
            ConcurrencyWorkload([1, 32, 256], num_requests=counts)


def test_insertion_window_takes_every_itl_overlapping_the_window():
    stream = RequestTiming("s", 4, 0.0)
    for t in (1.0, 2.0, 3.0, 6.0, 7.0, 8.0):
        stream.record(t, 1)
    # Long prompt sent at 2.5, first token at 6.5: the gaps (2,3], (3,6] and (6,7] overlap it.
    assert window_itls(stream, 2.5, 6.5) == pytest.approx([1.0, 3.0, 1.0])
    assert window_itls(stream, 8.5, 9.0) == []


def _result(chunk_size: int, max_itl_ms: float, complete: bool = True) -> dict:
    return {"chunk_size": chunk_size, "insertion_window_complete": complete,
            "insertion_window_itl_ms": {"max": max_itl_ms}, "long_ttft_inserted_ms": {"mean": 1000.0 / chunk_size}}


def test_slo_picks_the_largest_chunk_size_within_the_slo():
    results = [_result(64, 20.0), _result(128, 35.0), _result(256, 80.0), _result(512, 30.0, complete=False)]
    chosen = choose_chunk_size(results, itl_slo_ms=40.0)
    assert chosen["chosen_chunk_size"] == 128  # 512 is within the SLO but its window was cut short
    assert chosen["long_ttft_inserted_ms"] == pytest.approx(1000.0 / 128)
    assert choose_chunk_size(results, itl_slo_ms=10.0)["chosen_chunk_size"] is None


def test_jitter_stream_length_defaults_to_outlast_the_insertion():
    workload = JitterWorkload(chunk_sizes=[9, 64], long_prompt_len=100, insert_after=4)
    assert workload.stream_output_len == 4 + math.ceil(100 / 8) + 16
    with pytest.raises(InvalidRequestError, match="chunk-sizes"):
        JitterWorkload(chunk_sizes=[1])


def _tiny_llama_config() -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False}


def test_hf_peer_runs_static_batches_of_the_concurrency(tmp_path):
    import torch

    from deepinfer.core.bench.hf_peer import load_hf_peer, run_peer_level

    config_json = tmp_path / "shape.json"
    config_json.write_text(json.dumps(_tiny_llama_config()))
    model = load_hf_peer(config_json, None, "cpu", torch.float32)
    assert model.config.num_hidden_layers == 2
    prompts = make_prompts(5, 12, 256, seed=0)
    timings, wall_s = run_peer_level(model, prompts, output_len=3, concurrency=2, device="cpu", label="hf")
    assert [t.output_len for t in timings] == [3] * 5  # EOS never stops a request early
    assert [t.prompt_len for t in timings] == [12] * 5
    # Batches {0,1}, {2,3}, {4}: a batch shares its start and its token times, and starts after the last ends.
    assert timings[0].sent_s == timings[1].sent_s and timings[0].token_times_s() == timings[1].token_times_s()
    assert timings[2].sent_s >= timings[1].last_token_s and timings[4].sent_s >= timings[3].last_token_s
    assert sum(t.e2e_s for t in timings[::2]) <= wall_s


def _run_cli(args: list[str], monkeypatch) -> None:
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    monkeypatch.setattr("sys.argv", ["deepinfer", *args])  # what env info records as the command
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"


def test_concurrency_command_end_to_end_with_hf_peer(tmp_path, tiny_llama_dir, monkeypatch):
    output = tmp_path / "concurrency.json"
    _run_cli(["bench", "concurrency", "--model", str(tiny_llama_dir), "--concurrency", "1,3", "--prompt-len", "20",
              "--output-len", "5", "--num-requests", "6", "--peer", "hf", "--output", str(output)], monkeypatch)
    data = json.loads(output.read_text())
    assert data["benchmark"] == "concurrency"
    assert "bench concurrency" in data["env"]["command"] and data["env"]["git_commit"] and data["env"]["torch"]
    assert data["workload"]["prompt_len"] == 20 and data["workload"]["output_len"] == 5
    assert [level["concurrency"] for level in data["levels"]] == [1, 3]
    for level in data["levels"]:
        (run,) = level["repeats"]
        assert run["num_failed"] == 0 and run["num_requests"] == 6
        assert [r["output_len"] for r in run["requests"]] == [5] * 6  # EOS ignored: fixed lengths
        assert run["output_tokens"] == 30
        assert run["output_tokens_per_s"] == pytest.approx(30 / run["wall_s"])
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert run[metric]["p50"] <= run[metric]["p95"] <= run[metric]["p99"] <= run[metric]["max"]
        assert {"peak_allocated_bytes", "peak_reserved_bytes"} <= run.keys()  # None on the CPU
        # Closed loop: exactly `concurrency` requests run at once, so the engine's batch peaks there.
        assert run["max_running"] == level["concurrency"]
        assert 0 < run["decode_steps"] < run["num_steps"] and run["decode_step_ms"]["p50"] > 0
        peer_run = level["peer"]["repeats"][0]
        assert peer_run["output_tokens"] == 30 and peer_run["num_failed"] == 0
        assert level["vs_peer"]["output_tokens_per_s_ratio"] == pytest.approx(
            run["output_tokens_per_s"] / peer_run["output_tokens_per_s"])
    # one stream: each request's prefill step samples its first token, then 4 decode-only steps its other 4 (the
    # last request's last step may be reported after the level's recording stopped)
    assert 6 * 4 - 1 <= data["levels"][0]["repeats"][0]["decode_steps"] <= 6 * 4
    assert data["levels"][0]["speedup_vs_serial"] == pytest.approx(1.0)
    serial, concurrent = (level["mean_std"]["output_tokens_per_s"]["mean"] for level in data["levels"])
    assert data["levels"][1]["speedup_vs_serial"] == pytest.approx(concurrent / serial)
    assert data["peer"]["kind"] == "hf" and data["peer"]["dtype"] == "float32"


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefix_is_served_from_the_prefix_cache(tmp_path, tiny_llama_dir, prefix_caching, monkeypatch):
    # 40-token prompts behind a 32-token shared prefix, blocks of 16: once the first request has run,
    # every later one (serial, concurrency 1) finds exactly the prefix's 2 full blocks = 32 tokens.
    output = tmp_path / "prefix.json"
    flag = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    _run_cli(["bench", "concurrency", "--model", str(tiny_llama_dir), "--concurrency", "1", "--prompt-len", "40",
              "--shared-prefix-len", "32", "--block-size", "16", "--output-len", "2", "--num-requests", "4", flag,
              "--output", str(output)], monkeypatch)
    (run,) = json.loads(output.read_text())["levels"][0]["repeats"]
    expected = [0, 32, 32, 32] if prefix_caching else [0, 0, 0, 0]
    assert [r["cached_prompt_tokens"] for r in run["requests"]] == expected
    assert run["cached_prompt_tokens"] == sum(expected)


def test_jitter_command_end_to_end_with_slo(tmp_path, tiny_llama_dir, monkeypatch):
    from deepinfer.core.bench import engine_client

    warm_up_lengths = []
    real_warm_up = engine_client.warm_up

    async def recording_warm_up(engine, vocab_size, prompt_len, *args):
        warm_up_lengths.append(prompt_len)
        await real_warm_up(engine, vocab_size, prompt_len, *args)

    monkeypatch.setattr(engine_client, "warm_up", recording_warm_up)
    output = tmp_path / "jitter.json"
    _run_cli(["bench", "jitter", "--model", str(tiny_llama_dir), "--chunk-sizes", "8,32", "--long-prompt-len", "48",
              "--stream-prompt-len", "6", "--insert-after", "3", "--itl-slo-ms", "100000", "--output", str(output)], monkeypatch)
    data = json.loads(output.read_text())
    assert data["benchmark"] == "jitter" and "bench jitter" in data["env"]["command"]
    workload = data["workload"]
    assert workload["stream_output_len"] == 3 + math.ceil(48 / 7) + 16
    assert [b["chunk_size"] for b in data["chunk_sizes"]] == [8, 32]
    for result in data["chunk_sizes"]:
        assert result["insertion_window_complete"]
        assert result["insertion_window_num_itls"] >= 1
        # The engine honours the chunk size: no step computes more prompt tokens than it allows.
        assert 1 <= result["insertion_window_max_prompt_tokens_per_step"] <= result["chunk_size"]
        for key in ("baseline_itl_ms", "insertion_window_itl_ms"):
            assert result[key]["p50"] <= result[key]["p95"] <= result[key]["max"]
        assert result["long_ttft_alone_ms"]["mean"] > 0 and result["long_ttft_inserted_ms"]["mean"] > 0
    # Chunk size 8 needs ceil(48 / 7) = 7 prefill steps for the long prompt; 32 needs 2.
    assert data["chunk_sizes"][0]["insertion_window_engine_steps"] > data["chunk_sizes"][1]["insertion_window_engine_steps"]
    assert data["slo"]["chosen_chunk_size"] == 32  # every chunk size meets a 100 s SLO: the largest wins
    # each chunk size's engine warms up on a whole long prompt, so every chunk shape is seen before "alone" is timed
    assert warm_up_lengths == [48, 48]


def test_decode_step_times_take_the_steps_without_prompt_tokens():
    from deepinfer.core.bench.concurrency import decode_step_times
    from deepinfer.core.bench.engine_client import StepRecord

    def step(time_s, prompt_tokens, generated):
        return StepRecord(time_s, prompt_tokens, generated, 2, 0, 0, 0, 0)

    # a prefill step, three decode steps (4, 2, 3 ms after the step before), a step with a prefill chunk and
    # decodes (excluded), a decode step 7 ms after it, an empty step (nothing sampled, excluded)
    steps = [step(1.000, 20, 1), step(1.004, 0, 2), step(1.006, 0, 2), step(1.009, 0, 2), step(1.019, 16, 2),
             step(1.026, 0, 2), step(1.050, 0, 0)]
    times = decode_step_times(steps)
    assert times["decode_steps"] == 4
    assert times["decode_step_ms"]["p50"] == pytest.approx(3.5)  # median of 4, 2, 3, 7
    assert decode_step_times(steps[:1]) == {"decode_steps": 0, "decode_step_ms": {"p50": None}}


def test_insertion_window_steps_include_the_step_that_finished_the_prefill():
    from deepinfer.core.bench.engine_client import StepRecord
    from deepinfer.core.bench.jitter import steps_in_window

    steps = [StepRecord(t, prompt, 1, 1, 0, 0, 0, 0) for t, prompt in [(1.0, 0), (2.1, 7), (3.1, 7), (4.05, 2),
                                                                         (5.0, 0)]]
    # Long prompt sent at 2.0, first token seen at 4.0: the step stamped 4.05 finished its prefill.
    assert [s.num_prompt_tokens for s in steps_in_window(steps, 2.0, 4.0)] == [7, 7, 2]


def test_an_interrupted_sweep_keeps_the_chunk_sizes_it_finished(monkeypatch):
    from deepinfer.core.bench import jitter
    from deepinfer.core.config import EngineConfig

    async def measure(config, chunk_size, workload, engine_info, weights, progress):
        if chunk_size > 8:
            raise KeyboardInterrupt  # what `timeout -s INT` delivers
        return _result(chunk_size, 5.0)

    monkeypatch.setattr(jitter, "_measure_chunk_size", measure)
    payload = jitter.run_jitter_benchmark(EngineConfig(device="cpu"), JitterWorkload(chunk_sizes=[8, 16, 32],
                                                                                     itl_slo_ms=10.0))
    assert payload["interrupted"] is True
    assert [b["chunk_size"] for b in payload["chunk_sizes"]] == [8]
    assert payload["slo"]["chosen_chunk_size"] == 8


def test_quantized_run_records_its_quantized_linears(tmp_path, tiny_llama_dir, monkeypatch):
    output = tmp_path / "w4.json"
    _run_cli(["bench", "concurrency", "--model", str(tiny_llama_dir), "--quantization", "w4a16", "--concurrency", "2",
              "--prompt-len", "8", "--output-len", "2", "--num-requests", "2", "--output", str(output)], monkeypatch)
    data = json.loads(output.read_text())
    # 3 layers x (qkv, o, gate_up, down): every projection is a 4-bit QuantLinear, q/k/v and
    # gate/up merged by the engine.
    assert data["weights"]["quantized_linears"] == 12 and data["weights"]["quantized_bits"] == [4]
    assert data["levels"][0]["repeats"][0]["output_tokens"] == 4


def test_env_records_the_settings_that_choose_the_code_and_no_other_variables(monkeypatch):
    """A run with DEEPINFER_PDL=0 measures other code than its command line says: the JSON must say so."""
    from deepinfer.core.bench import env_info

    monkeypatch.setenv("DEEPINFER_PDL", "0")
    monkeypatch.setenv("DEEPINFER_API_KEY", "secret-key")
    monkeypatch.delenv("DEEPINFER_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("DEEPINFER_CPU_WEIGHTS", raising=False)  # the suite's conftest sets it
    info = env_info.env_info(["deepinfer", "bench", "concurrency"])
    assert info["settings"] == {"DEEPINFER_PDL": "0"}
    assert "secret-key" not in json.dumps(info)
    assert info["command"] == "deepinfer bench concurrency"


def test_a_named_commit_wins_over_the_checkout(monkeypatch):
    """A tree copied to a GPU machine may carry a stale .git: the commit its copier names is recorded."""
    from deepinfer.core.bench import env_info

    monkeypatch.setenv(env_info.GIT_COMMIT_ENV, "af99a98")
    assert env_info.git_commit() == "af99a98"
    monkeypatch.delenv(env_info.GIT_COMMIT_ENV)
    head = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True,
                          cwd=env_info._REPO_ROOT).stdout.strip()
    assert env_info.git_commit().split("-")[0] == (head or "unknown")


def test_jitter_takes_the_users_chunk_sizes(tmp_path, tiny_llama_dir, monkeypatch):
    # `deepinfer bench jitter --chunk-sizes 8,16,32,64` (on a tiny model, short prompts): JSON under ./results/,
    # the Rich table on stdout, each chunk size's line on stderr as it finishes. The GPU test below runs it as written.
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    monkeypatch.chdir(tmp_path)
    args = ["bench", "jitter", "--chunk-sizes", "8,16,32,64", "--model", str(tiny_llama_dir), "--long-prompt-len",
            "16", "--stream-prompt-len", "4", "--insert-after", "2", "--stream-output-len", "10"]
    monkeypatch.setattr("sys.argv", ["deepinfer", *args])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    (written,) = (tmp_path / "results").glob("bench_jitter_llama*.json")
    data = json.loads(written.read_text())
    assert [b["chunk_size"] for b in data["chunk_sizes"]] == [8, 16, 32, 64]
    assert data["engine_config"]["max_num_batched_tokens"] == 64
    assert "deepinfer bench jitter: " in result.stdout and "long prompt 16 tokens" in result.stdout
    assert [line.split(":")[0] for line in result.stderr.splitlines() if line.startswith("chunk ")] == [
        "chunk 8", "chunk 16", "chunk 32", "chunk 64"]
    assert result.stderr.startswith("bench jitter on the CPU: chunk sizes 8, 16, 32, 64, each on a fresh engine; "
                                    "long prompt 16 tokens, stream 4+10 tokens, repeats 1: about ")


def test_progress_hears_every_request_and_every_level(tmp_path, tiny_llama_dir):
    from deepinfer.core.bench.concurrency import ConcurrencyWorkload, run_concurrency_benchmark
    from deepinfer.core.bench.progress import SweepProgress
    from deepinfer.core.config import EngineConfig

    class Recorder(SweepProgress):
        def __init__(self):
            self.events = []

        def level_started(self, label, num_requests):
            self.events.append(("start", label, num_requests))

        def advance(self, requests=0, tokens=0):
            self.events.append(("advance", requests, tokens))

        def level_finished(self, line):
            self.events.append(("finish", line.split(":")[0]))

    recorder = Recorder()
    run_concurrency_benchmark(EngineConfig(model=str(tiny_llama_dir), device="cpu"),
                              ConcurrencyWorkload([1, 2], prompt_len=6, output_len=3, num_requests=4), None, recorder)
    starts = [e for e in recorder.events if e[0] in ("start", "finish")]
    assert starts == [("start", "loading", 1), ("start", "warming up", 1), ("start", "c=1", 4),
                      ("finish", "engine c=1"), ("start", "c=2", 4), ("finish", "engine c=2")]
    advances = [e for e in recorder.events if e[0] == "advance"]
    assert sum(e[1] for e in advances) == 8 and sum(e[2] for e in advances) == 8 * 3  # requests, tokens


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_the_users_jitter_command_as_written_on_a_gpu(tmp_path, smollm2_gguf):
    # Exactly the user's command, default workload (a 2048-token prompt), on the GPU with CUDA graphs.
    import os
    import sys

    result = subprocess.run([sys.executable, "-m", "deepinfer", "bench", "jitter", "--chunk-sizes", "8,16,32,64"],
                            check=False, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                            env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    (written,) = (tmp_path / "results").glob("bench_jitter_*.json")
    data = json.loads(written.read_text())
    assert [b["chunk_size"] for b in data["chunk_sizes"]] == [8, 16, 32, 64]
    assert all(b["insertion_window_complete"] for b in data["chunk_sizes"])
    assert "deepinfer bench jitter: " in result.stdout
