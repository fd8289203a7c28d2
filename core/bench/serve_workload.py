"""What `bench serve` sends: text prompts with their output lengths, and when each is sent.

Prompts are text, not token ids, because an HTTP server tokenizes for itself (and every server
does it its own way); the benchmark's tokenizer only makes text of a given length and counts
tokens where a server reports no `usage`. Three workloads:

- random: each prompt is `input_len` token ids drawn uniformly from the tokenizer's ordinary
  (non-special) vocabulary, decoded to text, re-encoded and cut to `input_len`, decoded again
  (as `vllm bench serve --dataset-name random` does, so the text re-tokenizes to about its length);
  lengths vary uniformly by +- `range_ratio`;
- shared-prefix: `num_prefixes` random prefixes of `prefix_len` tokens, each prompt one of them
  (round robin) followed by its own random `input_len` tokens: what the prefix cache is for;
- sharegpt: the first human turn of each conversation of a ShareGPT-format JSON file, its
  output length the tokens of the reply that followed (or `output_len` when given).

Everything is drawn from `numpy.random.default_rng([seed, level])`: the same seed gives the same
text and the same arrival schedule against every server, and each level of a sweep its own
prompts (so one level's prompts are not in the prefix cache when the next starts).

Open-loop arrivals (`arrival_offsets`): the gaps between requests are gamma-distributed with
shape `burstiness` and mean 1 / rate (vLLM's convention), so burstiness 1 is a Poisson process
(exponential gaps); below 1 the requests come in bursts (coefficient of variation 1/sqrt(burstiness)),
above 1 more evenly. Rate inf sends every request at once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deepinfer.core.errors import InvalidRequestError

WORKLOAD_KINDS = ("random", "shared-prefix", "sharegpt")
# ShareGPT conversations kept (vLLM's filter): both sides at least this many tokens, together at most
# the context limit given; shorter ones measure nothing, longer ones would be refused by small models.
SHAREGPT_MIN_TOKENS = 4


@dataclass(frozen=True)
class BenchPrompt:
    """One request's input: the text sent, its length by the benchmark's tokenizer, the tokens asked for."""

    text: str
    prompt_len: int
    output_len: int


@dataclass
class ServeWorkload:
    kind: str = "random"
    input_len: int = 512
    output_len: int | None = 128  # sharegpt: None = each reply's own length
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 1
    dataset_path: str | None = None
    max_sharegpt_len: int = 2048  # prompt + reply tokens of a ShareGPT conversation kept
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.kind in WORKLOAD_KINDS, f"--dataset must be one of {', '.join(WORKLOAD_KINDS)}, got {self.kind!r}"),
            (self.input_len >= 1, f"--input-len must be >= 1, got {self.input_len}"),
            (self.output_len is None or self.output_len >= 1, f"--output-len must be >= 1, got {self.output_len}"),
            (0.0 <= self.range_ratio < 1.0, f"--range-ratio must be in [0, 1), got {self.range_ratio}"),
            (self.kind != "shared-prefix" or self.prefix_len >= 1,
             f"--dataset shared-prefix needs --prefix-len >= 1, got {self.prefix_len}"),
            (self.num_prefixes >= 1, f"--num-prefixes must be >= 1, got {self.num_prefixes}"),
            (self.kind != "sharegpt" or self.dataset_path is not None, "--dataset sharegpt needs --dataset-path"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    def describe(self) -> str:
        if self.kind == "sharegpt":
            out = "reply lengths" if self.output_len is None else f"output {self.output_len}"
            return f"ShareGPT {Path(self.dataset_path).name}, {out}"
        text = f"random input {self.input_len}, output {self.output_len}"
        if self.range_ratio:
            text += f" (+-{self.range_ratio:.0%})"
        if self.kind == "shared-prefix":
            text += f", shared prefix {self.prefix_len} x {self.num_prefixes}"
        return text


class PromptMaker:
    """Makes a workload's prompts with one tokenizer (a core.tokenizer.Tokenizer or anything with
    `encode(text, add_special_tokens)`, `decode(ids)` and `hf_tokenizer.all_special_ids`)."""

    def __init__(self, workload: ServeWorkload, tokenizer) -> None:
        self.workload = workload
        self.tokenizer = tokenizer
        special = set(getattr(getattr(tokenizer, "hf_tokenizer", None), "all_special_ids", None) or [])
        # ids of [0, vocab); special tokens would make the server stop early or render as markup
        self._ordinary = np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)
        if len(self._ordinary) < 2:
            raise InvalidRequestError("the tokenizer has fewer than 2 ordinary tokens to draw prompts from")
        self._conversations = _sharegpt_pairs(workload, tokenizer) if workload.kind == "sharegpt" else None

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def random_text(self, rng: np.random.Generator, length: int) -> str:
        """Text of about `length` tokens: drawn ids, decoded, re-encoded, cut to `length`, decoded."""
        ids = rng.choice(self._ordinary, size=length).tolist()
        ids = self.tokenizer.encode(self.tokenizer.decode(ids), add_special_tokens=False)[:length]
        return self.tokenizer.decode(ids)

    def prompts(self, num_prompts: int, level: int) -> list[BenchPrompt]:
        """`num_prompts` prompts for level `level` of a sweep (the same for every server)."""
        workload = self.workload
        rng = np.random.default_rng([workload.seed, level])
        if workload.kind == "sharegpt":
            order = rng.permutation(len(self._conversations))
            chosen = [self._conversations[order[k % len(order)]] for k in range(num_prompts)]
            return [BenchPrompt(text, prompt_len, workload.output_len or reply_len)
                    for text, prompt_len, reply_len in chosen]
        prefixes = [self.random_text(rng, workload.prefix_len) for _ in range(workload.num_prefixes)] \
            if workload.kind == "shared-prefix" else [""]
        prompts = []
        for k in range(num_prompts):
            input_len = _vary(rng, workload.input_len, workload.range_ratio)
            output_len = _vary(rng, workload.output_len, workload.range_ratio)
            text = prefixes[k % len(prefixes)] + self.random_text(rng, input_len)
            prompts.append(BenchPrompt(text, self.count(text), output_len))
        return prompts


def _vary(rng: np.random.Generator, length: int, ratio: float) -> int:
    """A length drawn uniformly from [length (1 - ratio), length (1 + ratio)], at least 1."""
    if ratio == 0:
        return length
    low, high = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    return int(rng.integers(low, high + 1))


def _sharegpt_pairs(workload: ServeWorkload, tokenizer) -> list[tuple[str, int, int]]:
    """(first human turn, its tokens, the reply's tokens) of each usable conversation, in file order."""
    path = Path(workload.dataset_path)
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise InvalidRequestError(f"--dataset-path: cannot read {path}: {err}") from None
    if not isinstance(entries, list):
        raise InvalidRequestError(f"--dataset-path: {path} is not a ShareGPT list of conversations")
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        question, reply = turns[0], turns[1]
        if not (isinstance(question, dict) and isinstance(reply, dict) and question.get("from") == "human"
                and isinstance(question.get("value"), str) and isinstance(reply.get("value"), str)):
            continue
        prompt_len = len(tokenizer.encode(question["value"], add_special_tokens=False))
        reply_len = len(tokenizer.encode(reply["value"], add_special_tokens=False))
        output_len = workload.output_len or reply_len
        if (prompt_len >= SHAREGPT_MIN_TOKENS and output_len >= SHAREGPT_MIN_TOKENS
                and prompt_len + output_len <= workload.max_sharegpt_len):
            pairs.append((question["value"], prompt_len, reply_len))
    if not pairs:
        raise InvalidRequestError(
            f"--dataset-path: {path} has no usable conversation (a human turn then a reply, each at least "
            f"{SHAREGPT_MIN_TOKENS} tokens, together at most {workload.max_sharegpt_len})")
    return pairs


def arrival_offsets(num_requests: int, rate: float, burstiness: float, seed: int | list[int]) -> list[float]:
    """Send times in seconds from the level's start: 0 for the first, then gamma(burstiness) gaps of
    mean 1 / rate; all zeros for rate inf."""
    if num_requests < 1:
        raise InvalidRequestError(f"number of requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise InvalidRequestError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise InvalidRequestError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def load_tokenizer(spec: str):
    """A core.tokenizer.Tokenizer from a GGUF file, a model or tokenizer directory, or a Hub id
    (only the Hub repo's tokenizer files are fetched)."""
    from deepinfer.core.errors import ModelLoadError
    from deepinfer.core.tokenizer import Tokenizer
    from deepinfer.core.weights.hub import parse_hub_id

    path = Path(spec).expanduser()
    if path.is_file():
        return Tokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if path.is_dir():
        return Tokenizer.from_pretrained(path)
    ref = parse_hub_id(spec)
    if ref is None:
        raise ModelLoadError(f"tokenizer {spec!r} is neither a file, a directory nor a Hugging Face id")
    from transformers import AutoTokenizer

    try:
        return Tokenizer(AutoTokenizer.from_pretrained(ref.repo_id), where=spec)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for an absent or broken tokenizer
        raise ModelLoadError(f"cannot load the tokenizer {spec!r}: {type(err).__name__}: {err}") from None
