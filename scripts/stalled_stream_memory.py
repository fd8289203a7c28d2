"""What the server holds for a streaming client that stops reading, against one that reads, on the CPU.

    python3 scripts/stalled_stream_memory.py --tokens 4000 --label HEAD --out results/stalled_stream_memory_cpu.json

Serves a random one-layer Llama with byte tokens (dummy weights, fast steps) in this process and
sends one streaming completion of `--tokens` tokens over a raw socket whose receive buffer is 4 KiB,
the listening socket's send buffer 16 KiB (a slow network, not the kernel's autotuned megabytes).
`stalled` reads nothing until the engine has generated every token, then counts the RequestOutputs
alive (gc) and the bytes of the texts they hold; `read` reads as the tokens come and counts the
same at the end. The run is appended to `--out` under `--label` (run it with the code of another
commit checked out to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def start_server(shape_path: Path):
    import uvicorn

    from deepinfer.core.config import EngineConfig
    from deepinfer.core.server.app import create_app
    from deepinfer.core.server.config import ServerConfig
    from deepinfer.core.server.run import uvicorn_config

    server_config = ServerConfig(served_model_name="tiny")
    app = create_app(EngineConfig(dummy_weights=True, shape=str(shape_path), device="cpu", dtype="float32",
                                  max_model_len=8192, num_gpu_blocks=1200), server_config)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # accepted sockets inherit it
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, server_config, server_config.max_connections, "warning"))
    threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),), daemon=True).start()
    state = app.state.deepinfer
    while state.status == "loading":
        time.sleep(0.05)
    return state, sock.getsockname()[1]


def generated(state) -> int:
    text = state.metrics.render().decode()
    return int(float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("deepinfer:generation_tokens_total"))))


def held_outputs() -> tuple[int, int]:
    from deepinfer.core.engine.frontend.outputs import RequestOutput

    gc.collect()
    held = [o for o in gc.get_objects() if type(o) is RequestOutput]
    return len(held), sum(sys.getsizeof(c.text) for o in held for c in o.outputs)


def run(state, port: int, tokens: int, stalled: bool) -> dict:
    body = json.dumps({"prompt": "hi", "max_tokens": tokens, "ignore_eos": True, "stream": True}).encode()
    before = generated(state)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        received = b""
        while generated(state) - before < tokens and not received.endswith(b"0\r\n\r\n"):
            if stalled:
                time.sleep(0.05)
            else:
                received += sock.recv(1 << 16)
        count, text_bytes = held_outputs()
        while not received.endswith(b"0\r\n\r\n") and (chunk := sock.recv(1 << 20)):
            received += chunk
    assert b"data: [DONE]" in received
    return {"client": "stalled" if stalled else "read", "tokens": tokens, "held_request_outputs": count,
            "held_text_bytes": text_bytes, "response_bytes": len(received)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--label", required=True, help="which code ran (a commit)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from deepinfer.core.bench.env_info import env_info

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        shape = Path(directory) / "tiny-llama.json"
        shape.write_text(json.dumps(SHAPE))
        state, port = start_server(shape)
        results = [run(state, port, args.tokens, stalled) for stalled in (False, True)]
    report = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    report["runs"].append({"label": args.label, "env": env_info(), "results": results})
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
