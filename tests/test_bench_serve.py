"""`deepinfer bench serve` against a real deepinfer server on the CPU (the tiny random Llama).

The counts the benchmark reports are checked against the server's own /metrics; the prompts
against the tokenizer that made them; `--serve` against the process table (its server is gone
after a Ctrl-C). The models' answers do not matter here, only what was sent and counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerThread

from deepinfer.core.bench.serve_workload import PromptMaker, ServeWorkload, load_tokenizer
from deepinfer.core.config import EngineConfig
from deepinfer.core.server.config import ServerConfig

pytestmark = pytest.mark.timeout(300)
NAME = "tiny-llama"
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks", "128",
                "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256,
                          num_gpu_blocks=128, max_num_seqs=8)
    thread = ServerThread(config, ServerConfig(served_model_name=NAME, shutdown_timeout_s=1.0)).start()
    yield thread
    thread.stop()


def _bench(args: list[str], monkeypatch, tmp_path: Path) -> tuple[dict, str]:
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    output = tmp_path / f"serve-{time.monotonic_ns()}.json"
    argv = ["bench", "serve", *args, "-o", str(output)]
    monkeypatch.setattr("sys.argv", ["deepinfer", *argv])  # what the environment block records
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return json.loads(output.read_text()), result.output


def _counters(server: ServerThread) -> dict[str, float]:
    metrics = server.metrics()
    return {name: sum(v for (sample, _), v in metrics.items() if sample == name)
            for name in ("deepinfer:request_success_total", "deepinfer:generation_tokens_total",
                         "deepinfer:prompt_tokens_total")}


def test_counts_equal_the_server_metrics(server, tiny_llama_dir, monkeypatch, tmp_path):
    server.wait_idle()
    before = _counters(server)
    payload, output = _bench(["--base-url", server.base_url, "--tokenizer", str(tiny_llama_dir), "-c", "1,3",
                              "-n", "4,2", "--input-len", "12", "--output-len", "5", "--warmup", "0",
                              "--goodput", "ttft:600000", "tpot:600000", "--api-key", "not-recorded"],
                             monkeypatch, tmp_path)
    server.wait_idle()
    after = _counters(server)
    levels = payload["targets"][0]["levels"]
    assert [level["concurrency"] for level in levels] == [1, 3]
    assert [level["num_completed"] for level in levels] == [4, 2]  # -n 4,2: a count per level
    assert all(level["errors"] == {} for level in levels)
    assert all(r["output_tokens"] == 5 and r["token_source"] == "usage" for lv in levels for r in lv["requests"])
    assert after["deepinfer:request_success_total"] - before["deepinfer:request_success_total"] == 6
    assert (after["deepinfer:generation_tokens_total"] - before["deepinfer:generation_tokens_total"]
            == sum(level["output_tokens"] for level in levels))
    assert (after["deepinfer:prompt_tokens_total"] - before["deepinfer:prompt_tokens_total"]
            == sum(level["prompt_tokens"] for level in levels))
    assert [level["goodput"]["good_requests"] for level in levels] == [4, 2], levels[0]["goodput"]
    # the JSON carries the environment, the exact command (without the key) and the server's model list
    assert payload["targets"][0]["models"] == httpx.get(server.base_url + "/v1/models").json()
    assert payload["targets"][0]["model"] == NAME
    assert payload["env"]["command"].startswith("deepinfer bench serve --base-url")
    assert "not-recorded" not in json.dumps(payload)
    assert "TTFT" in output and "goodput" in output


def test_compare_sends_the_same_text_to_each_server(server, tiny_llama_dir, monkeypatch, tmp_path):
    payload, output = _bench(["--base-url", server.base_url, "--compare", f"{server.base_url}={NAME}",
                              "--tokenizer", str(tiny_llama_dir), "--dataset", "shared-prefix", "--prefix-len", "16",
                              "--input-len", "8", "--output-len", "3", "-c", "2", "-n", "4"], monkeypatch, tmp_path)
    first, second = payload["targets"]
    prompt_tokens = [[r["prompt_tokens"] for r in t["levels"][0]["requests"]] for t in (first, second)]
    assert prompt_tokens[0] == prompt_tokens[1]  # the server's own count of the same text
    assert [row["level"] for row in payload["comparison"]] == ["c=2"]
    assert payload["comparison"][0]["output_tokens_per_s_ratio"] > 0
    assert "each server over" in output


def test_sharegpt_file_over_chat_at_request_rates(server, tiny_llama_dir, monkeypatch, tmp_path):
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    conversations = [
        {"conversations": [{"from": "human", "value": "What is the capital of France? Tell me now."},
                           {"from": "gpt", "value": "The capital of France is Paris."}]},
        {"conversations": [{"from": "human", "value": "Hello world, how are you today?"},
                           {"from": "gpt", "value": "the quick brown fox jumps over the lazy dog"}]},
        {"conversations": [{"from": "human", "value": "Hi"},  # too short: left out
                           {"from": "gpt", "value": "Once upon a time there was a tiny model that"}]},
        {"conversations": [{"from": "gpt", "value": "the model speaks first"}]},  # no question: left out
    ]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    replies = {len(tokenizer.encode(c["conversations"][1]["value"], add_special_tokens=False))
               for c in conversations[:2]}
    payload, _ = _bench(["--base-url", server.base_url, "--tokenizer", str(tiny_llama_dir), "--endpoint", "chat",
                         "--dataset-path", str(dataset), "--request-rate", "inf,20", "--max-concurrency", "2",
                         "-n", "3"], monkeypatch, tmp_path)
    for level in payload["targets"][0]["levels"]:
        assert level["num_completed"] == 3, level["errors"]
        for request in level["requests"]:
            assert request["requested_output_len"] in replies
            assert request["output_tokens"] == request["requested_output_len"]  # ignore_eos
            assert request["prompt_tokens"] > request["prompt_len"]  # the chat template's tokens


def test_the_same_seed_gives_the_same_prompts(tiny_llama_dir):
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    workload = ServeWorkload(kind="shared-prefix", input_len=20, output_len=10, range_ratio=0.5, prefix_len=12,
                             seed=3)
    prompts = PromptMaker(workload, tokenizer).prompts(6, level=0)
    assert prompts == PromptMaker(workload, tokenizer).prompts(6, level=0)
    assert prompts != PromptMaker(workload, tokenizer).prompts(6, level=1)
    assert [p.text for p in prompts] != [p.text for p in PromptMaker(
        ServeWorkload(kind="shared-prefix", input_len=20, output_len=10, range_ratio=0.5, prefix_len=12, seed=4),
        tokenizer).prompts(6, level=0)]
    prefix = os.path.commonprefix([p.text for p in prompts])
    assert len(tokenizer.encode(prefix, add_special_tokens=False)) >= 10  # about the 12 prefix tokens
    assert all(5 <= p.output_len <= 15 for p in prompts)
    special = set(tokenizer.hf_tokenizer.all_special_ids)
    assert not any(set(tokenizer.encode(p.text, add_special_tokens=False)) & special for p in prompts)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="reads the process table from /proc")
def test_serve_starts_its_own_server_and_ctrl_c_stops_it(tiny_llama_dir, tmp_path):
    output = tmp_path / "own.json"
    # far more requests than the test waits for, so the run is still going when the interrupt comes
    # however late a loaded machine's polling sees the first requests finish
    process = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.cli.main", "bench", "serve", "--serve", str(tiny_llama_dir),
         "--serve-args", " ".join(ENGINE_FLAGS), "-c", "1", "-n", "5000", "--input-len", "8", "--output-len", "16",
         "-o", str(output)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        server_pid, base_url = None, None
        while time.monotonic() < deadline and process.poll() is None:
            children = _children(process.pid)
            if children and base_url is None:
                server_pid = children[0]
                args = Path(f"/proc/{server_pid}/cmdline").read_text().split("\0")
                base_url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
            if base_url is not None:
                try:
                    done = sum(v for k, v in _parse(httpx.get(base_url + "/metrics").text).items()
                               if k.startswith("deepinfer:request_success_total"))
                except httpx.TransportError:
                    done = 0
                if done >= 3:  # the warm-up and two measured requests
                    break
            time.sleep(0.2)
        assert server_pid is not None, process.communicate(timeout=30)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert not Path(f"/proc/{server_pid}").exists()  # stopped and reaped, not left running
    with pytest.raises(httpx.TransportError):
        httpx.get(base_url + "/health")
    payload = json.loads(output.read_text())
    assert payload["interrupted"] is True
    target = payload["targets"][0]
    assert target["base_url"] == base_url and target["started_by"].startswith("deepinfer serve --model")
    assert target["levels"][0]["num_completed"] >= 2


def _parse(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
