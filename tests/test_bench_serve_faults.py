"""`bench serve` against servers that misbehave, and the parts of it that need no server.

A fake OpenAI server (a raw asyncio server in a thread) picks its behaviour from the model name of
each request: it refuses (429/503), stalls before or during the stream, closes mid-stream, sends
events that are not JSON, ends without `data: [DONE]`, or streams correctly with every SSE line
ending and split. Each must end as its error kind, never hang (pytest-timeout is the hang guard;
no timing is asserted). The arrival schedule is checked on the schedule itself, over many draws.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from deepinfer.core.bench.serve_bench import (
    ServeSweep,
    ServeTarget,
    TokenCounter,
    _LevelRun,
    run_serve_benchmark,
    summarize_level,
)
from deepinfer.core.bench.serve_client import RequestRecord, RequestSettings, sse_events, stream_request
from deepinfer.core.bench.serve_workload import BenchPrompt, arrival_offsets

pytestmark = pytest.mark.timeout(120)

WORDS = ["alpha", " beta", " gamma", " delta", " epsilon"]


def _chunk(text: str, finish=None) -> bytes:
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def _usage(prompt_tokens: int, completion_tokens: int) -> bytes:
    body = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}
    return f"data: {json.dumps(body)}\n\n".encode()


class FakeServer:
    """HTTP/1.1 on a loopback port; one request per connection; behaviour = the request's model name."""

    def __init__(self, token_delay_s: float = 0.0) -> None:
        self.token_delay_s = token_delay_s
        self.requests = 0
        self.finished = 0
        self.counter = 0  # for "every-third-429"
        self.release = threading.Event()  # ends the stalls when the test is over
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()
        server.close()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _stall(self) -> None:
        while not self.release.is_set():
            await asyncio.sleep(0.05)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ")
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = json.loads(await reader.readexactly(int(headers.get("content-length", 0)))) if method == "POST" else {}
            if path == "/v1/models":
                await self._respond(writer, 200, json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode())
                return
            self.requests += 1
            await self._completion(writer, body)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _respond(self, writer, status: int, body: bytes) -> None:
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                     f"connection: close\r\n\r\n".encode() + body)
        await writer.drain()

    async def _completion(self, writer, body: dict) -> None:
        model = body["model"]
        if model == "every-third-429":
            self.counter += 1
            model = "refuse-429" if self.counter % 3 == 0 else "ok"
        if model.startswith("refuse-"):
            await self._respond(writer, int(model.removeprefix("refuse-")), b'{"error": {"message": "busy"}}')
            return
        if model == "stall-headers":
            await self._stall()
            return
        # chunked transfer: a clean end is the zero-length chunk; a cut one lacks it
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                     b"connection: close\r\n\r\n")

        async def send(data: bytes) -> None:
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        n = body["max_tokens"]
        if model == "malformed-json":
            await send(_chunk("alpha") + b"data: {not json\n\n")
        elif model in ("stall-midstream", "close-midstream"):
            await send(_chunk("alpha") + _chunk(" beta"))
            if model == "stall-midstream":
                await self._stall()
            return  # close-midstream: the connection closes without the last chunk
        elif model == "crlf-split":
            # \r\n and \r line ends, a comment, a multi-line data field, every byte its own write
            events = (b": keep-alive\r\n" + _chunk("alpha").replace(b"\n", b"\r\n")
                      + _chunk(" beta").replace(b"\n", b"\r") + b'data: {"choices": [{"index": 0,\ndata: "text": '
                      b'" gamma", "finish_reason": "length"}]}\n\n' + _usage(7, 3) + b"data: [DONE]\n\n")
            for k in range(len(events)):
                await send(events[k:k + 1])
        else:  # ok, no-done
            for k in range(n):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                await send(_chunk(WORDS[k % len(WORDS)], "length" if k == n - 1 else None))
            await send(_usage(5, n))
            if model != "no-done":
                await send(b"data: [DONE]\n\n")
            self.finished += 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()


SETTINGS = RequestSettings(request_timeout_s=20.0, stall_timeout_s=0.5)


def _one(server: FakeServer, model: str, max_tokens: int = 3, settings: RequestSettings = SETTINGS) -> RequestRecord:
    import aiohttp

    async def go() -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            return await stream_request(session, server.base_url, model, settings,
                                        RequestRecord(0, 5, max_tokens), "hello")

    return asyncio.run(go())


