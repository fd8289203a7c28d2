"""LLMEngine: the synchronous engine. Load the model, size the KV pool, then `step()` forever:

    scheduler_output = scheduler.schedule()
    launched = runner.launch(scheduler_output, previous=in_flight)   # enqueued on the device
    runner_output = in_flight.result()                               # waits for the previous step
    scheduler.update(in_flight.scheduler_output, runner_output)      -> detokenize, stop strings, outputs
    in_flight = launched

Async scheduling (`EngineConfig.async_scheduling`, on by default): at most one step is in flight.
While the device runs step N, the host schedules and launches step N+1 (its decodes read N's
sampled tokens on the device), and only then waits for N's tokens and applies them exactly as a
synchronous step would, so the host's per-step work hides behind the device's. Outputs therefore
come one `step()` call after the step that computed them; `has_unfinished_requests()` stays true
while a step is in flight, and a last call with nothing to schedule only applies it. A request
that step N finishes (EOS, stop token or string, max_tokens, abort, error) may already be in step
N+1; that result is discarded. Its blocks are freed at once: all device work runs on one stream,
so a later step that reuses them runs after N+1. Without async scheduling the step in flight is
applied before the next one is scheduled. Neither penalties nor structured outputs need that
wait: penalties read the request's token counts on the device, where the sampler has already
added the token in flight (core/engine/worker/token_counts.py), and a grammar's token mask is computed
after the next step's forward is enqueued, from the step in flight's token
(core/structured/step_mask.py). Tokens, logprobs, finish reasons, stop reasons and
token counts are the same either way. Which step a request runs in may differ (one that stops
on a token's value at N still holds its seat and blocks while N+1 is scheduled), and so may its
prefix-cache hits (`num_cached_tokens`): blocks are cached when the step computing them is
applied, so a request admitted while that step is still in flight does not find them.

Start-up: the engine takes a ready model (core/models/loader.py builds one: read, quantized at load
time when `quantization` is set, projections merged, compacted on a GPU), then core/engine/worker/startup.py
chooses the attention backend, measures the largest step to size the KV pool, allocates it, and
captures the step CUDA graphs (core/engine/worker/cuda_graphs.py) when the backend is the native one on a GPU.

Every step is exception-safe: a failed forward fails the requests of that step alone (finish
reason "error", blocks freed) and the next step goes on; a request whose sampling or
detokenization fails fails alone. Bad input is refused when the request is made (`make_request_group`), never in a step.
With a step in flight, a step whose launch fails is reported after the step in flight is applied
(its requests keep the tokens that step gave them, then fail); an abort finishes the request at
once and discards what the step in flight computed for it.

The engine core of an engine in its own process (`detokenize=False`, core/engine/sched/core_process.py)
has no output processor: its `core_step` is `step` without the outputs, and the front end, which
detokenizes and matches stop strings there, ends samples through `finish`.

Not thread-safe: `LLM` calls it from one thread, `AsyncEngine` from its engine thread. Only
`make_request_group` (validation and tokenization) may run on another thread.
"""

from __future__ import annotations

import itertools
import logging
import time

