"""The engine core in its own process: message framing, the client against the in-process engine
(greedy tokens equal; stop strings, n > 1 and logprobs equal, with the front end detokenizing; aborts,
bad input, stats), `LLM`, chat and bench concurrency with the engine in its own process, a clean
shutdown, the server when the engine process is killed (its open stream ends, new requests get a
503, the server exits non-zero), and one engine process shared by two clients (each gets its own
requests' outputs, their stats sum to the engine's, it stops after the last client)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from server_helpers import free_port, wait_until_healthy

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.core_ipc import ABORT, ADD, OUTPUTS, MessageCodec
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.stats import FinishedRequestStats, IterationStats
from deepinfer.core.errors import PromptTooLongError


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_messages_are_one_frame_each_and_come_back_as_the_objects_sent():
    codec = MessageCodec()
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["\n\n"], seed=3)
    stats = IterationStats(num_running=2, num_generation_tokens=5, inter_token_latencies_s=[0.01, 0.02],
                           finished_requests=[FinishedRequestStats("length", 4, 7, 0.5, 0.1, 0.01)])
    add = codec.encode(ADD, (1, "r1", [1, 2, 3], params, None))
    assert isinstance(add, bytes)
    kind, (client, request_id, ids, decoded_params, salt) = codec.decode(add)
    assert (kind, client, request_id, ids, salt) == (ADD, 1, "r1", [1, 2, 3], None)
    assert decoded_params == params and decoded_params.stop.failure_tables == params.stop.failure_tables
    assert codec.decode(codec.encode(ABORT, ["r1#0", "r1#1"])) == (ABORT, ["r1#0", "r1#1"])
    step = (["r1", "r2"], [17, 4], None, [("r1", 12.5, 8)], [("r2", "abort", None, None, 13.0)])
    assert codec.decode(codec.encode(OUTPUTS, ([], step, stats, None)))[1][1:3] == (step, stats)
    # The framing itself is msgpack: an independent decoder reads the kind and the plain payloads.
    assert msgspec.msgpack.decode(codec.encode(ABORT, "r1")) == ["abort", "r1"]
    with pytest.raises(msgspec.DecodeError):
        codec.decode(msgspec.msgpack.encode(["outputs", msgspec.msgpack.Ext(7, b"x")]))


@pytest.fixture(scope="module")
def engine_config(tiny_llama_dir):
    return EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256,
                        num_gpu_blocks=64, block_size=8)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(engine_config, loop):
    from deepinfer.core.engine.frontend.core_client import EngineCoreClient

    client = EngineCoreClient(engine_config)
    client.stats = []
    client.add_stats_listener(client.stats.append)
    loop.run_until_complete(client.start())
    yield client
    if client.process.is_alive():
        loop.run_until_complete(client.shutdown())


async def collect(stream):
    return [out async for out in stream]


@pytest.fixture(scope="module")
def in_process(engine_config):
    return LLMEngine(engine_config)


def _in_process_finals(engine, requests) -> tuple[dict, int]:
    """The in-process engine's final outputs by request id, and the generation tokens its stats count."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=request_id)
    finals, generated = {}, 0
    while engine.has_unfinished_requests():
        outputs, stats = engine.step()
        generated += stats.num_generation_tokens
        finals.update({out.request_id: out for out in outputs if out.finished})
    return finals, generated


def test_greedy_tokens_and_text_equal_the_in_process_engine(client, in_process, loop):
    prompts = ["Once upon a time", [5, 9, 33, 71, 2, 8], "The capital of"]
    lengths = [24, 9, 17]
    finals, _ = _in_process_finals(in_process, {f"r{i}": (p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, lengths))})
    expected = {rid: (out.outputs[0].token_ids, out.outputs[0].text) for rid, out in finals.items()}
    client.stats.clear()

    async def run():
        streams = [client.add_request(p, greedy(n), request_id=f"r{i}")
                   for i, (p, n) in enumerate(zip(prompts, lengths))]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = loop.run_until_complete(run())
    for index, outputs in enumerate(results):
        final = outputs[-1]
        assert final.finished and final.outputs[0].finish_reason == "length"
        # Every token once, in order: the deltas join to the final output.
        assert [t for out in outputs for t in out.outputs[0].delta_token_ids] == final.outputs[0].token_ids
        assert (final.outputs[0].token_ids, final.outputs[0].text) == expected[f"r{index}"]
    deadline = time.monotonic() + 10
    while sum(len(s.finished_requests) for s in client.stats) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the stats of the last step come with its outputs, on the client's thread
    assert sum(s.num_generation_tokens for s in client.stats) == sum(lengths)  # /metrics' counts are exact
    assert sorted(f.num_generation_tokens for s in client.stats for f in s.finished_requests) == sorted(lengths)