@pytest.mark.parametrize(("model", "kind"), [
    ("refuse-429", "429"), ("refuse-503", "503"), ("stall-headers", "stall"), ("stall-midstream", "stall"),
    ("close-midstream", "closed"), ("malformed-json", "malformed"), ("no-done", "incomplete"),
])
def test_each_fault_ends_the_request_as_its_error_kind(model, kind):
    with FakeServer() as server:
        record = _one(server, model)
    assert record.error_kind == kind, record.error
    assert record.done_s is not None


def test_a_stream_that_trickles_past_the_request_timeout_ends_as_timeout():
    # a token every 0.2 s never trips the 0.5 s stall timeout, but 50 of them outlast the 1 s request timeout
    with FakeServer(token_delay_s=0.2) as server:
        record = _one(server, "ok", max_tokens=50, settings=RequestSettings(request_timeout_s=1.0, stall_timeout_s=0.5))
    assert record.error_kind == "timeout", record.error
    assert 0 < len(record.chunk_times_s) < 50


def test_a_correct_stream_with_any_line_ends_and_splits_parses_whole():
    with FakeServer() as server:
        record = _one(server, "crlf-split")
    assert record.ok, record.error
    assert record.text == "alpha beta gamma"
    assert len(record.chunk_times_s) == 3
    assert (record.usage_prompt_tokens, record.usage_completion_tokens) == (7, 3)


def test_sse_parser_follows_the_spec_on_hand_made_streams():
    async def events(pieces: list[bytes]) -> list[str]:
        async def source():
            for piece in pieces:
                yield piece
        return [e async for e in sse_events(source())]

    stream = b": c\r\ndata: a\r\ndata:b\r\n\r\nevent: x\rdata:  two spaces\r\rid: 1\ndata: [DONE]\n\ndata: cut"
    expected = ["a\nb", " two spaces", "[DONE]"]  # the last event has no blank line after it: dropped
    assert asyncio.run(events([stream])) == expected
    for cut in range(1, len(stream)):  # any split between reads gives the same events
        assert asyncio.run(events([stream[:cut], stream[cut:]])) == expected, cut


def test_refusals_count_by_status_and_the_run_finishes():
    with FakeServer() as server:
        target = ServeTarget(server.base_url, "every-third-429")
        sweep = ServeSweep(concurrency_levels=[2], num_prompts=9, warmup_requests=0)
        payload = run_serve_benchmark([target], SETTINGS, sweep, _FixedPrompts(3))
    level = payload["targets"][0]["levels"][0]
    assert level["errors"] == {"429": 3}
    assert level["num_completed"] == 6 and level["num_failed"] == 3
    assert level["output_tokens"] == 6 * 3  # the server's usage
    assert level["token_sources"] == {"usage": 6}
    assert payload["targets"][0]["models"]["data"][0]["id"] == "fake"
    assert not payload["interrupted"]


class _FixedPrompts:
    """A PromptMaker stand-in: the same prompt everywhere, counted by whitespace."""

    class _Words:
        vocab_size = 100

        @staticmethod
        def encode(text, add_special_tokens=True):
            return text.split()

    def __init__(self, output_len: int) -> None:
        from deepinfer.core.bench.serve_workload import ServeWorkload

        self.workload = ServeWorkload(output_len=output_len)
        self.tokenizer = self._Words()

    def prompts(self, num_prompts: int, level: int) -> list[BenchPrompt]:
        return [BenchPrompt("hello there", 2, self.workload.output_len)] * num_prompts


def _record(index: int, sent: float, chunks: list[float], tokens: int, error: str | None = None) -> RequestRecord:
    record = RequestRecord(index, 4, tokens, sent_s=sent, chunk_times_s=chunks, usage_completion_tokens=tokens,
                           usage_prompt_tokens=4, done_s=(chunks or [sent])[-1])
    if error:
        record.fail(error, "x")
    return record


