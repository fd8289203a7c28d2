"""What one costly request does to its neighbours on a `deepinfer serve`: gaps and /health latency.

    python scripts/server_cost_amplifiers.py --label after --out results/server_cost_amplifiers_cpu.json
    python scripts/server_cost_amplifiers.py --label before --source /tmp/amp_base --out ...

Starts `deepinfer serve` on a tiny random-weight Llama with SmolLM2's vocabulary size (49152 tokens,
hidden size 64, 2 layers; `--dummy-weights`, byte tokenizer), so a step costs little and what a
costly request adds to it shows, and, per scenario,
streams a normal greedy request (the neighbour, one token per chunk) while one costly request runs
beside it, probing /health all the while. Recorded per scenario: the neighbour's inter-token gaps,
the /health latencies, the costly request's status and time, and the machine's load average (on a
shared machine the numbers move with it: compare runs made side by side). The scenarios are the request
costs a client controls: n=64 with a seed and many `stop_token_ids`, 16 long stop strings, a bias on
every vocabulary token; "alone" is the neighbour by itself.

`--source DIR`: serve another checkout's code (e.g. `git archive main | tar -x -C DIR`) through the
same installed environment, so before and after run on one machine. `--out` merges this run's
scenarios into the JSON file under its label (other labels and scenarios are kept), with the
environment block of each invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

NEIGHBOUR = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 64, "temperature": 0,
             "ignore_eos": True, "logprobs": 0, "stream": True}
VOCAB = 49152  # SmolLM2's
TINY_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
STOP_MARKS = "!#$%&()*+,-./:;<"  # 16 ASCII marks: 1 byte each in the JSON body, never in the output
LETTERS = {str(t): 100 for t in range(ord("a"), ord("z") + 1)}  # byte tokens: the output is text

SCENARIOS = {
    "alone": None,
    # A hostile request: 600k stop token ids (1.7 MiB of JSON), n=64, a seed.
    "stop_token_ids_600k_n64_seed": {"prompt": "Hi", "n": 64, "seed": 1, "max_tokens": 2,
                                     "stop_token_ids": list(range(100)) * 6000},
    # The most stop_token_ids the server accepts now (1024).
    "stop_token_ids_1024_n64_seed": {"prompt": "Hi", "n": 64, "seed": 1, "max_tokens": 2,
                                     "stop_token_ids": list(range(1024))},
    # 16 stop strings of 100k characters that never match (the output is letters), a long output.
    "stop_strings_16x100k": {"prompt": "Count to a thousand:", "max_tokens": 512, "ignore_eos": True,
                             "temperature": 0, "logit_bias": LETTERS,
                             "stop": [mark * 100_000 for mark in STOP_MARKS]},
    # The longest stop strings accepted now (16 of 4096 characters).
    "stop_strings_16x4096": {"prompt": "Count to a thousand:", "max_tokens": 512, "ignore_eos": True,
                             "temperature": 0, "logit_bias": LETTERS,
                             "stop": [mark * 4096 for mark in STOP_MARKS]},
    # A bias on every token of the vocabulary, one sample and eight.
    "logit_bias_full_vocab_n1": {"prompt": "Paris is", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                 "logit_bias": {str(t): 0.5 for t in range(VOCAB)}},
    "logit_bias_full_vocab_n8": {"prompt": "Paris is", "max_tokens": 16, "n": 8, "temperature": 0,
                                 "ignore_eos": True, "logit_bias": {str(t): 0.5 for t in range(VOCAB)}},
}

# Serve the code of another source tree: repoint the editable install's package map, then run the CLI.
BOOT = """
import sys, __editable___deepinfer_0_1_0_finder as finder
old, new = sys.argv.pop(1), sys.argv.pop(1)
if new != old:
    finder.MAPPING.update({k: v.replace(old, new, 1) for k, v in finder.MAPPING.items()})
from deepinfer.cli.main import main
sys.argv[0] = "deepinfer"
main()
"""


def summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {"count": len(values), "p50_ms": round(1e3 * statistics.median(ordered), 1),
            "p90_ms": round(1e3 * ordered[int(0.9 * (len(ordered) - 1))], 1), "max_ms": round(1e3 * ordered[-1], 1)}


def stream_gaps(base_url: str, first_chunk: threading.Event) -> list[float]:
    gaps, last = [], None
    with httpx.stream("POST", base_url + "/v1/completions", json=NEIGHBOUR, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            first_chunk.set()
    return gaps


def run_scenario(base_url: str, body: dict | None) -> dict:
    first_chunk = threading.Event()
    result: dict = {}

    def neighbour():
        result["gaps"] = stream_gaps(base_url, first_chunk)

    def costly():
        start = time.perf_counter()
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=600)
        result["costly"] = {"status": response.status_code, "seconds": round(time.perf_counter() - start, 2),
                            "body_bytes": len(json.dumps(body))}
        if response.status_code != 200:
            result["costly"]["error"] = response.json()["error"]["message"][:200]

    threads = [threading.Thread(target=neighbour)]
    threads[0].start()
    first_chunk.wait(timeout=600)
    if body is not None:
        threads.append(threading.Thread(target=costly))
        threads[1].start()
    health = []
    while any(thread.is_alive() for thread in threads):
        start = time.perf_counter()
        httpx.get(base_url + "/health", timeout=600).raise_for_status()
        health.append(time.perf_counter() - start)
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    return {"load_average_1min": round(os.getloadavg()[0], 2),
            "neighbour_inter_token_gaps": summary(result["gaps"]), "health_latency": summary(health),
            **({"costly_request": result["costly"]} if body is not None else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the name of this run in the JSON (e.g. before, after)")
    parser.add_argument("--source", type=Path, help="serve this source tree's code (default: the installed one)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()

    from deepinfer.core.bench.env_info import env_info

    installed = str(Path(__file__).resolve().parents[1])
    source = str(args.source.resolve()) if args.source else installed
    shape = Path(tempfile.mkdtemp()) / "config.json"
    shape.write_text(json.dumps(TINY_SHAPE))
    command = [sys.executable, "-c", BOOT, installed, source, "serve", "--port", str(args.port),
               "--log-level", "warning", "--max-body-bytes", "4MiB", "--dummy-weights", "--shape", str(shape),
               "--device", "cpu", "--max-model-len", "2048"]
    server = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        runs = {}
        for name in args.scenarios.split(","):
            runs[name] = run_scenario(base_url, SCENARIOS[name])
            print(name, json.dumps(runs[name]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)

    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    run = existing.setdefault("runs", {}).setdefault(args.label, {"invocations": [], "scenarios": {}})
    run["source"] = "this checkout" if source == installed else source
    run["invocations"].append({"env": env_info(), "scenarios": list(runs)})
    run["scenarios"].update(runs)
    existing["what"] = " ".join(__doc__.split("\n\n")[2].split())
    args.out.write_text(json.dumps(existing, indent=1) + "\n")


if __name__ == "__main__":
    main()
