"""Per-request timing records and the latency statistics every benchmark reports.

Definitions (the same for the engine and its HF peer, all from the client's point of view):
  TTFT  time to first token: request sent -> first output token received.
  TPOT  time per output token of one request: (last token - first token) / (output tokens - 1).
  ITL   inter-token latency: the gap between consecutive output tokens of one request. When one
        delivery carries n tokens (the client fell behind the engine), its gap is split evenly
        over the n tokens, so the ITLs of a request always sum to last - first token.
Percentiles use pandas' linear interpolation (numpy's default); repeats are summarized as
mean ± sample std, as llama-bench does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import pandas as pd

PERCENTILES = (50, 95, 99)


@dataclass
class RequestTiming:
    """What one client saw of one request. Times are time.perf_counter() seconds."""

    request_id: str
    prompt_len: int
    sent_s: float  # when the client handed the request to the engine
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (received at, new tokens)
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    error: str | None = None

    def record(self, received_s: float, num_new_tokens: int) -> None:
        if num_new_tokens > 0:
            self.deliveries.append((received_s, num_new_tokens))

    @property
    def output_len(self) -> int:
        return sum(n for _, n in self.deliveries)

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_len > 0

    @property
    def first_token_s(self) -> float | None:
        return self.deliveries[0][0] if self.deliveries else None

    @property
    def last_token_s(self) -> float | None:
        return self.deliveries[-1][0] if self.deliveries else None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.output_len - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.last_token_s is None else self.last_token_s - self.sent_s

    def token_times_s(self) -> list[float]:
        """Receive time of every output token, the gap of a multi-token delivery split evenly."""
        times: list[float] = []
        previous = None
        for received, n in self.deliveries:
            if previous is None:
                # Tokens of the first delivery all arrived at once: the first is the TTFT token.
                times.extend([received] * n)
            else:
                step = (received - previous) / n
                times.extend(previous + step * (k + 1) for k in range(n))
            previous = received
        return times

    def itls_s(self) -> list[float]:
        times = self.token_times_s()
        return [b - a for a, b in pairwise(times)]


def percentiles(values: list[float], qs: tuple[int, ...] = PERCENTILES) -> dict[str, float | None]:
    """{'p50': ..., 'p95': ..., 'p99': ..., 'mean': ..., 'max': ...}; None for each when empty."""
    keys = [f"p{q}" for q in qs] + ["mean", "max"]
    if not values:
        return dict.fromkeys(keys)
    series = pd.Series(values, dtype="float64")
    result = {f"p{q}": float(series.quantile(q / 100)) for q in qs}
    result["mean"] = float(series.mean())
    result["max"] = float(series.max())
    return result


def _ms(values: list[float]) -> list[float]:
    return [v * 1000.0 for v in values]


def summarize_requests(timings: list[RequestTiming], wall_s: float) -> dict:
    """Throughput and TTFT / TPOT / ITL / end-to-end percentiles (milliseconds) of one run."""
    done = [t for t in timings if t.ok]
    output_tokens = sum(t.output_len for t in done)
    return {
        "num_requests": len(timings),
        "num_failed": len(timings) - len(done),
        "prompt_tokens": sum(t.prompt_len for t in done),
        "cached_prompt_tokens": sum(t.num_cached_tokens for t in done),
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(done) / wall_s if wall_s > 0 else None,
        "ttft_ms": percentiles(_ms([t.ttft_s for t in done])),
        "tpot_ms": percentiles(_ms([t.tpot_s for t in done if t.tpot_s is not None])),
        "itl_ms": percentiles(_ms([itl for t in done for itl in t.itls_s()])),
        "e2e_ms": percentiles(_ms([t.e2e_s for t in done])),
    }


def requests_frame(timings: list[RequestTiming]) -> pd.DataFrame:
    """One row per request (for the JSON's per-request records and ad-hoc grouping)."""
    rows = [{
        "request_id": t.request_id,
        "prompt_len": t.prompt_len,
        "output_len": t.output_len,
        "cached_prompt_tokens": t.num_cached_tokens,
        "ttft_ms": None if t.ttft_s is None else t.ttft_s * 1000.0,
        "tpot_ms": None if t.tpot_s is None else t.tpot_s * 1000.0,
        "e2e_ms": None if t.e2e_s is None else t.e2e_s * 1000.0,
        "error": t.error,
    } for t in timings]
    return pd.DataFrame(rows)


def flatten(summary: dict, prefix: str = "") -> dict[str, float | int | None]:
    """{'ttft_ms': {'p50': 1.0}} -> {'ttft_ms.p50': 1.0}; keeps numeric and None leaves only."""
    flat: dict[str, float | int | None] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            flat[name] = value
    return flat


def mean_std(runs: list[dict]) -> dict[str, dict[str, float | None]]:
    """Each numeric field over repeated runs -> {'mean': m, 'std': s}; std is None for one run."""
    frame = pd.DataFrame([flatten(run) for run in runs], dtype="float64")
    result = {}
    for column in frame.columns:
        values = frame[column].dropna()
        mean = float(values.mean()) if len(values) else None
        std = float(values.std(ddof=1)) if len(values) > 1 else None
        result[column] = {"mean": mean, "std": std}
    return result
