"""`deepinfer bench host`: the real engine over a stand-in forward, as a smoke test at small sizes (no timing
asserts): the stand-in's tokens reach the outputs exactly, every point runs the steps its mode says, the
harness's spans leave the engine's classes as they were, and the command writes its JSON and tables."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.core.bench import host_bench
from deepinfer.core.bench.host_bench import (
    HostWorkload,
    host_engine_config,
    run_host_benchmark,
    stand_in_engine,
)
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.detokenizer import IncrementalDetokenizer
from deepinfer.core.engine.worker.inflight import InflightStep
from deepinfer.core.errors import InvalidRequestError
from deepinfer.core.tokenizer import ByteTokenizer

BYTES = ByteTokenizer(host_bench.STAND_IN_VOCAB_SIZE)
BASE = EngineConfig(max_num_batched_tokens=32, block_size=8)


def small_workload(**overrides) -> HostWorkload:
    settings = {"num_seqs": [1, 3], "steps": 3, "repeats": 2, "warmup_steps": 1, "prompt_len": 10, "long_prompt_len": 70}
    return HostWorkload(**{**settings, **overrides})


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_stand_in_engine_streams_exactly_the_stand_in_tokens(async_scheduling):
    config = host_engine_config(small_workload(), EngineConfig(**{**BASE.__dict__, "async_scheduling": async_scheduling}),
                                "stand-in")
    engine = stand_in_engine(config, BYTES)
    tokens = engine.runner.sampler.tokens.tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    request_id = engine.add_request(list(range(40, 60)), params)  # 20 tokens: a chunk of 32 holds it
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()[0]
    final = outputs[-1]
    assert final.request_id == request_id and final.finished
    # One row sampled per step, so the request takes the stream's tokens in order.
    assert final.outputs[0].token_ids == tokens[:12]
    assert final.outputs[0].text == BYTES.decode(tokens[:12])
    pool = engine.scheduler.kv.pool
    assert pool.num_free_blocks + pool.num_evictable_blocks == pool.num_blocks


def test_every_point_runs_its_mode_and_the_spans_are_taken_out():
    result = InflightStep.result
    append = IncrementalDetokenizer.append_text
    payload = run_host_benchmark(BASE, small_workload(), tokenizer=BYTES)
    assert InflightStep.result is result and IncrementalDetokenizer.append_text is append
    assert [(p["mode"], p["num_seqs"]) for p in payload["points"]] == [
        ("decode", 1), ("decode", 3), ("mixed", 1), ("mixed", 3)]
    for point in payload["points"]:
        n = point["num_seqs"]
        assert point["steps"] == 3
        if point["mode"] == "decode":
            assert point["decode_tokens_per_step"] == n and point["prefill_tokens_per_step"] == 0
            assert point["output_tokens_per_step"] == n  # every stream gets a token every step
        else:  # the long prompt fills what the budget leaves
            assert point["decode_tokens_per_step"] >= n
            assert point["decode_tokens_per_step"] + point["prefill_tokens_per_step"] == BASE.max_num_batched_tokens
        assert set(point["phases_us_per_step"]) == set(host_bench.PHASES)
        assert point["gpu_us_per_step"] is None and point["wall_over_gpu"] is None  # the CPU has no device time
        assert point["phases_us_per_step"]["detokenize"] > 0 and point["phases_us_per_step"]["schedule"] > 0
        assert 0 < point["core_cpu_us_per_step"] < point["cpu_us_per_step_mean"] * point["steps"]
        repeats = point["core_cpu_us_per_step_repeats"]  # the least disturbed timed pass is kept
        assert len(repeats) == 2 and point["core_cpu_us_per_step"] == pytest.approx(min(repeats))
        assert point["front_end_cpu_us_per_step"] > 0 and point["core_cpu_us_per_seq"] == pytest.approx(
            point["core_cpu_us_per_step"] / n)
        # No device to wait for: the core's own work is the whole core.
        assert point["gpu_wait_cpu_us_per_step"] == 0 and point["phases_us_per_step"]["gpu_wait"] == 0
        assert point["core_less_gpu_wait_cpu_us_per_step"] == pytest.approx(point["core_cpu_us_per_step"])
    for mode in ("decode", "mixed"):
        assert payload["fit"][mode]["core"]["num_seqs"] == [1, 3]
        assert payload["fit"][mode]["core_less_gpu_wait"]["num_seqs"] == [1, 3]


def test_a_fit_is_the_least_squares_line():
    points = [{"num_seqs": 1, "y": 12.0}, {"num_seqs": 3, "y": 20.0}, {"num_seqs": 5, "y": 28.0}]
    fit = host_bench.linear_fit(points, "y")
    assert fit["per_seq_us"] == pytest.approx(4.0) and fit["fixed_us"] == pytest.approx(8.0)
    assert host_bench.linear_fit(points[:1], "y") is None


def test_bad_workloads_are_refused():
    with pytest.raises(InvalidRequestError, match="--modes"):
        HostWorkload(modes=["prefill"])
    with pytest.raises(InvalidRequestError, match="max-num-batched-tokens"):
        host_engine_config(small_workload(num_seqs=[64]), BASE, "stand-in")


def test_host_command_writes_json_and_tables_with_a_baseline(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    first, second = tmp_path / "before.json", tmp_path / "after.json"
    args = ["bench", "host", "--num-seqs", "1,2", "--modes", "decode", "--steps", "2", "--warmup-steps", "0",
            "--prompt-len", "8", "--tokenizer", "byte", "--max-num-batched-tokens", "16", "--block-size", "8"]
    for output, extra in ((first, []), (second, ["--baseline", str(tmp_path / "before.json")])):
        monkeypatch.setattr("sys.argv", ["deepinfer", *args, *extra, "-o", str(output)])
        result = CliRunner().invoke(app, [*args, *extra, "-o", str(output)])
        assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    data = json.loads(second.read_text())
    assert data["benchmark"] == "host" and data["forward"] == "stand-in" and "bench host" in data["env"]["command"]
    assert [p["num_seqs"] for p in data["points"]] == [1, 2]
    assert data["baseline"]["points"] == json.loads(first.read_text())["points"]
    assert "core µs/seq" in result.output and "baseline" in result.output
    bad = CliRunner().invoke(app, ["bench", "host", "--tokenizer", "bpe"])
    assert bad.exit_code == 1 and "--tokenizer" in bad.output


def test_the_same_measurement_runs_inside_the_real_engine(tiny_llama_dir):
    """--forward model: a real model and sampler (a tiny Llama on the CPU here; the H200 run uses this path)."""
    config = EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=32, block_size=8, num_gpu_blocks=128)
    payload = run_host_benchmark(config, small_workload(long_prompt_len=40), forward="model")
    assert payload["forward"] == "model" and payload["decode_mode"] == "eager"
    for point in payload["points"]:
        assert point["steps"] == 3 and point["decode_tokens_per_step"] >= point["num_seqs"]
        assert point["phases_us_per_step"]["forward"] > 0 and point["phases_us_per_step"]["sampling"] > 0


class _FakeEvent:
    """A CUDA event's interface over a hand-set device clock (milliseconds)."""

    clock_ms = 0.0

    def record(self) -> None:
        self.at_ms = _FakeEvent.clock_ms

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at_ms - self.at_ms


def test_the_step_gpu_timer_gives_each_launch_the_device_time_between_its_events():
    from deepinfer.core.bench.step_gpu_time import StepGpuTimer, cuda_step_timer

    class Runner:
        def launch(self, device_ms):
            _FakeEvent.clock_ms += device_ms  # the device's work between the two events
            return device_ms

    runner, synced = Runner(), []
    timer = StepGpuTimer(runner, _FakeEvent, lambda: synced.append(True))
    assert [runner.launch(2.0), runner.launch(0.5)] == [2.0, 0.5] and timer.num_launches == 2
    assert timer.read() == pytest.approx([0.002, 0.0005]) and synced == [True]
    assert timer.num_launches == 0
    timer.close()
    assert "launch" not in runner.__dict__
    assert cuda_step_timer(runner, torch.device("cpu")) is None  # no CUDA device: no device time