from deepinfer.core.config import EngineConfig
from deepinfer.core.distributed.driver import TensorParallelDriver, eager, start_tensor_parallel
from deepinfer.core.engine.frontend.output_processor import OutputProcessor, RequestGroup
from deepinfer.core.engine.frontend.outputs import RequestOutput
from deepinfer.core.engine.frontend.request_checks import check_request
from deepinfer.core.engine.sampling_params import SamplingDefaults, SamplingParams
from deepinfer.core.engine.sched.request import Request, RequestStatus, make_samples
from deepinfer.core.engine.sched.scheduler import Scheduler
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.engine.worker.backends import kernel_summary
from deepinfer.core.engine.worker.inflight import InflightStep
from deepinfer.core.engine.worker.sampler import make_generator
from deepinfer.core.engine.worker.startup import resolve_device, resolve_dtype, start_up
from deepinfer.core.errors import DeepInferError, InvalidRequestError, QueueFullError
from deepinfer.core.kv.kv_manager import KVCacheManager
from deepinfer.core.models.loader import LoadedModel, load_model
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded_model: LoadedModel | None = None,
                 decode_mode: str | None = None, detokenize: bool = True) -> None:
        """`loaded_model`: a ready model (core.models.loader.load_model) to run instead of loading
        `config.model`; it may be shared with other engines, so it is used as it is (with
        `config.quantization` it must already be quantized).
        `decode_mode`: how decode steps, and mixed steps a graph serves, run: "graphs" (CUDA graphs),
        "padded" (the graphs' padded inputs run eagerly: a test and debugging aid), "eager"; None:
        graphs on a GPU with the native attention backend unless `enforce_eager`, else eager.
        `detokenize`: False for the engine core of an engine in its own process (core/engine/sched/core_process.py),
        whose front end detokenizes, matches stop strings and builds the outputs: the engine then has no
        output processor, `core_step` is its step, and `finish` ends the requests the front end decides."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if loaded_model is None and config.tensor_parallel_size > 1:  # rank 0's shard, in the rank-0 driver
            decode_mode = eager(decode_mode)
            loaded_model = start_tensor_parallel(config, self.device, self.dtype)
        elif loaded_model is None:
            loaded_model = load_model(config, self.device, self.dtype)
        elif config.quantization and not any(isinstance(m, QuantLinear) for m in loaded_model.model.modules()):
            raise DeepInferError(f"quantization {config.quantization!r} was asked for, but the given model is not "
                                 f"quantized; load it with that quantization (core.models.loader.load_model)")
        self.spec = loaded_model.spec
        self.model = loaded_model.model
        self.tokenizer = loaded_model.tokenizer
        self.model_name = loaded_model.name
        self.source_kind = loaded_model.source_kind
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.spec.eos_token_ids)
        # What LLM, chat and serve fill a request's unset sampling fields with (the engine itself does not).
        generation = loaded_model.generation_defaults
        self.sampling_defaults = SamplingDefaults.layer(generation.values, generation.source,
                                                        config.override_generation_config)

        runtime = start_up(config, self.model, self.spec, self.device, self.dtype, decode_mode,
                           tokenizer=self.tokenizer)
        self.decode_mode = runtime.decode_mode
        self.kv_dtype, self.kv_quantized = runtime.kv_dtype, runtime.kv_quantized
        self.kv_budget = runtime.kv_budget
        self.max_model_len = runtime.max_model_len
        self.kv_cache = runtime.kv_cache
        self.step_runner = runtime.step_runner
        self.runner = runtime.runner
        self.scheduler = Scheduler(
            KVCacheManager(self.kv_budget.num_blocks, config.block_size, config.enable_prefix_caching),
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_waiting_requests=config.max_waiting_requests, max_model_len=self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer) if detokenize else None
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        self._pending_stats = IterationStats()  # finishes outside a step (aborts), reported by the next
        self._inflight: InflightStep | None = None  # launched, not applied yet (async scheduling)
        self._ids = itertools.count()
        self.sampled: list[Request] = []  # the samples the last core_step gave a token

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (core/distributed/driver.py); nothing to do on one device."""
        if isinstance(self.model, TensorParallelDriver):
            self.model.close()

    # Requests ------------------------------------------------------------------------------------

    def make_request_group(self, prompt: str | list[int], params: SamplingParams,
                           request_id: str | None = None, cache_salt: str | None = None) -> RequestGroup:
        """Validate and tokenize one request (thread-safe). Raises InvalidRequestError, PromptTooLongError."""
        prompt_text, token_ids, params = check_request(
            prompt, params, self.tokenizer, self.spec.vocab_size, self.max_model_len,
            self.config.max_waiting_requests, cache_salt)
        compiled_grammar = None
        if params.structured_outputs is not None:  # a cache hit when the server compiled it already
            compiled_grammar = self.grammars.compile(params.structured_outputs)
        request_id = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        samples = make_samples(request_id, token_ids, params, eos_token_ids=self.eos_token_ids,
                               cache_salt=cache_salt, arrival_time=time.monotonic())
        for sample in samples:
            sample.generator = make_generator(sample.params, self.device)
            if compiled_grammar is not None:
                sample.grammar = compiled_grammar.new_request_grammar()
            if sample.sample_index > 0 and self.config.enable_prefix_caching:
                sample.wait_for = samples[0]  # share the first sample's prompt blocks
        return RequestGroup(request_id, prompt_text, token_ids, params, samples)

    def add_request_group(self, group: RequestGroup) -> None:
        """Queue a validated request. Raises QueueFullError or InvalidRequestError (id in use)."""
        processor = self.output_processor
        if (processor is not None and group.request_id in processor.groups) or any(
                s.request_id in self.scheduler.requests for s in group.samples):
            raise InvalidRequestError(f"request id {group.request_id!r} is already in use")
        if not self.scheduler.has_room(len(group.samples)):
            raise QueueFullError(
                f"the waiting queue is full ({self.scheduler.max_waiting_requests} requests); retry later")
        for sample in group.samples:
            self.scheduler.add_request(sample)
        if processor is not None:
            processor.add(group)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        group = self.make_request_group(prompt, params, request_id, cache_salt)
        self.add_request_group(group)
        return group.request_id

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish a request and free its blocks now; returns its final output (none if unknown or done)."""
        group = self.output_processor.groups.get(request_id)
        if group is None:
            return []
        aborted = self.scheduler.finish_requests([s.request_id for s in group.samples],
                                                 RequestStatus.FINISHED_ABORTED)
        return self.output_processor.make_outputs(aborted or group.samples, self._pending_stats)

    def finish(self, sample_ids: list[str], status: RequestStatus, stop_reason: str | int | None = None,
               error: str | None = None) -> list[Request]:
        """Finish these samples now and free their blocks (without an output processor: the front end's
        aborts and its stop-string or detokenization finishes). -> the samples it finished."""
        return self.scheduler.finish_requests(sample_ids, status, error=error, stop_reason=stop_reason)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or a step's outputs are still to come."""
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    # The step ------------------------------------------------------------------------------------

    def step(self) -> tuple[list[RequestOutput], IterationStats]:
        """Schedule and launch the next step, then apply the step in flight (async scheduling) or the
        one just launched. -> the outputs of the requests the applied step (and aborts, failures) touched."""
        touched, stats = self.core_step()
        return self.output_processor.make_outputs(touched, stats), stats

    def core_step(self) -> tuple[list[Request], IterationStats]:
        """`step` without the outputs: -> the samples the applied step gave a token or finished (one may
        come twice), and the step's stats; `sampled` then holds those that got a token (one each), in order."""
        stats, self._pending_stats = self._pending_stats, IterationStats()
        self.sampled = []
        touched: list[Request] = []
        launched, failed, failure = None, None, None
        try:
            scheduler_output = self.scheduler.schedule()
        except Exception as err:  # an engine bug must not kill the loop; fail what was running
            logger.exception("scheduling failed; failing the running requests")
            scheduler_output, failure = None, err
        if scheduler_output is not None:
            touched += scheduler_output.failed
            stats.num_preemptions = len(scheduler_output.preempted)
            stats.prefix_cache_queries = scheduler_output.prefix_cache_queries
            stats.prefix_cache_hits = scheduler_output.prefix_cache_hits
            if not scheduler_output.is_empty:
                try:
                    launched = self.runner.launch(scheduler_output, self._inflight)
                except Exception as err:  # fail this step's requests only; the engine goes on
                    failed, failure = [chunk.request for chunk in scheduler_output.chunks], err
                    logger.exception("a step of %d requests failed; failing them", len(failed))
        if self._inflight is not None:  # before any failure, so its requests keep what it computed
            touched += self._apply_inflight(stats)
        if failure is not None:  # a failed launch fails its requests; a failed schedule, every running one
            touched += self._fail(list(self.scheduler.running) if failed is None else failed, failure)
        self._inflight = launched
        if launched is not None and not self.config.async_scheduling:
            touched += self._apply_inflight(stats)
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_cache_usage = self.scheduler.kv.usage
        return touched, stats

    def _apply_inflight(self, stats: IterationStats) -> list[Request]:
        """Wait for the step in flight's tokens and apply them as a synchronous step would."""
        inflight, self._inflight = self._inflight, None
        scheduler_output = inflight.scheduler_output
        step_stats = IterationStats()  # what the step adds to `stats` once it is applied
        try:
            runner_output = inflight.result()
            sampling_failed = self._fail_sampling_failures(inflight, step_stats)  # before update, which skips them
            sampled = self.scheduler.update(scheduler_output, runner_output, step_stats)
        except Exception as err:  # fail this step's requests only; the engine goes on
            requests = [chunk.request for chunk in scheduler_output.chunks]
            logger.exception("a step of %d requests failed; failing them", len(requests))
            return self._fail(requests, err)
        stats.num_prompt_tokens += step_stats.num_prompt_tokens
        stats.num_generation_tokens += len(sampled)
        self.sampled += sampled
        if self.output_processor is None:  # the front end detokenizes
            return sampled + sampling_failed
        stopped, failed = self.output_processor.append_tokens(sampled, stats)
        for request, stop in stopped:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED,
                                           stop_reason=stop)
        for request, message in failed:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR, error=message)
        return sampled + [request for request, _ in failed] + sampling_failed

    def _fail_sampling_failures(self, inflight: InflightStep, stats: IterationStats) -> list[Request]:
        """Fail the requests whose own sampling raised in `inflight` (the sampler gave them token 0); their
        chunks' prompt tokens were computed, so `stats` counts those first-time ones (update skips them)."""
        failures = inflight.sampled.failures if inflight.sampled is not None else {}
        finished = []
        for row, message in failures.items():
            chunk = inflight.sampling_chunks[row]
            request = chunk.request
            if not request.is_finished:
                stats.num_prompt_tokens += max(0, min(chunk.seq_len, request.num_prompt_tokens)
                                               - request.max_computed_prompt_tokens)
            logger.error("request %s failed: %s", request.request_id, message)
            finished += self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR,
                                                       error=message)
        return finished

    def _fail(self, requests: list[Request], err: Exception) -> list[Request]:
        message = f"{type(err).__name__}: {err}"
        return self.scheduler.finish_requests([r.request_id for r in requests if not r.is_finished],
                                              RequestStatus.FINISHED_ERROR, error=message)

    # Introspection -------------------------------------------------------------------------------

    def weight_summary(self) -> dict:
        """How the model holds its weights: quantized linears (and their bit widths), bytes of its tensors."""
        quantized = [m for m in self.model.modules() if isinstance(m, QuantLinear)]
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return {
            "quantized_linears": len(quantized),
            "quantized_bits": sorted({m.bits for m in quantized}),
            "weight_bytes": sum(t.numel() * t.element_size() for t in tensors),
        }

    def health(self) -> dict:
        kv = self.scheduler.kv
        pool, prefix = kv.pool, kv.prefix_cache
        backend = self.model.attention_backend
        graphs = {"enabled": False, "mode": self.decode_mode, "buckets": []}
        if self.step_runner is not None:
            graphs = self.step_runner.describe()
        return {
            "model": self.model_name,
            "source_kind": self.source_kind,
            "family": self.spec.family,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": self.kv_quantized or str(self.kv_dtype).removeprefix("torch."),
            "attention_backend": getattr(backend, "name", type(backend).__name__),
            "kernels": kernel_summary(self.device),
            "cuda_graphs": graphs,
            "quantization": self.config.quantization,
            "max_model_len": self.max_model_len,
            "scheduler": {
                "num_running": self.scheduler.num_running,
                "num_waiting": self.scheduler.num_waiting,
                "max_num_seqs": self.scheduler.max_num_seqs,
                "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
                "max_waiting_requests": self.scheduler.max_waiting_requests,
                "num_preemptions": self.scheduler.num_preemptions_total,
            },
            "blocks": {
                "block_size": kv.block_size,
                "num_blocks": pool.num_blocks,
                "num_used": pool.num_used_blocks,
                "num_free": pool.num_free_blocks,
                "num_cached_unused": pool.num_evictable_blocks,
                "usage": pool.usage,
            },
            "kv_budget": self.kv_budget.as_dict(),
            "prefix_cache": {
                "enabled": prefix is not None,
                "num_cached_blocks": prefix.num_cached_blocks if prefix else 0,
                "queried_tokens": prefix.num_queried_tokens if prefix else 0,
                "hit_tokens": prefix.num_hit_tokens if prefix else 0,
                "hit_rate": (prefix.num_hit_tokens / prefix.num_queried_tokens
                             if prefix and prefix.num_queried_tokens else 0.0),
            },
        }
