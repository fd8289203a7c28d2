"""`bench serve`: one workload against one or more OpenAI-compatible servers over HTTP, level by level.

A level is either closed-loop (`concurrency` c: c clients, each sending its next request when its
previous one ends, so c are in flight until the level's prompts run out) or open-loop (`request_rate`
r: requests sent on an arrival schedule whatever the server's state, at most `max_concurrency` in
flight when given). Every server sees the same prompts and the same schedule at a level, one server
after the other (so they never share the machine's client or the GPU), each after one untimed
warm-up request.

Metrics (all from the client's side; percentiles as core/bench/latency.py computes them):
  TTFT  request sent -> first chunk that carries output text.
  TPOT  (E2E - TTFT) / (output tokens - 1), per request (vllm bench serve's definition).
  ITL   the gaps between consecutive output chunks (a server that packs several tokens in one chunk
        shows fewer, longer gaps: vllm bench serve's definition).
  E2E   request sent -> end of the stream.
  Output tokens are the server's `usage.completion_tokens`, prompt tokens its `usage.prompt_tokens`;
  where a server reports no usage, the benchmark's tokenizer counts the text (the JSON says which).
  Throughput divides the tokens of the successful requests by the level's wall time (first send ->
  last end). Goodput is the successful requests per second that met every SLO given.
A failed request (an HTTP error, a stall, a cut stream; core/bench/serve_client.py) counts under its
error kind and is left out of the latency percentiles.

Interrupted (Ctrl-C), the run keeps the levels done and the finished requests of the level under
way (marked partial) and says it was interrupted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import pairwise

import aiohttp

from deepinfer.core.bench.latency import percentiles
from deepinfer.core.bench.progress import SweepProgress
from deepinfer.core.bench.serve_client import RequestRecord, RequestSettings, list_models, stream_request
from deepinfer.core.bench.serve_workload import BenchPrompt, PromptMaker, arrival_offsets
from deepinfer.core.bench.workload import default_num_requests, per_level_counts_ok
from deepinfer.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

SLO_METRICS = ("ttft", "tpot", "e2e")  # goodput keys, milliseconds
WARMUP_LEVEL = 2**31 - 1  # the prompt seed's level number of the warm-up requests


@dataclass
class ServeTarget:
    """A server to benchmark; `model` None = the first entry of its /v1/models."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    started_by: str | None = None  # the `deepinfer serve` command when --serve started it
    models: dict | None = None  # its /v1/models answer, once asked (resolve_targets)

    def headers(self) -> dict | None:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None


