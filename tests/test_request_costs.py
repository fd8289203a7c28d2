"""What one request can make the server do: bounded, linear, and off the event loop.

Counted, never timed: the characters the stop matcher reads per token at 1k and 32k characters of
output, how often a request's lists are validated and its logit_bias turned into a device row, and
on which thread a request is made. Then each costly request a client can send (n=64 with a seed and
the most stop_token_ids, 16 stop strings of the longest length, a bias on every vocabulary token)
runs against a real server beside a normal stream, which must get the answer it gets alone.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import ServerThread

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine import sampling_params as sampling_params_module
from deepinfer.core.engine.frontend import stop_strings
from deepinfer.core.engine.frontend.detokenizer import IncrementalDetokenizer
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    LogitBias,
    SamplingParams,
)
from deepinfer.core.engine.worker.sampler import Sampler, SamplingRow, apply_logit_bias
from deepinfer.core.errors import InvalidRequestError
from deepinfer.core.server.config import ServerConfig

# Limits ----------------------------------------------------------------------------------------------


def test_limits_on_stop_token_ids_and_stop_strings():
    assert isinstance(SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))).stop_token_ids, frozenset)
    with pytest.raises(InvalidRequestError, match=f"more than the {MAX_STOP_TOKEN_IDS} allowed"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS]).stop == ("x" * MAX_STOP_STRING_CHARS,)
    with pytest.raises(InvalidRequestError, match=f"more than the {MAX_STOP_STRING_CHARS} allowed"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])


def test_per_sample_copies_do_not_validate_again(monkeypatch):
    """n samples with a seed are n copies of the params: the lists are validated once, not n times."""
    calls = []
    validate = sampling_params_module._integer
    monkeypatch.setattr(sampling_params_module, "_integer", lambda name, *a, **k: calls.append(name) or
                        validate(name, *a, **k))
    params = SamplingParams(n=64, seed=3, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
                            logit_bias={t: 1.0 for t in range(500)})
    copies = [dataclasses.replace(params, seed=params.seed + i) for i in range(64)]
    assert calls.count("stop_token_ids") == MAX_STOP_TOKEN_IDS
    assert calls.count("logit_bias token id") == 500
    assert all(c.stop_token_ids is params.stop_token_ids and c.logit_bias is params.logit_bias for c in copies)


# Stop strings: the work per token does not grow with the text -----------------------------------------


class CountingStr(str):
    """A stop string that counts the characters read from it (by index or slice)."""

    reads = 0

    def __getitem__(self, key):
        part = str.__getitem__(self, key)
        CountingStr.reads += len(part)
        return part


class PieceTokenizer:
    """Token i decodes to PIECES[i] (context-free, so the detokenizer's window is exact)."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_stop_string_reads_per_token_are_the_same_at_1k_and_32k_characters():
    # 16 stops of the longest length that the text "abab..." keeps nearly matching: the worst case
    # for a matcher that looks back over the text (each step could re-read up to 4096 characters).
    stops = [CountingStr("ab" * ((MAX_STOP_STRING_CHARS - 2) // 2) + chr(ord("c") + k) + "x")
             for k in range(MAX_STOP_STRINGS)]
    tokenizer = PieceTokenizer(["ab", "c", "x"])
    params = SamplingParams(max_tokens=20_000, stop=stops)
    detokenizer = IncrementalDetokenizer(tokenizer, [0], params, set())
    fed: list[int] = []
    matcher = detokenizer._stop_matcher
    feed = matcher.feed
    matcher.feed = lambda text: fed.append(len(text)) or feed(text)
    reads_per_token = {}
    for token in range(16_500):
        before = CountingStr.reads
        assert not detokenizer.append(0).finished
        reads_per_token[token] = CountingStr.reads - before
    assert fed == [2] * 16_500  # only each token's new text reaches the matcher
    at_1k = [reads_per_token[t] for t in range(500, 532)]  # 1,000 characters of output
    at_32k = [reads_per_token[t] for t in range(16_000, 16_032)]  # 32,000
    at_8k = [reads_per_token[t] for t in range(4_000, 4_032)]  # past the stops' length: the steady state
    assert max(at_1k + at_8k + at_32k) <= 4 * 2 * MAX_STOP_STRINGS  # a few reads per new character per stop
    assert at_32k == at_8k  # nothing grows with the text
    # And it still stops where the text first contains a stop, holding back what could start one.
    assert len(detokenizer._held_text) == MAX_STOP_STRING_CHARS - 2
    detokenizer.append(1)
    step = detokenizer.append(2)
    assert (step.finished, step.stop_reason) == (True, stops[0])
    text = "ab" * 16_500 + "cx"
    assert detokenizer.text == text[:text.find(stops[0])]


def naive_stop(text: str, stops: list[str], done: int) -> tuple[int, str] | None:
    """Earliest-starting stop among each stop's first occurrence ending after `done` characters."""
    found = []
    for stop in stops:
        index = text.find(stop)
        while index >= 0 and index + len(stop) <= done:
            index = text.find(stop, index + 1)
        if index >= 0:
            found.append((index, stop))
    return min(found, key=lambda match: match[0]) if found else None


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=4),
       chunks=st.lists(st.text("abc", max_size=5), max_size=12))
def test_stop_matcher_agrees_with_str_find(stops, chunks):
    matcher = stop_strings.StopStringMatcher(stops)
    text = ""
    for chunk in chunks:
        done = len(text)
        text += chunk
        expected = naive_stop(text, stops, done)
        assert matcher.feed(chunk) == expected, (stops, chunks)
        if expected is not None:
            return
        held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        assert matcher.held_back == held


# logit_bias: one device row per request, one add per step ----------------------------------------------


class CountingBias(LogitBias):
    """A LogitBias that counts the reads of its entries."""

    __slots__ = ()
    reads = 0

    def __getitem__(self, token_id):
        CountingBias.reads += 1
        return LogitBias.__getitem__(self, token_id)


def test_full_vocabulary_bias_is_read_once_per_request():
    vocab, generator = 4096, torch.Generator().manual_seed(0)
    bias = CountingBias({t: random.Random(t).uniform(-5, 5) for t in range(vocab)})
    params = SamplingParams(temperature=0.0, logit_bias=bias)
    plain = SamplingParams(temperature=0.0)
    rows = [SamplingRow(params, [1], []), SamplingRow(plain, [1], []), SamplingRow(params, [1], [])]
    sampler = Sampler()
    expected_bias = torch.tensor([bias._biases[t] for t in range(vocab)], dtype=torch.float32)
    for _ in range(10):
        logits = torch.randn(3, vocab, generator=generator)
        reference = logits.clone()
        reference[0] += expected_bias
        reference[2] += expected_bias
        assert torch.equal(apply_logit_bias(logits, rows), reference)
        assert sampler.sample(logits, rows).token_ids == reference.argmax(dim=-1).tolist()
    assert CountingBias.reads == vocab  # the row was built at the first step, then reused


# Against a real server, beside a normal stream ---------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256,
                          num_gpu_blocks=512, max_num_seqs=72, max_waiting_requests=80)
    running = ServerThread(config, ServerConfig(served_model_name="tiny")).start()
    yield running
    running.stop()