def test_stop_strings_samples_and_logprobs_equal_the_in_process_engine(client, in_process, loop):
    """The front end detokenizes and matches stop strings: it cuts where the in-process engine cuts, tells
    the engine to free the sample, and drops (and does not count) what the engine computed meanwhile."""
    probe, _ = _in_process_finals(in_process, {"p": ("Once upon a time", greedy(40))})
    text = probe["p"].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop and len(text) > 4
    requests = {
        "stop": ("Once upon a time", greedy(40, stop=[stop])),
        "stop-late": ("Once upon a time", greedy(40, stop=["\x07never", stop])),
        "n2": ("The capital of", SamplingParams(temperature=0.9, max_tokens=12, n=2, seed=7, logprobs=2)),
        "plain": ([5, 9, 33, 71], greedy(15)),
    }
    expected, expected_generated = _in_process_finals(in_process, requests)
    assert expected["stop"].outputs[0].finish_reason == "stop" and expected["stop"].outputs[0].stop_reason == stop
    client.stats.clear()

    async def run():
        streams = {rid: client.add_request(p, params, request_id=rid) for rid, (p, params) in requests.items()}
        return {rid: await collect(stream) for rid, stream in streams.items()}

    results = loop.run_until_complete(run())
    for request_id, outputs in results.items():
        final, want = outputs[-1], expected[request_id]
        assert final.finished
        for index, (got, ref) in enumerate(zip(final.outputs, want.outputs, strict=True)):
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
                ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason), (request_id, index)
            assert "".join(out.outputs[index].delta_text for out in outputs) == ref.text  # no text lost or doubled
            assert [t for out in outputs for t in out.outputs[index].delta_token_ids] == ref.token_ids
            if ref.logprobs is not None:
                # The same tokens ranked; the values to float rounding (the two engines batch differently).
                assert [[t for t, _ in lp.top] for lp in got.logprobs] == [[t for t, _ in lp.top] for lp in ref.logprobs]
                assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
    deadline = time.monotonic() + 10
    while sum(len(s.finished_requests) for s in client.stats) < len(requests) and time.monotonic() < deadline:
        time.sleep(0.05)
    # The tokens the engine computed past a stop string are not counted, as in-process.
    assert sum(s.num_generation_tokens for s in client.stats) == expected_generated
    deadline = time.monotonic() + 10
    while client.read_health()["blocks"]["num_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.read_health()["blocks"]["num_used"] == 0  # the stopped samples were freed in the engine


def test_llm_with_the_engine_in_its_own_process_generates_what_the_in_process_engine_does(engine_config, in_process):
    from deepinfer import LLM

    fields = {k: getattr(engine_config, k) for k in ("device", "dtype", "max_model_len", "num_gpu_blocks", "block_size")}
    llm = LLM(engine_config.model, engine_process=True, max_waiting_requests=2, **fields)  # 4 samples: fed in turns
    try:
        prompts = ["Once upon a time", [5, 9, 33, 71], "The capital of"]
        params = [greedy(20, stop=["e t"]), greedy(9), SamplingParams(temperature=0.8, max_tokens=10, n=2, seed=3)]
        outputs = llm.generate(prompts, params)
        assert llm.engine.process.is_alive()
    finally:
        llm.shutdown()
    assert llm.engine.process.exitcode == 0
    resolved = [p.with_defaults(llm.sampling_defaults) for p in params]
    expected, _ = _in_process_finals(in_process, {f"e{i}": (p, q) for i, (p, q) in enumerate(zip(prompts, resolved))})
    for index, output in enumerate(outputs):
        want = expected[f"e{index}"]
        assert [(c.token_ids, c.text, c.finish_reason) for c in output.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in want.outputs]
        assert output.prompt == (prompts[index] if isinstance(prompts[index], str) else None)


def test_prompt_logprobs_cross_the_boundary(client, loop, in_process):
    prompt = [5, 9, 33, 71, 12, 40]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    expected, _ = _in_process_finals(in_process, {"p": (prompt, params)})

    async def run():
        return await collect(client.add_request(prompt, params, request_id="p"))

    final = loop.run_until_complete(run())[-1]
    want = expected["p"].prompt_logprobs
    assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == len(prompt) == len(want)
    for got, ref in zip(final.prompt_logprobs[1:], want[1:]):
        assert (got.token_id, got.rank, [t for t, _ in got.top]) == (ref.token_id, ref.rank, [t for t, _ in ref.top])
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)