@dataclass
class ServeSweep:
    """The levels and how they are run."""

    concurrency_levels: list[int] | None = None
    request_rates: list[float] | None = None
    burstiness: float = 1.0
    # per level: one count for every level, or one per level (in the order run); None = default_num_prompts
    num_prompts: int | list[int] | None = None
    max_concurrency: int | None = None  # open loop: requests in flight at most
    goodput_slo_ms: dict[str, float] = field(default_factory=dict)
    warmup_requests: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency_levels is None) == (self.request_rates is None):
            raise InvalidRequestError("give either --concurrency or --request-rate")
        checks = [
            (all(c >= 1 for c in self.concurrency_levels or [1]), f"--concurrency must be >= 1, got {self.concurrency_levels}"),
            (all(r > 0 for r in self.request_rates or [1]), f"--request-rate must be > 0 (or inf), got {self.request_rates}"),
            (self.burstiness > 0 and math.isfinite(self.burstiness), f"--burstiness must be > 0, got {self.burstiness}"),
            (per_level_counts_ok(self.num_prompts, len(self.concurrency_levels or self.request_rates or [])),
             f"--num-prompts takes one count >= 1, or one per level, got {self.num_prompts}"),
            (self.max_concurrency is None or self.max_concurrency >= 1,
             f"--max-concurrency must be >= 1, got {self.max_concurrency}"),
            (self.warmup_requests >= 0, f"--warmup must be >= 0, got {self.warmup_requests}"),
            (all(k in SLO_METRICS and v > 0 for k, v in self.goodput_slo_ms.items()),
             f"--goodput takes {'|'.join(SLO_METRICS)}:MS with MS > 0, got {self.goodput_slo_ms}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    def levels(self) -> list[dict]:
        """[{"concurrency": c} | {"request_rate": r}] in the order run."""
        if self.concurrency_levels is not None:
            return [{"concurrency": c} for c in self.concurrency_levels]
        return [{"request_rate": r} for r in self.request_rates]

    def prompts_at(self, level: dict) -> int:
        if isinstance(self.num_prompts, list):
            return self.num_prompts[self.levels().index(level)]
        return self.num_prompts if self.num_prompts is not None else default_num_prompts(level)


def default_num_prompts(level: dict) -> int:
    """Closed loop: as many requests as `bench concurrency` sends at that concurrency, so the two
    measure the same workload (over HTTP and in-process); open loop: 100 arrivals."""
    return default_num_requests(level["concurrency"]) if "concurrency" in level else 100


def level_label(level: dict) -> str:
    if "concurrency" in level:
        return f"c={level['concurrency']}"
    rate = level["request_rate"]
    return "rate=inf" if math.isinf(rate) else f"rate={rate:g}/s"


@dataclass
class _LevelRun:
    """A level under way: its records fill in as requests end (kept when the run is interrupted)."""

    level: dict
    num_prompts: int
    started_s: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    # The benchmark process's CPU seconds (all its threads) over the level: a client near one second a
    # second is itself the bottleneck, and its timings then measure it as much as the server.
    cpu_started_s: float = 0.0
    cpu_s: float | None = None


class TokenCounter:
    """Token counts of a record: the server's usage, else the benchmark's tokenizer on the text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def output_tokens(self, record: RequestRecord) -> tuple[int, str]:
        if record.usage_completion_tokens is not None:
            return record.usage_completion_tokens, "usage"
        return len(self.tokenizer.encode(record.text, add_special_tokens=False)), "tokenizer"

    def prompt_tokens(self, record: RequestRecord) -> int:
        return record.usage_prompt_tokens if record.usage_prompt_tokens is not None else record.prompt_len


def _good(metrics: dict, slo_ms: dict[str, float]) -> bool:
    """Every SLO met; a one-token answer has no TPOT, which then cannot miss its SLO."""
    return all(metrics[name] <= limit if metrics[name] is not None else name == "tpot"
               for name, limit in slo_ms.items())


def summarize_level(run: _LevelRun, counter: TokenCounter, slo_ms: dict[str, float], ended_s: float) -> dict:
    """Throughput, latency percentiles (ms), errors and goodput of one level's finished requests."""
    records = sorted(run.records, key=lambda r: r.index)
    done = [r for r in records if r.ok]
    wall_s = max(ended_s - run.started_s, 0.0) if records else 0.0
    rows, ttft, tpot, itl, e2e = [], [], [], [], []
    output_tokens = prompt_tokens = good = 0
    sources: Counter = Counter()
    for record in records:
        tokens, source = counter.output_tokens(record)
        metrics = {"ttft": None, "tpot": None, "e2e": None}
        if record.ok:
            sources[source] += 1
            output_tokens += tokens
            prompt_tokens += counter.prompt_tokens(record)
            metrics["e2e"] = record.e2e_s * 1000.0
            e2e.append(metrics["e2e"])
            if record.ttft_s is not None:
                metrics["ttft"] = record.ttft_s * 1000.0
                ttft.append(metrics["ttft"])
            if tokens > 1 and record.ttft_s is not None:
                metrics["tpot"] = (record.e2e_s - record.ttft_s) * 1000.0 / (tokens - 1)
                tpot.append(metrics["tpot"])
            itl.extend((b - a) * 1000.0 for a, b in pairwise(record.chunk_times_s))
            good += _good(metrics, slo_ms)
        rows.append({"index": record.index, "prompt_len": record.prompt_len,
                     "requested_output_len": record.requested_output_len,
                     "prompt_tokens": counter.prompt_tokens(record), "output_tokens": tokens,
                     "token_source": source, "num_chunks": len(record.chunk_times_s),
                     "ttft_ms": metrics["ttft"], "tpot_ms": metrics["tpot"], "e2e_ms": metrics["e2e"],
                     "status": record.status, "error_kind": record.error_kind, "error": record.error})

    def per_s(value: float) -> float | None:
        return value / wall_s if wall_s > 0 else None

    return {
        **run.level,
        "num_prompts": run.num_prompts,
        "num_sent": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "errors": dict(Counter(r.error_kind for r in records if not r.ok)),
        "partial": len(records) < run.num_prompts,
        "wall_s": wall_s,
        "client_cpu_s": run.cpu_s,  # None for a level that never started
        "client_cpu_per_wall": None if run.cpu_s is None else per_s(run.cpu_s),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "token_sources": dict(sources),
        "output_tokens_per_s": per_s(output_tokens),
        "total_tokens_per_s": per_s(output_tokens + prompt_tokens),
        "requests_per_s": per_s(len(done)),
        "goodput": None if not slo_ms else {"slo_ms": slo_ms, "good_requests": good,
                                            "requests_per_s": per_s(good),
                                            "fraction": good / len(records) if records else None},
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles(e2e),
        "requests": rows,
    }


async def _send(session, target: ServeTarget, model: str, settings: RequestSettings, prompt: BenchPrompt,
                index: int, run: _LevelRun | None, progress: SweepProgress, counter: TokenCounter) -> RequestRecord:
    record = RequestRecord(index, prompt.prompt_len, prompt.output_len)
    await stream_request(session, target.base_url, model, settings, record, prompt.text, target.headers())
    if run is not None:
        run.records.append(record)
        progress.advance(requests=1, tokens=counter.output_tokens(record)[0] if record.ok else 0)
    return record


async def _run_level(session, target: ServeTarget, model: str, settings: RequestSettings, sweep: ServeSweep,
                     prompts: list[BenchPrompt], run: _LevelRun, schedule: list[float] | None,
                     progress: SweepProgress, counter: TokenCounter) -> None:
    run.started_s, run.cpu_started_s = time.perf_counter(), time.process_time()
    try:
        await _run_requests(session, target, model, settings, sweep, prompts, run, schedule, progress, counter)
    finally:
        run.cpu_s = time.process_time() - run.cpu_started_s


async def _run_requests(session, target: ServeTarget, model: str, settings: RequestSettings, sweep: ServeSweep,
                        prompts: list[BenchPrompt], run: _LevelRun, schedule: list[float] | None,
                        progress: SweepProgress, counter: TokenCounter) -> None:
    if schedule is None:  # closed loop
        next_index = iter(range(len(prompts)))

        async def client() -> None:
            for i in next_index:  # the shared iterator hands each prompt to exactly one client
                await _send(session, target, model, settings, prompts[i], i, run, progress, counter)

        await asyncio.gather(*(client() for _ in range(run.level["concurrency"])))
        return
    limit = asyncio.Semaphore(sweep.max_concurrency) if sweep.max_concurrency else None

    async def arrive(i: int) -> None:
        await asyncio.sleep(max(0.0, run.started_s + schedule[i] - time.perf_counter()))
        if limit is None:
            await _send(session, target, model, settings, prompts[i], i, run, progress, counter)
            return
        async with limit:
            await _send(session, target, model, settings, prompts[i], i, run, progress, counter)

    await asyncio.gather(*(arrive(i) for i in range(len(prompts))))


def resolve_targets(targets: list[ServeTarget]) -> None:
    """Ask every server for its models before anything is measured (an unreachable one fails here, not
    after the others' sweeps); fills each target's `model` (when None) and `models`."""
    async def resolve_all() -> None:
        async with aiohttp.ClientSession() as session:
            for target in targets:
                target.model, target.models = await resolve_model(session, target)

    asyncio.run(resolve_all())


async def resolve_model(session, target: ServeTarget) -> tuple[str, dict]:
    """The model name to send and the server's /v1/models answer."""
    try:
        models = await list_models(session, target.base_url, target.headers())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        if target.model is None:
            raise InvalidRequestError(f"{target.base_url}: cannot list the models to pick one "
                                      f"(pass --model): {err or type(err).__name__}") from None
        return target.model, {"error": str(err) or type(err).__name__}
    if target.model is not None:
        return target.model, models
    ids = [entry.get("id") for entry in models["data"] if isinstance(entry, dict)]
    if not ids or not isinstance(ids[0], str):
        raise InvalidRequestError(f"{target.base_url}: /v1/models lists no model; pass --model")
    return ids[0], models


async def _target_sweep(target: ServeTarget, settings: RequestSettings, sweep: ServeSweep,
                        level_prompts: list[list[BenchPrompt]], warmup_prompts: list[BenchPrompt], info: dict,
                        progress: SweepProgress,
                        counter: TokenCounter, current: list) -> None:
    """Fills `info` and appends each finished level to info["levels"]; `current[0]` is the level under way."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)  # no pool cap: the levels set the load
    async with aiohttp.ClientSession(connector=connector) as session:
        if target.model is None or target.models is None:
            target.model, target.models = await resolve_model(session, target)
        model = target.model
        info.update(model=model, models=target.models)
        for k, prompt in enumerate(warmup_prompts):
            progress.level_started(f"warm-up {target.base_url}", 1)
            warm = await _send(session, target, model, settings, prompt, -1 - k, None, progress, counter)
            if not warm.ok:
                raise InvalidRequestError(f"{target.base_url} failed the warm-up request: {warm.error}")
        for number, (level, prompts) in enumerate(zip(sweep.levels(), level_prompts, strict=True)):
            schedule = None if "concurrency" in level else arrival_offsets(
                len(prompts), level["request_rate"], sweep.burstiness, [sweep.seed, number, 1])
            run = _LevelRun(level, len(prompts))
            current[0] = run
            progress.level_started(f"{level_label(level)}", len(prompts))
            await _run_level(session, target, model, settings, sweep, prompts, run, schedule, progress, counter)
            current[0] = None
            summary = summarize_level(run, counter, sweep.goodput_slo_ms, _last_end(run))
            info["levels"].append(summary)
            progress.level_finished(f"{target.base_url} " + level_line(summary))


def _last_end(run: _LevelRun) -> float:
    ends = [r.done_s for r in run.records if r.done_s is not None]
    return max(ends) if ends else run.started_s


def level_line(summary: dict) -> str:
    """One finished level in a line, printed while the sweep goes on."""
    def p50(name: str) -> str:
        value = summary[name]["p50"]
        return "-" if value is None else f"{value:.1f}"

    out = summary["output_tokens_per_s"]
    errors = ", ".join(f"{k} {v}" for k, v in summary["errors"].items())
    return (f"{level_label(summary)}: {'-' if out is None else f'{out:.1f}'} out tok/s, "
            f"{summary['num_completed']}/{summary['num_prompts']} ok{f' ({errors})' if errors else ''}, "
            f"TTFT p50 {p50('ttft_ms')} ms, TPOT p50 {p50('tpot_ms')} ms")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_targets(targets: list[dict]) -> list[dict]:
    """Per level and per server after the first: its figures over the first server's."""
    if len(targets) < 2:
        return []
    rows = []
    base_levels = targets[0]["levels"]
    for other in targets[1:]:
        for base, level in zip(base_levels, other["levels"], strict=False):
            rows.append({
                "base_url": other["base_url"], "model": other.get("model"), "level": level_label(level),
                "output_tokens_per_s_ratio": _ratio(level["output_tokens_per_s"], base["output_tokens_per_s"]),
                "requests_per_s_ratio": _ratio(level["requests_per_s"], base["requests_per_s"]),
                "ttft_p50_ratio": _ratio(level["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                "tpot_p50_ratio": _ratio(level["tpot_ms"]["p50"], base["tpot_ms"]["p50"]),
                "e2e_p50_ratio": _ratio(level["e2e_ms"]["p50"], base["e2e_ms"]["p50"]),
                "goodput_ratio": _ratio((level["goodput"] or {}).get("requests_per_s"),
                                        (base["goodput"] or {}).get("requests_per_s")),
            })
    return rows


FD_RESERVE = 64  # descriptors beyond the connections: the tokenizer's files, logs, the results file


def fit_open_file_limit(connections: int) -> None:
    """Raise the soft open-file limit toward the hard one so `connections` sockets fit (1024 is a
    common default, below what rate inf with 1000 prompts opens at once); a lower hard limit leaves
    the excess requests to fail as `connect` errors, which the report shows."""
    try:
        import resource
    except ImportError:  # not a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            logger.warning("cannot raise the open-file limit to %d; requests beyond it will fail", wanted)


def max_in_flight(sweep: ServeSweep) -> int:
    """The most requests any level has in flight at once."""
    return max(level.get("concurrency") or min(sweep.max_concurrency or math.inf, sweep.prompts_at(level))
               for level in sweep.levels())


def run_serve_benchmark(targets: list[ServeTarget], settings: RequestSettings, sweep: ServeSweep,
                        maker: PromptMaker, progress: SweepProgress | None = None) -> dict:
    """Every level against every target in turn; the JSON payload without the environment block.

    A server that cannot be measured (no model list without --model, a failed warm-up) is skipped
    with its "error" when there are others. Interrupted (Ctrl-C, `timeout -s INT`), it returns what
    finished, marked "interrupted".
    """
    progress = progress or SweepProgress()
    fit_open_file_limit(max_in_flight(sweep))
    counter = TokenCounter(maker.tokenizer)
    levels = sweep.levels()
    progress.level_started("making prompts", len(levels))
    level_prompts = []
    for number, level in enumerate(levels):
        level_prompts.append(maker.prompts(sweep.prompts_at(level), number))
        progress.advance(requests=1)
    # prompts of their own: a warm-up prompt in the prefix cache would speed up a measured request
    warmup_prompts = maker.prompts(sweep.warmup_requests, WARMUP_LEVEL) if sweep.warmup_requests else []
    results: list[dict] = []
    interrupted = False
    current: list = [None]
    try:
        for target in targets:
            info = {"base_url": target.base_url, "model": target.model, "started_by": target.started_by,
                    "levels": []}
            results.append(info)
            try:
                asyncio.run(_target_sweep(target, settings, sweep, level_prompts, warmup_prompts, info, progress,
                                          counter, current))
            except InvalidRequestError as err:  # this server cannot be measured; the others still are
                if len(targets) == 1:
                    raise
                info["error"] = str(err)
                logger.warning("%s", err)
    except KeyboardInterrupt:
        interrupted = True
        run = current[0]
        if run is not None and run.records:
            results[-1]["levels"].append(summarize_level(run, counter, sweep.goodput_slo_ms, _last_end(run)))
        logger.warning("interrupted: keeping the levels and requests finished so far")
    return {
        "benchmark": "serve",
        "endpoint": settings.endpoint,
        "request_settings": asdict(settings),
        "workload": asdict(maker.workload),
        "sweep": asdict(sweep),
        "targets": results,
        "comparison": compare_targets(results),
        "interrupted": interrupted,
    }