NEIGHBOUR = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
             "ignore_eos": True, "logprobs": 0}


def stream_text(base_url: str, body: dict) -> tuple[str, int]:
    """(text, tokens) of a streamed completion that ended with [DONE]; a chunk may carry several tokens
    (the server merges what a reader has not taken yet), so tokens are counted from its logprobs."""
    text, tokens, done = "", 0, False
    with httpx.stream("POST", base_url + "/v1/completions", json=body | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                tokens += len(choice["logprobs"]["tokens"])
    assert done
    return text, tokens


def beside_a_stream(server, amplifier: dict) -> tuple[dict, int]:
    """Runs the amplifier and a neighbour stream at once; returns the amplifier's response and how many
    /health probes answered while both ran. The neighbour must get exactly its text alone."""
    alone, _ = stream_text(server.base_url, NEIGHBOUR)
    results: dict = {}

    def neighbour():
        results["neighbour"] = stream_text(server.base_url, NEIGHBOUR)

    def costly():
        results["amplifier"] = httpx.post(server.base_url + "/v1/completions", json=amplifier, timeout=120)

    threads = [threading.Thread(target=neighbour), threading.Thread(target=costly)]
    for thread in threads:
        thread.start()
    healthy = 0
    while any(thread.is_alive() for thread in threads):
        healthy += httpx.get(server.base_url + "/health", timeout=60).status_code == 200
    for thread in threads:
        thread.join(timeout=120)  # a hang guard only
    text, tokens = results["neighbour"]
    assert (text, tokens) == (alone, NEIGHBOUR["max_tokens"])
    response = results["amplifier"]
    assert response.status_code == 200, response.text
    return response.json(), healthy


@pytest.fixture
def request_threads(server, monkeypatch):
    """(thread, n) of each engine request made (LLMEngine.make_request_group)."""
    threads = []
    make = LLMEngine.make_request_group

    def recording(self, prompt, params, *args, **kwargs):
        threads.append((threading.current_thread(), params.n))
        return make(self, prompt, params, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "make_request_group", recording)
    return threads


def test_n64_seeded_with_the_most_stop_token_ids(server, request_threads, monkeypatch):
    calls = []
    validate = sampling_params_module._integer
    monkeypatch.setattr(sampling_params_module, "_integer", lambda name, *a, **k: calls.append(name) or
                        validate(name, *a, **k))
    vocab = server.engine.spec.vocab_size
    stop_ids = [random.Random(i).randrange(3, vocab) for i in range(MAX_STOP_TOKEN_IDS)]
    body, healthy = beside_a_stream(server, {"model": "tiny", "prompt": "Once upon a time", "n": 64, "seed": 7,
                                             "max_tokens": 4, "stop_token_ids": stop_ids})
    assert len(body["choices"]) == 64 and healthy >= 1
    assert calls.count("stop_token_ids") == MAX_STOP_TOKEN_IDS  # once for the request, not per sample
    made = [thread for thread, n in request_threads if n == 64]
    assert made and server._thread not in made  # made off the event loop
    # the neighbour stream (a small body, one sample): made on the loop, cheaper than the hand-over
    assert server._thread in [thread for thread, n in request_threads if n == 1]


def test_too_many_stop_token_ids_is_a_400(server):
    response = httpx.post(server.base_url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "x", "stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids" and str(MAX_STOP_TOKEN_IDS) in error["message"]


@pytest.mark.parametrize("stop", [["y" * (MAX_STOP_STRING_CHARS + 1)], "y" * (MAX_STOP_STRING_CHARS + 1)])
def test_too_long_a_stop_string_is_a_400(server, stop):
    response = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stop": stop},
                          timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"].startswith("stop") and str(MAX_STOP_STRING_CHARS) in error["message"]


def test_longest_stop_strings_cost_each_character_once(server, request_threads, monkeypatch):
    fed = []
    feed = stop_strings.StopStringMatcher.feed
    monkeypatch.setattr(stop_strings.StopStringMatcher, "feed", lambda self, text: fed.append(len(text)) or
                        feed(self, text))
    stops = [chr(0x4E00 + k) * MAX_STOP_STRING_CHARS for k in range(MAX_STOP_STRINGS)]  # never generated
    body, _ = beside_a_stream(server, {"model": "tiny", "prompt": "Hello world", "max_tokens": 48,
                                       "ignore_eos": True, "temperature": 0, "stop": stops})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert sum(fed) == len(choice["text"]) and len(fed) <= 48  # each character read once, per token
    assert server._thread not in request_threads


def test_full_vocabulary_logit_bias_is_built_once(server, request_threads, monkeypatch):
    reads = []
    get = LogitBias.__getitem__
    monkeypatch.setattr(LogitBias, "__getitem__", lambda self, token: reads.append(token) or get(self, token))
    vocab = server.engine.spec.vocab_size
    bias = {str(t): round(random.Random(t).uniform(-2, 2), 3) for t in range(vocab)}
    body, _ = beside_a_stream(server, {"model": "tiny", "prompt": "Paris is", "max_tokens": 32, "n": 4,
                                       "ignore_eos": True, "temperature": 0, "logit_bias": bias})
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 4
    assert len(reads) == vocab  # one dense row for the request's 4 samples and 32 steps
    assert server._thread not in request_threads