def test_abort_crosses_the_boundary_and_frees_the_sequence(client, loop):
    async def run():
        stream = client.add_request("Tell me a long story", greedy(200), request_id="long")
        first = await stream.__anext__()
        stream.abort()
        return first, await collect(stream)

    first, rest = loop.run_until_complete(run())
    final = rest[-1] if rest else first
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 200
    deadline = time.monotonic() + 10
    while client.read_health()["scheduler"]["num_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.read_health()["scheduler"]["num_running"] == 0
    assert client.read_health()["blocks"]["num_used"] == 0


def test_bad_input_is_refused_at_once_in_the_front_end(client):
    with pytest.raises(PromptTooLongError):
        client.add_request([1] * 250, greedy(50))


def test_shutdown_stops_the_engine_process_cleanly(client, loop):
    loop.run_until_complete(client.shutdown())
    assert client.process.exitcode == 0 and not client.process.is_alive()


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


@pytest.mark.slow
def test_a_killed_engine_process_ends_the_open_stream_and_the_server_exits_non_zero(tiny_llama_dir):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "deepinfer", "serve", "--model", str(tiny_llama_dir), "--port", str(port),
         "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "8MiB",
         "--log-level", "warning", "--engine-process"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, base)
        engine_pids = [pid for pid in _children(process.pid)  # multiprocessing's spawned child, not its helpers
                       if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engine_pids) == 1
        assert httpx.get(base + "/health").json()["engine_alive"] is True
        events = []
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        for pid in engine_pids:
                            os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)  # the server stops by itself: it never hangs
        _, stderr = process.communicate()
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, stderr
    errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and errors[0]["error"]["code"] == "engine_dead", events[-3:]
    assert "engine process" in stderr


def test_chat_with_the_engine_in_its_own_process_answers_as_in_process(engine_config, in_process):
    """`deepinfer chat --engine-process`: the chat's engine on its loop thread is the engine process's client."""
    from deepinfer.cli.chat_engine import ChatEngine

    prompt_ids = [5, 9, 33, 71, 2, 8]
    expected, _ = _in_process_finals(in_process, {"chat": (prompt_ids, greedy(16))})
    chat = ChatEngine()
    try:
        chat.load(engine_config, engine_process=True)
        pieces = []
        answer = chat.stream_answer(prompt_ids, greedy(16), pieces.append)
        assert chat.engine.process.is_alive()
    finally:
        chat.shutdown()
    assert answer.text == "".join(pieces) == expected["chat"].outputs[0].text
    assert answer.finish_reason == "length" and not answer.interrupted
    assert chat.engine.process.exitcode == 0


def test_bench_concurrency_runs_with_the_engine_in_its_own_process(tmp_path, tiny_llama_dir, monkeypatch):
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    output = tmp_path / "concurrency.json"
    args = ["bench", "concurrency", "--model", str(tiny_llama_dir), "--engine-process", "--quantization", "w4a16",
            "--concurrency", "2", "--prompt-len", "8", "--output-len", "3", "--num-requests", "4", "-o", str(output)]
    monkeypatch.setattr("sys.argv", ["deepinfer", *args])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    data = json.loads(output.read_text())
    assert data["engine_process"] is True
    # The engine process's model, reported across: 3 layers x (qkv, o, gate_up, down), all 4-bit.
    assert data["weights"]["quantized_linears"] == 12 and data["weights"]["quantized_bits"] == [4]
    (run,) = data["levels"][0]["repeats"]
    assert run["num_failed"] == 0 and run["output_tokens"] == 12 and run["max_running"] == 2
    assert [r["output_len"] for r in run["requests"]] == [3] * 4


