"""CPU time of one API server per request and per streamed token, on the CPU.

    python scripts/api_server_cost.py
    python scripts/api_server_cost.py --source /tmp/base   # another checkout's code, same environment

Starts `deepinfer serve --engine-process` (the engine core in a process of its own) on a tiny random-weight
Llama with SmolLM2's vocabulary and the default model's tokenizer (byte-level BPE), streams `-n` greedy
requests at concurrency `-c` for a short and a long output length, and reads the API server's CPU time
(user + system, /proc) around each load. Every request runs to its length (ignore_eos), so per streamed token
= the difference in CPU time over the difference in tokens, and per request = the short load's CPU time per
request less its tokens'. On a shared machine other processes add to every figure: compare runs made side by
side, and take the least of several (`--repeats`).

`--source DIR`: serve another source tree (e.g. `git archive BASE | tar -x -C DIR`) through the same
installed environment, as scripts/server_cost_amplifiers.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

BOOT = """
import sys, __editable___deepinfer_0_1_0_finder as finder
old, new = sys.argv.pop(1), sys.argv.pop(1)
if new != old:
    finder.MAPPING.update({k: v.replace(old, new, 1) for k, v in finder.MAPPING.items()})
from deepinfer.cli.main import main
sys.argv[0] = "deepinfer"
main()
"""
TINY_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
PROMPT = "Write a story about a lighthouse keeper."


async def stream_load(base_url: str, num_requests: int, concurrency: int, max_tokens: int, endpoint: str) -> None:
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": PROMPT}]
    else:
        path, body["prompt"] = "/v1/completions", PROMPT
    left = [num_requests]
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with client.stream("POST", path, json=body) as response:
                    response.raise_for_status()
                    async for _ in response.aiter_bytes():
                        pass

        await asyncio.gather(*[worker() for _ in range(concurrency)])


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="serve this source tree's code (default: the installed one)")
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("-n", "--num-requests", type=int, default=64)
    parser.add_argument("-c", "--concurrency", type=int, default=32)
    parser.add_argument("--short", type=int, default=8, help="output tokens of the short load")
    parser.add_argument("--long", type=int, default=264, help="output tokens of the long load")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    args = parser.parse_args()

    from deepinfer.core.weights.default_model import default_model_path

    installed = str(Path(__file__).resolve().parents[1])
    source = str(args.source.resolve()) if args.source else installed
    shape = Path(tempfile.mkdtemp()) / "config.json"
    shape.write_text(json.dumps(TINY_SHAPE))
    command = [sys.executable, "-c", BOOT, installed, source, "serve", "--port", str(args.port),
               "--log-level", "warning", "--dummy-weights", "--shape", str(shape),
               "--tokenizer", str(default_model_path(download=True)), "--device", "cpu", "--max-model-len", "4096",
               "--max-num-seqs", "256", "--engine-process", "--served-model-name", "m"]
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
        api_server = psutil.Process(server.pid)  # with --engine-process the serve process is the API server
        asyncio.run(stream_load(base_url, 8, 8, 16, args.endpoint))  # warm-up
        per_token, per_request = [], []
        n = args.num_requests
        for _ in range(args.repeats):
            cpu = {}
            for length in (args.short, args.long):
                before = cpu_seconds(api_server)
                asyncio.run(stream_load(base_url, n, args.concurrency, length, args.endpoint))
                cpu[length] = cpu_seconds(api_server) - before
            token = (cpu[args.long] - cpu[args.short]) / (n * (args.long - args.short))
            per_token.append(token * 1e6)
            per_request.append((cpu[args.short] / n - token * args.short) * 1e6)
            print(f"per streamed token {per_token[-1]:.1f} µs, per request {per_request[-1]:.0f} µs", flush=True)
        print(f"least of {args.repeats}: per streamed token {min(per_token):.1f} µs, "
              f"per request {min(per_request):.0f} µs")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