def test_level_summary_and_goodput_on_a_hand_computed_case():
    # request 0: TTFT 100 ms, E2E 400 ms, TPOT (400 - 100) / 3 = 100 ms; request 1: TTFT 600 ms, E2E 700 ms,
    # TPOT (700 - 600) / 2 = 50 ms; request 2: a 503. Wall 1 s.
    run = _LevelRun({"concurrency": 2}, 3, started_s=0.0,
                    records=[_record(0, 0.0, [0.1, 0.2, 0.3, 0.4], 4), _record(1, 0.2, [0.8, 0.85, 0.9], 3),
                             _record(2, 0.5, [], 0, error="503")])
    summary = summarize_level(run, TokenCounter(None), {"ttft": 500.0, "tpot": 120.0}, ended_s=1.0)
    assert summary["errors"] == {"503": 1}
    assert summary["output_tokens"] == 7 and summary["prompt_tokens"] == 8
    assert summary["output_tokens_per_s"] == pytest.approx(7.0)
    assert summary["total_tokens_per_s"] == pytest.approx(15.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(350.0)
    assert summary["tpot_ms"]["max"] == pytest.approx(100.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(75.0)
    assert summary["itl_ms"]["mean"] == pytest.approx((3 * 100.0 + 2 * 50.0) / 5)  # gaps between chunks
    assert summary["e2e_ms"]["max"] == pytest.approx(700.0)
    assert summary["goodput"]["good_requests"] == 1  # request 1's TTFT is over 500 ms
    assert summary["goodput"]["requests_per_s"] == pytest.approx(1.0)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_schedule_has_the_requested_rate_and_burstiness(burstiness):
    rate, n = 8.0, 40001
    gaps = np.diff(arrival_offsets(n, rate, burstiness, seed=[7, 0, 1]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma(shape k): coefficient of variation 1 / sqrt(k); Poisson (k = 1): exponential gaps, CV 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert arrival_offsets(50, rate, burstiness, seed=[7, 0, 1]) == arrival_offsets(50, rate, burstiness,
                                                                                    seed=[7, 0, 1])


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5


def test_ctrl_c_writes_the_partial_json_and_says_so(tmp_path):
    out = tmp_path / "partial.json"
    with FakeServer(token_delay_s=0.05) as server:
        words = tmp_path / "words"
        words.mkdir()
        process = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.cli.main", "bench", "serve", "--base-url", server.base_url,
             "--model", "ok", "--tokenizer", str(_word_tokenizer(words)), "-c", "2", "-n", "400",
             "--input-len", "4", "--output-len", "4", "--warmup", "0", "-o", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 90
        # with 2 clients at most 2 requests are in flight, so 6 answered by the server means the bench
        # has sent at least 6 and finished at least 4
        while server.finished < 6 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    payload = json.loads(out.read_text())
    assert payload["interrupted"] is True
    level = payload["targets"][0]["levels"][0]
    assert level["partial"] is True
    assert 4 <= level["num_completed"] < 400
    assert level["num_completed"] == level["num_sent"]  # only finished requests are kept


def _word_tokenizer(directory):
    """A tiny word-level HF tokenizer saved to `directory` (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["hello", "world", "alpha", "beta", "gamma", "delta"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(directory)
    return directory


def test_an_unreachable_server_is_a_one_line_error_before_anything_runs(tmp_path):
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    with FakeServer() as server:
        closed_url = server.base_url  # nothing listens there once the server is gone
    result = CliRunner().invoke(app, ["bench", "serve", "--base-url", closed_url, "-o", str(tmp_path / "x.json")])
    assert result.exit_code != 0
    assert "cannot list the models" in str(result.exception)
    assert not (tmp_path / "x.json").exists()


def test_max_concurrency_without_a_rate_is_refused():
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    result = CliRunner().invoke(app, ["bench", "serve", "--base-url", "http://127.0.0.1:9", "-c", "4",
                                      "--max-concurrency", "2"])
    assert result.exit_code == 1
    assert "--max-concurrency caps an open loop" in result.output


def test_a_compared_server_that_fails_its_warm_up_is_skipped_and_the_others_kept():
    with FakeServer() as server:
        targets = [ServeTarget(server.base_url, "ok"), ServeTarget(server.base_url, "refuse-503")]
        sweep = ServeSweep(concurrency_levels=[1], num_prompts=2, warmup_requests=1)
        payload = run_serve_benchmark(targets, SETTINGS, sweep, _FixedPrompts(2))
    measured, refused = payload["targets"]
    assert measured["levels"][0]["num_completed"] == 2 and "error" not in measured
    assert "HTTP 503" in refused["error"] and refused["levels"] == []
    assert payload["comparison"] == []