@pytest.fixture(scope="module")
def shared_engine(engine_config, loop, tmp_path_factory):
    """One engine process with two attached clients, as the API servers of `serve --api-server-count 2`."""
    import multiprocessing

    import torch

    from deepinfer.core.engine.core_ipc import client_sockets
    from deepinfer.core.engine.frontend.core_client import EngineCoreClient
    from deepinfer.core.engine.sched.core_process import run_engine_core

    sockets = client_sockets(tmp_path_factory.mktemp("sockets"), 2)
    engine = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, args=(engine_config, sockets, torch.get_num_threads()), daemon=True)
    engine.start()
    clients = [EngineCoreClient(engine_config, s, engine.pid) for s in sockets]
    for client in clients:
        client.stats = []
        client.add_stats_listener(client.stats.append)
        loop.run_until_complete(client.start())
    yield engine, clients
    for client in clients:
        if client.is_alive:
            loop.run_until_complete(client.shutdown())
    engine.join(10)
    if engine.is_alive():
        engine.kill()


def test_two_clients_of_one_engine_get_their_own_outputs_and_together_its_counts(shared_engine, in_process, loop):
    """Each client's requests (the same ids in both: each client's are its own) answer as the in-process
    engine does; the stats of the two sum to the engine's: every generation token counted once."""
    _, clients = shared_engine
    prompts = {"a": ("Once upon a time", greedy(14)), "b": ([5, 9, 33, 71, 2, 8], greedy(9)),
               "c": ("The capital of", greedy(20, stop=["e t"]))}
    expected, expected_generated = _in_process_finals(in_process, prompts)
    for client in clients:
        client.stats.clear()

    async def run():
        streams = [(index, rid, client.add_request(p, params, request_id=rid))
                   for index, client in enumerate(clients) for rid, (p, params) in prompts.items()]
        finals = await asyncio.gather(*(collect(stream) for _, _, stream in streams))
        return {(index, rid): outputs for (index, rid, _), outputs in zip(streams, finals)}

    results = loop.run_until_complete(run())
    for (_, rid), outputs in results.items():
        final, want = outputs[-1], expected[rid]
        assert final.finished
        assert (final.outputs[0].token_ids, final.outputs[0].text, final.outputs[0].finish_reason) == (
            want.outputs[0].token_ids, want.outputs[0].text, want.outputs[0].finish_reason), rid
        assert "".join(out.outputs[0].delta_text for out in outputs) == want.outputs[0].text
    deadline = time.monotonic() + 10
    while (sum(len(s.finished_requests) for c in clients for s in c.stats) < 2 * len(prompts)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    for client in clients:  # each client counts its own requests' tokens
        assert sum(s.num_generation_tokens for s in client.stats) == expected_generated
        assert len([f for s in client.stats for f in s.finished_requests]) == len(prompts)
    # The engine-wide figures of a step go to one client only: the prefix-cache lookups of the six
    # requests add up to the in-process engine's for the same six.
    twice = {f"{rid}{index}": request for rid, request in prompts.items() for index in range(2)}
    for request_id, (prompt, params) in twice.items():
        in_process.add_request(prompt, params, request_id=request_id)
    looked_up = 0
    while in_process.has_unfinished_requests():
        looked_up += in_process.step()[1].prefix_cache_queries
    assert looked_up > 0 and sum(s.prefix_cache_queries for c in clients for s in c.stats) == looked_up


def test_an_abort_from_one_client_leaves_the_other_clients_request_running(shared_engine, loop):
    _, (first, second) = shared_engine

    async def run():
        aborted = first.add_request("Tell me a long story", greedy(200), request_id="same")
        kept = second.add_request("Tell me a long story", greedy(30), request_id="same")
        await aborted.__anext__()
        aborted.abort()
        return await collect(aborted), await collect(kept)

    aborted, kept = loop.run_until_complete(run())
    assert aborted[-1].outputs[0].finish_reason == "abort" and len(aborted[-1].outputs[0].token_ids) < 200
    assert kept[-1].outputs[0].finish_reason == "length" and len(kept[-1].outputs[0].token_ids) == 30


def test_the_shared_engine_stops_once_every_client_has_shut_down(shared_engine, loop):
    engine, (first, second) = shared_engine
    loop.run_until_complete(first.shutdown())
    time.sleep(0.5)
    assert engine.is_alive() and second.is_alive  # the other client is still served
    stream_outputs = loop.run_until_complete(collect(second.add_request([5, 9, 33], greedy(4))))
    assert stream_outputs[-1].finished and len(stream_outputs[-1].outputs[0].token_ids) == 4
    loop.run_until_complete(second.shutdown())
    engine.join(10)
    assert engine.exitcode == 0
