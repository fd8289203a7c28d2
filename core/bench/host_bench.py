"""The host's share of an engine step: what the engine loop costs in CPU time per step and per running
sequence, and where it goes, without a GPU.

The real engine (LLMEngine.step: scheduler, KV manager, prefix cache, step stager, sampler bookkeeping,
output processor, detokenizer) runs over a model stand-in whose forward costs nothing: the padded
step runner's graph replay returns a preallocated logits buffer, the eager path's model returns
preallocated hidden rows, and the sampler hands out the next ids of a fixed random token stream, so
everything the host does around the forward runs as it does on a GPU (decode steps take the padded
path, as CUDA graphs do there). `--forward model` runs the same measurement inside the real engine
(a GPU, CUDA graphs, the real sampler): the phases then include the forward's launch and the wait
for the device.

Workloads, per number of running sequences N:
- decode: N sequences of `prompt_len` random prompt tokens are prefilled, then every timed step is
  a decode step of the N of them;
- mixed: the same N streams decode while a long prompt (`long_prompt_len` random tokens, one output
  token) is chunked beside them in every step; two long prompts are always queued, so each timed
  step fills the token budget.

Per timed step the engine loop's CPU time (time.thread_time of the thread calling `step()`) and wall
time are taken. Phases are spans around the components' own methods, put in by this harness only
(instance attributes, or class attributes restored afterwards), timed by the thread's CPU clock (wall
spans on a shared machine would take in the time other processes ran): in the timed pass around
the front end and the forward only, in a second pass of as many steps around every phase, per-request
and per-token calls (KV slot allocation, detokenization) included, whose clock reads (about a
microsecond each) add to what they measure; the phase table comes from that pass.

`core` is the engine core's work: the whole step less the front end (output processing: detokenizing,
stop strings, snapshots) and the forward, the median over the timed steps (as are the front end's and
the forward's figures), from the cheapest of `repeats` timed passes. `core_less_gpu_wait` is the core less
the host's waits for the device (`gpu_wait`: every CUDA event synchronize, which spins on the CPU; none on
the stand-in): the figure the core's budget per step and per sequence is set on. `fit` is a least-squares
line of the core's CPU µs per step over N (and one of `core_less_gpu_wait`'s): its slope
is the cost per running sequence, its intercept the fixed cost per step.

A last untimed pass of a few steps counts the torch calls the host issues per step outside the forward
(core/bench/torch_ops.py: device work, copies each way, views, CUDA event records and waits), by phase:
on a GPU each costs the host microseconds whatever its size, so they make the step's fixed cost.

On a CUDA device (`--forward model`) the timed passes also take the device time of the same steps
(core/bench/step_gpu_time.py: CUDA events on the engine's stream around each launch, read after the
pass, nothing synchronized inside a step) and report the step's wall time over it (`wall_over_gpu`;
1.0: the host is hidden behind the device). Without one (the stand-in) both are None.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from deepinfer.core.bench.step_gpu_time import cuda_step_timer
from deepinfer.core.bench.torch_ops import TorchOpCounter
from deepinfer.core.bench.torch_ops import per_step as torch_ops_per_step
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend import detokenizer as detokenizer_module
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.worker import inflight as inflight_module
from deepinfer.core.engine.worker.sampler import SamplerOutput
from deepinfer.core.engine.worker.transfers import HostCopy
from deepinfer.core.errors import InvalidRequestError
from deepinfer.core.kv.kv_manager import cdiv
from deepinfer.core.models.loader import LoadedModel, dummy_tokenizer
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.tokenizer import ByteTokenizer

MODES = ("decode", "mixed")
STAND_IN_VOCAB_SIZE = 49152  # the default model's, so its tokenizer fits
FORWARDS = ("stand-in", "model")
# Exclusive phases of a step, in the order a step runs them; they add up to the step.
PHASES = ("schedule", "kv_slots", "staging", "forward", "sampling", "launch_other", "collect", "gpu_wait", "update",
          "output", "detokenize", "other")
FRONT_END_PHASES = ("output", "detokenize")
COUNTED_STEPS = 8  # steps of the pass that counts torch calls, after the timed ones
# A character the bench's stop string is made of and no token of its token pool decodes to, so the stop
# string is checked on every token and never found.
_STOP_CHAR = "\x07"


@dataclass
class HostWorkload:
    num_seqs: list[int] = field(default_factory=lambda: [1, 32, 64, 128, 256, 512])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    steps: int = 64  # timed steps per point, per repeat (and as many again for the phase pass)
    repeats: int = 3  # timed passes per point; the one with the cheapest core is kept
    warmup_steps: int = 8  # untimed steps after the prompts are in
    prompt_len: int = 128
    long_prompt_len: int = 8192  # mixed mode's chunked prompt
    stop_string: bool = True  # every request has a stop string (checked on every token, never found)
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (bool(self.num_seqs) and all(n >= 1 for n in self.num_seqs),
             f"--num-seqs must be >= 1 each, got {self.num_seqs}"),
            (bool(self.modes) and all(m in MODES for m in self.modes),
             f"--modes takes {', '.join(MODES)}, got {self.modes}"),
            (self.steps >= 1, f"--steps must be >= 1, got {self.steps}"),
            (self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}"),
            (self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}"),
            (self.prompt_len >= 1, f"--prompt-len must be >= 1, got {self.prompt_len}"),
            (self.long_prompt_len >= 2, f"--long-prompt-len must be >= 2, got {self.long_prompt_len}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    def max_output_tokens(self, num_seqs: int, token_budget: int) -> int:
        """Output tokens a stream of a point can reach: its prefill steps, the warm-up and every pass."""
        prefill_steps = cdiv(num_seqs * self.prompt_len, max(1, token_budget - num_seqs)) + 2
        return prefill_steps + self.warmup_steps + (self.repeats + 1) * self.steps + COUNTED_STEPS + 8


# The stand-in. ------------------------------------------------------------------------------------------


class StandInModel(torch.nn.Module):
    """A decoder whose forward costs nothing: hidden rows [T, 1] from a preallocated buffer, logits = hidden."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.hidden = torch.zeros(max_tokens, 1)
        self.attention_backend = None  # start-up puts the chosen backend here; it is never called

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata, kv_cache) -> torch.Tensor:
        return self.hidden[:input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class StandInSampler:
    """The sampler's interface over a fixed token stream: each call's N rows take the stream's next N ids."""

    def __init__(self, token_ids: np.ndarray) -> None:
        self.tokens = torch.from_numpy(np.ascontiguousarray(token_ids, dtype=np.int64))
        self.position = 0

    def sample(self, logits: torch.Tensor, rows: list, grammar_mask=None,
               out: torch.Tensor | None = None) -> SamplerOutput:
        n = len(rows)
        if self.position + n > self.tokens.shape[0]:
            self.position = 0
        sampled = self.tokens[self.position:self.position + n]
        self.position += n
        # As the sampler does: the tokens into `out` (the next padded step's inputs), read back from the stream.
        return SamplerOutput(sampled if out is None else out.copy_(sampled), None, [None] * n, HostCopy([sampled]))


def stand_in_spec(vocab_size: int, max_model_len: int) -> ModelSpec:
    """A one-layer Llama shape with a tiny KV cache (2 KV heads of 8 dims: 2 KiB per 16-token fp32 block)."""
    return ModelSpec.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": max_model_len,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }, where="the host benchmark's stand-in shape")


def stand_in_engine(config: EngineConfig, tokenizer=None) -> LLMEngine:
    """The real engine on the CPU over the stand-in model and sampler; decode steps take the padded path
    (what CUDA graphs replay on a GPU), its replay returning the stand-in's logits."""
    vocab_size = STAND_IN_VOCAB_SIZE
    spec = stand_in_spec(vocab_size, config.max_model_len)
    tokenizer = tokenizer if tokenizer is not None else dummy_tokenizer(spec)
    model = StandInModel(config.max_num_batched_tokens)
    loaded = LoadedModel(spec, model, tokenizer, "dummy", "stand-in")
    engine = LLMEngine(config, loaded_model=loaded, decode_mode="padded")
    step_runner = engine.runner.step_runner
    logits = torch.zeros(step_runner.buffers.rows_of(step_runner.bucket_sizes[-1]), 1)
    step_runner.use_graphs = True  # run() replays; the replay below stands in for the graph
    step_runner.replay = lambda tokens, bound: logits[:step_runner.buffers.rows_of(tokens)]
    pool = token_pool(tokenizer, vocab_size, np.random.default_rng(config.seed))
    engine.runner.sampler = StandInSampler(np.random.default_rng(config.seed + 1).choice(pool, 1 << 16))
    return engine


def token_pool(tokenizer, vocab_size: int, rng: np.random.Generator, size: int = 4096) -> np.ndarray:
    """Ids whose text is ordinary: printable bytes for a byte tokenizer, else random ids past the special
    tokens whose text holds no stop-string character."""
    if isinstance(tokenizer, ByteTokenizer):
        return np.arange(32, 127)
    low = min(1000, vocab_size // 2)
    candidates = rng.choice(np.arange(low, vocab_size), min(size, vocab_size - low), replace=False)
    return np.array([t for t in candidates.tolist() if _STOP_CHAR not in tokenizer.decode([t])])


# Spans. ---------------------------------------------------------------------------------------------------


class PhaseClock:
    """Spans on `clock` around methods, summed per phase; a nested span's time is taken out of its parent's."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._stack: list[list] = []  # [phase, start, time taken by nested spans]
        self._restore: list[Callable[[], None]] = []

    def wrap(self, owner, attr: str, phase: str) -> None:
        """Time every call of `owner.attr` (an instance or a class) as `phase`, until `close`."""
        had, previous = attr in owner.__dict__, owner.__dict__.get(attr)
        function = getattr(owner, attr)
        stack, seconds, clock = self._stack, self.seconds, self.clock

        def timed(*args, **kwargs):
            frame = [phase, clock(), 0.0]
            stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                stack.pop()
                taken = clock() - frame[1]
                seconds[phase] = seconds.get(phase, 0.0) + taken - frame[2]
                if stack:
                    stack[-1][2] += taken

        # On a class the wrapper must be a function, so instances bind it as a method.
        setattr(owner, attr, (lambda *args, **kwargs: timed(*args, **kwargs)) if isinstance(owner, type) else timed)

        def restore():
            if had:
                setattr(owner, attr, previous)
            else:
                delattr(owner, attr)

        self._restore.append(restore)

    def take(self) -> dict[str, float]:
        """The phases' seconds since the last take; the sums start again from zero."""
        taken = dict(self.seconds)
        self.seconds.clear()
        return taken

    def close(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()


def engine_spans(engine: LLMEngine) -> list[tuple[object, str, str]]:
    """(owner, method, phase) of every span around the engine's components."""
    runner = engine.runner
    spans = [
        (engine.scheduler, "schedule", "schedule"),
        (engine.scheduler.kv, "allocate_slots", "kv_slots"),
        (runner, "launch", "launch_other"),
        (runner, "prepare_inputs", "staging"),
        (runner.model, "forward", "forward"),
        (runner.model, "compute_logits", "forward"),
        (runner.sampler, "sample", "sampling"),
        (inflight_module.InflightStep, "result", "collect"),
        (engine.scheduler, "update", "update"),
        (engine.output_processor, "append_tokens", "output"),
        (engine.output_processor, "make_outputs", "output"),
        (detokenizer_module.IncrementalDetokenizer, "append_text", "detokenize"),
    ]
    if runner.step_runner is not None:
        spans += [(runner.step_runner.buffers, "load", "staging"), (runner.step_runner, "replay", "forward"),
                  (runner.step_runner, "forward", "forward")]
    if engine.device.type == "cuda":  # every wait of the host for the device is a CUDA event's synchronize
        spans.append((torch.cuda.Event, "synchronize", "gpu_wait"))
    return spans


def instrument(engine: LLMEngine, clock: PhaseClock, phases: tuple[str, ...] = PHASES) -> PhaseClock:
    """Spans around the engine's components, for the phases named."""
    for owner, attr, phase in engine_spans(engine):
        if phase in phases:
            clock.wrap(owner, attr, phase)
    return clock


# The measurement. -----------------------------------------------------------------------------------------


@dataclass
class StepSample:
    cpu_s: float
    wall_s: float
    decode_tokens: int
    prefill_tokens: int
    output_tokens: int
    gpu_s: float | None = None  # the device time of the step this call launched (CUDA only)


class _Point:
    """One (mode, N) point on a running engine: prompts in, warm-up, then timed steps."""

    def __init__(self, engine: LLMEngine, workload: HostWorkload, mode: str, num_seqs: int,
                 pool: np.ndarray, rng: np.random.Generator) -> None:
        self.engine, self.workload, self.mode, self.num_seqs = engine, workload, mode, num_seqs
        self.pool, self.rng = pool, rng
        stop = [_STOP_CHAR * 2] if workload.stop_string else []
        max_tokens = workload.max_output_tokens(num_seqs, engine.config.max_num_batched_tokens)
        self.stream_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=stop)
        self.long_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, stop=stop)
        self.long_ids: set[str] = set()
        self.streams = [engine.add_request(self._prompt(workload.prompt_len), self.stream_params)
                        for _ in range(num_seqs)]
        self.stream_ids = set(self.streams)
        self._last_chunks: list = []
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            self._last_chunks = out.chunks
            return out

        engine.scheduler.schedule = recording_schedule

    def _prompt(self, length: int) -> list[int]:
        return self.rng.choice(self.pool, length).tolist()

    def _add_long_prompts(self) -> None:
        while self.mode == "mixed" and len(self.long_ids) < 2:
            self.long_ids.add(self.engine.add_request(self._prompt(self.workload.long_prompt_len), self.long_params))

    def warm_up(self) -> None:
        """Step until every stream decodes, then the warm-up steps."""
        self._add_long_prompts()
        for _ in range(100_000):
            self.step()
            decoding = sum(1 for c in self._last_chunks if c.num_tokens == 1 and c.request_id in self.stream_ids)
            if decoding == self.num_seqs:
                break
        else:
            raise RuntimeError("the streams never all reached decoding")
        for _ in range(self.workload.warmup_steps):
            self.step()

    def step(self) -> StepSample:
        engine = self.engine
        cpu, wall = time.thread_time(), time.perf_counter()
        outputs, stats = engine.step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        for output in outputs:
            if output.finished:
                if output.request_id not in self.long_ids:
                    raise RuntimeError(f"stream {output.request_id} finished during its point "
                                       f"({output.outputs[0].finish_reason})")
                self.long_ids.discard(output.request_id)
        self._add_long_prompts()
        chunks = self._last_chunks
        decode = sum(1 for c in chunks if c.num_tokens == 1)
        prefill = sum(c.num_tokens for c in chunks) - decode
        return StepSample(cpu, wall, decode, prefill, stats.num_generation_tokens)

    def finish(self) -> None:
        engine = self.engine
        engine.scheduler.__dict__.pop("schedule", None)
        for request_id in self.streams + sorted(self.long_ids):
            engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()


def _pass(engine: LLMEngine, point: _Point, steps: int, clock: PhaseClock, phases: tuple[str, ...],
          gpu_time: bool = False) -> tuple[list[StepSample], list[dict[str, float]]]:
    """`steps` steps with spans on `phases`: (the steps, each step's span seconds per phase). `gpu_time`: on a
    CUDA device each step also gets the device time of the step it launched (events read after the pass)."""
    instrument(engine, clock, phases)
    timer = cuda_step_timer(engine.runner, engine.device) if gpu_time else None
    samples, per_step, launches = [], [], []
    try:
        gc.collect()
        for _ in range(steps):
            samples.append(point.step())
            per_step.append(clock.take())
            if timer is not None:
                launches.append(timer.num_launches)
        if timer is not None:
            seconds = timer.read()
            for sample, (first, last) in zip(samples, zip([0] + launches, launches)):
                sample.gpu_s = sum(seconds[first:last])
    finally:
        clock.close()
        if timer is not None:
            timer.close()
    return samples, per_step


def _count_pass(engine: LLMEngine, point: _Point, steps: int) -> dict:
    """`steps` steps with the torch calls the host issues outside the forward counted, per step, by kind and
    by phase (core/bench/torch_ops.py). Untimed: the dispatch mode adds to every op it sees."""
    counter = TorchOpCounter()
    try:
        for owner, attr, phase in engine_spans(engine):
            if phase == "forward":
                counter.exclude(owner, attr)
            else:
                counter.attribute(owner, attr, phase)
        if engine.device.type == "cuda":
            counter.count_cuda_events()
        with counter:
            for _ in range(steps):
                point.step()
    finally:
        counter.close()
    return torch_ops_per_step(counter.take(), steps)


def _core_median(samples: list[StepSample], spans: list[dict[str, float]], less: tuple[str, ...] = ()) -> float:
    """Median over the steps of the step's CPU time less its front end and forward (and the phases `less`)."""
    return statistics.median(s.cpu_s - step.get("output", 0.0) - step.get("forward", 0.0)
                             - sum(step.get(phase, 0.0) for phase in less) for s, step in zip(samples, spans))


def _summary(values: list[float]) -> dict:
    values_us = sorted(v * 1e6 for v in values)
    return {"mean": statistics.fmean(values_us), "p50": statistics.median(values_us),
            "p90": values_us[min(len(values_us) - 1, int(0.9 * len(values_us)))], "min": values_us[0]}


def measure_point(engine: LLMEngine, workload: HostWorkload, mode: str, num_seqs: int, pool: np.ndarray,
                  rng: np.random.Generator) -> dict:
    """The timed passes take the step's CPU time and, by CPU-time spans, the front end's and the
    forward's; of the `repeats` of them the one whose core median is lowest is kept (the least disturbed by
    other processes: they only ever add time). The phase pass puts CPU-time spans on every phase (a CPU
    clock read costs about a microsecond, which the per-token spans add to what they measure)."""
    point = _Point(engine, workload, mode, num_seqs, pool, rng)
    try:
        point.warm_up()
        timed = [_pass(engine, point, workload.steps, PhaseClock(time.thread_time), ("output", "forward", "collect", "gpu_wait"),
                       gpu_time=True) for _ in range(workload.repeats)]
        phase_pass = _pass(engine, point, workload.steps, PhaseClock(time.thread_time), PHASES)
        torch_ops = _count_pass(engine, point, min(workload.steps, COUNTED_STEPS))
    finally:
        point.finish()
    repeat_cores = [_core_median(*run) for run in timed]
    passes = {"timed": timed[repeat_cores.index(min(repeat_cores))], "phases": phase_pass}
    samples, cpu_spans = passes["timed"]
    phase_samples, phase_spans = passes["phases"]
    steps = len(samples)
    cpu_mean = statistics.fmean(s.cpu_s for s in samples)
    # Medians over the steps: on a shared machine a step now and then takes far longer (other processes'
    # cache traffic, the collector), which a mean would spread over every figure.
    front = statistics.median(spans.get("output", 0.0) for spans in cpu_spans)
    forward = statistics.median(spans.get("forward", 0.0) for spans in cpu_spans)
    collect = statistics.median(spans.get("collect", 0.0) for spans in cpu_spans)
    core = _core_median(samples, cpu_spans)
    core_less_wait = _core_median(samples, cpu_spans, ("gpu_wait",))
    gpu_wait = statistics.median(spans.get("gpu_wait", 0.0) for spans in cpu_spans)
    output_tokens = statistics.fmean(s.output_tokens for s in samples)
    phase_cpu = statistics.fmean(s.cpu_s for s in phase_samples)
    phases = {p: statistics.fmean(spans.get(p, 0.0) for spans in phase_spans) * 1e6 for p in PHASES if p != "other"}
    phases["other"] = max(0.0, phase_cpu * 1e6 - sum(phases.values()))
    front_phases = sum(phases[p] for p in FRONT_END_PHASES)
    gpu = [s.gpu_s for s in samples if s.gpu_s is not None]
    wall_mean = statistics.fmean(s.wall_s for s in samples)
    return {
        "mode": mode,
        "num_seqs": num_seqs,
        "steps": steps,
        "decode_tokens_per_step": statistics.fmean(s.decode_tokens for s in samples),
        "prefill_tokens_per_step": statistics.fmean(s.prefill_tokens for s in samples),
        "output_tokens_per_step": output_tokens,
        "cpu_us_per_step": _summary([s.cpu_s for s in samples]),
        "wall_us_per_step": _summary([s.wall_s for s in samples]),
        # The device time of the same steps (CUDA events around each launch, read after the pass) and the
        # step's wall time over it: 1.0 is a host wholly hidden behind the device. None without a CUDA device.
        "gpu_us_per_step": _summary(gpu) if gpu else None,
        "wall_over_gpu": wall_mean / statistics.fmean(gpu) if gpu and statistics.fmean(gpu) > 0 else None,
        "cpu_us_per_step_mean": cpu_mean * 1e6,
        # Medians over the timed steps: the core (the step less front end and forward), front end, forward.
        "cpu_us_per_seq": cpu_mean * 1e6 / num_seqs,
        "core_cpu_us_per_step": core * 1e6,
        "core_cpu_us_per_seq": core * 1e6 / num_seqs,
        "core_cpu_us_per_step_repeats": [c * 1e6 for c in repeat_cores],
        # The engine core's own work, what its budget (5 µs per sequence + 150 µs per step) is set on: the core
        # less the host's waits for the device (CUDA event synchronizes, spinning; 0 on the stand-in).
        "core_less_gpu_wait_cpu_us_per_step": core_less_wait * 1e6,
        "core_less_gpu_wait_cpu_us_per_seq": core_less_wait * 1e6 / num_seqs,
        "gpu_wait_cpu_us_per_step": gpu_wait * 1e6,
        "front_end_cpu_us_per_step": front * 1e6,
        "front_end_cpu_us_per_token": front * 1e6 / output_tokens if output_tokens else None,
        "forward_cpu_us_per_step": forward * 1e6,
        # Part of the core: reading the sampled tokens back; with --forward model on a GPU, also the wait for
        # the device (CUDA events spin), which the core then holds too.
        "collect_cpu_us_per_step": collect * 1e6,
        # The phase pass: CPU µs per step (its spans around per-request and per-token calls add their cost).
        "phases_us_per_step": phases,
        "phases_core_us_per_seq": (phase_cpu * 1e6 - front_phases - phases["forward"]) / num_seqs,
        "phases_pass_cpu_us_per_step": phase_cpu * 1e6,
        # The torch calls the host issues per step outside the forward (graph replays are none), by kind and
        # by phase; on the stand-in the sampler's are the stand-in's (core/bench/torch_ops.py).
        "torch_ops_per_step": torch_ops,
    }


def linear_fit(points: list[dict], key: str = "core_cpu_us_per_step") -> dict | None:
    """Least squares of `key` over num_seqs: {per_seq_us (slope), fixed_us (intercept)}; None below 2 sizes."""
    xs = [p["num_seqs"] for p in points]
    if len(set(xs)) < 2:
        return None
    slope, intercept = np.polyfit(xs, [p[key] for p in points], 1)
    return {"per_seq_us": float(slope), "fixed_us": float(intercept), "num_seqs": xs}


def host_engine_config(workload: HostWorkload, base: EngineConfig, forward: str) -> EngineConfig:
    """The engine's config for the sweep: room for the largest point (its streams and two long prompts)."""
    max_seqs = max(workload.num_seqs) + 2
    budget = base.max_num_batched_tokens
    if "mixed" in workload.modes and budget <= max(workload.num_seqs):
        raise InvalidRequestError(f"mixed steps need --max-num-batched-tokens above the largest --num-seqs "
                                  f"({max(workload.num_seqs)}), got {budget}")
    overrides: dict = {"max_num_seqs": max(base.max_num_seqs, max_seqs) if forward == "model" else max_seqs,
                       "max_waiting_requests": max(base.max_waiting_requests, max_seqs)}
    if forward == "stand-in":
        stream_tokens = workload.prompt_len + workload.max_output_tokens(max(workload.num_seqs), budget)
        max_model_len = max(stream_tokens, workload.long_prompt_len + 1) + base.block_size
        blocks = max_seqs * cdiv(stream_tokens, base.block_size) + 3 * cdiv(workload.long_prompt_len, base.block_size)
        overrides.update(device="cpu", dtype="float32", max_model_len=max_model_len, num_gpu_blocks=blocks,
                         attention_backend="torch", dummy_weights=False, shape=None, quantization=None)
    from dataclasses import replace

    return replace(base, **overrides)


def run_host_benchmark(base_config: EngineConfig, workload: HostWorkload, forward: str = "stand-in",
                       on_point: Callable[[dict], None] | None = None, tokenizer=None) -> dict:
    """Every (mode, N) point on one engine. -> the JSON payload (points and fits per mode)."""
    if forward not in FORWARDS:
        raise InvalidRequestError(f"--forward takes {', '.join(FORWARDS)}, got {forward!r}")
    config = host_engine_config(workload, base_config, forward)
    threads = torch.get_num_threads()
    if forward == "stand-in":
        # The stand-in's few torch ops (staging copies) are device copies on a GPU; on a shared CPU, torch's
        # intra-op threads would spin for them (milliseconds a copy) and measure the machine, not the engine.
        torch.set_num_threads(1)
    try:
        return _run(config, workload, forward, on_point, tokenizer)
    finally:
        torch.set_num_threads(threads)


def _run(config: EngineConfig, workload: HostWorkload, forward: str, on_point, tokenizer) -> dict:
    load_at_start = os.getloadavg()  # CPU time per step grows with what else runs on the machine
    engine = stand_in_engine(config, tokenizer) if forward == "stand-in" else LLMEngine(config)
    rng = np.random.default_rng(workload.seed)
    pool = token_pool(engine.tokenizer, engine.spec.vocab_size, rng)
    points, interrupted = [], False
    try:
        for mode in workload.modes:
            for num_seqs in workload.num_seqs:
                point = measure_point(engine, workload, mode, num_seqs, pool, rng)
                points.append(point)
                if on_point is not None:
                    on_point(point)
    except KeyboardInterrupt:
        interrupted = True
    fits = {mode: {"core": linear_fit([p for p in points if p["mode"] == mode]),
                   "core_less_gpu_wait": linear_fit([p for p in points if p["mode"] == mode],
                                                    "core_less_gpu_wait_cpu_us_per_step"),
                   "total": linear_fit([p for p in points if p["mode"] == mode], "cpu_us_per_step_mean")}
            for mode in workload.modes}
    tokens = [p["front_end_cpu_us_per_token"] for p in points if p["front_end_cpu_us_per_token"] is not None]
    return {
        "benchmark": "host",
        "forward": forward,
        "model_name": engine.model_name,
        "tokenizer": type(engine.tokenizer).__name__,
        "device": str(engine.device),
        "decode_mode": engine.decode_mode,
        "engine_config": {k: v for k, v in asdict(config).items() if k in (
            "block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "async_scheduling",
            "num_gpu_blocks", "max_model_len")},
        "workload": asdict(workload),
        "points": points,
        "fit": fits,
        "front_end_cpu_us_per_token_max": max(tokens) if tokens else None,
        "interrupted": interrupted,
        "load_average_1_5_15_min": {"start": list(load_at_start), "end": list(os.getloadavg())},
    }


# Tables. --------------------------------------------------------------------------------------------------


def _rounded(value: float | None) -> str:
    """A µs figure for a table cell; - where the payload lacks it (written before it was measured)."""
    return "-" if value is None else f"{value:.0f}"


def _device_calls(point: dict) -> str:
    """The point's torch calls per step that are not views (a payload written before they were counted: -)."""
    ops = point.get("torch_ops_per_step")
    return "-" if ops is None else f"{ops['device_calls']:.0f}"


def host_tables(payload: dict) -> list:
    """Per point: CPU and wall µs per step, the core's µs per sequence and the front end's per token; then
    the phase pass's µs per step; then each mode's fit (and the baseline's, when the payload has one)."""
    from rich.table import Table

    workload = payload["workload"]
    title = (f"deepinfer bench host ({payload['forward']} forward, {payload['device']}): prompt "
             f"{workload['prompt_len']}, long prompt {workload['long_prompt_len']}, {workload['steps']} steps a point")
    totals = Table(title=title, title_justify="left")
    for name in ("mode", "seqs", "tokens/step", "CPU µs/step p50", "CPU µs/step", "wall µs/step", "GPU µs/step",
                 "wall/GPU", "core µs/step", "core µs/seq", "core less wait µs/step", "front µs/token",
                 "device calls/step"):
        totals.add_column(name, justify="right", no_wrap=True)
    phases = Table(title="where a step's time goes, CPU µs per step (phase pass)", title_justify="left")
    for name in ("mode", "seqs", *PHASES):
        phases.add_column(name, justify="right", no_wrap=True)
    for point in payload["points"]:
        tokens = point["decode_tokens_per_step"] + point["prefill_tokens_per_step"]
        front, gpu, ratio = point["front_end_cpu_us_per_token"], point.get("gpu_us_per_step"), point.get("wall_over_gpu")
        totals.add_row(point["mode"], str(point["num_seqs"]), f"{tokens:.0f}", f"{point['cpu_us_per_step']['p50']:.0f}",
                       f"{point['cpu_us_per_step_mean']:.0f}", f"{point['wall_us_per_step']['mean']:.0f}",
                       "-" if gpu is None else f"{gpu['mean']:.0f}", "-" if ratio is None else f"{ratio:.2f}",
                       f"{point['core_cpu_us_per_step']:.0f}", f"{point['core_cpu_us_per_seq']:.2f}",
                       _rounded(point.get("core_less_gpu_wait_cpu_us_per_step")),
                       "-" if front is None else f"{front:.2f}", _device_calls(point))
        phases.add_row(point["mode"], str(point["num_seqs"]),
                       *(_rounded(point["phases_us_per_step"].get(p)) for p in PHASES))
    fits = Table(title="engine core CPU µs per step = fixed + per_seq x seqs (least squares over the sizes)",
                 title_justify="left")
    for name in ("mode", "run", "core µs/seq", "core fixed µs", "core less wait µs/seq", "core less wait fixed µs",
                 "total µs/seq", "total fixed µs"):
        fits.add_column(name, justify="right", no_wrap=True)
    runs = [("this", payload)] + ([("baseline", payload["baseline"])] if payload.get("baseline") else [])
    for mode in payload["workload"]["modes"]:
        for label, run in runs:
            fit = run.get("fit", {}).get(mode) or {}
            core, total = fit.get("core") or {}, fit.get("total") or {}
            own = fit.get("core_less_gpu_wait") or {}

            def cell(part: dict, key: str) -> str:
                return "-" if part.get(key) is None else f"{part[key]:.1f}"

            fits.add_row(mode, label, cell(core, "per_seq_us"), cell(core, "fixed_us"), cell(own, "per_seq_us"),
                         cell(own, "fixed_us"), cell(total, "per_seq_us"), cell(total, "fixed_us"))
    return [totals, phases, fits]
