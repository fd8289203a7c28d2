"""ModelRunner: owns the tensors of a step. SchedulerOutput in, sampled tokens out.

`launch(scheduler_output, previous)` enqueues a whole step on the device and returns an
InflightStep (core/engine/worker/inflight.py) without waiting for it; `execute` launches and waits.
Per step:
1. `prepare_inputs` orders the chunks decodes first (query length 1, what AttentionMetadata
   expects) and stages them (core/engine/worker/step_inputs.py, the stager padded steps use too): host
   buffer pinned on CUDA, allocated once at the largest step size, one non-blocking copy a step.
   A chunk whose last input token is still pending (`last_token_pending`: sampled by the `previous`
   step, in flight: async scheduling) gets it on the device, from that step's sampled tokens.
2. `model.forward` over the flat batch; the hidden rows of each sampling chunk's last token go
   through `compute_logits` (a prefill chunk that stops short of the prompt's end samples nothing).
3. The sampler draws one token per sampling chunk on the device and starts copying the tokens
   (and logprobs) to the host; `InflightStep.result` waits for that copy, the step's one sync. A padded
   step's sampler writes its tokens into the static input ids, where a steady decode step after it
   reads them without a copy (core/engine/worker/step_inputs.py).
4. A step with constrained rows (structured outputs) instead starts their token masks on a worker
   thread (core/structured/step_mask.py) and is sampled when first needed, at the latest when the
   next step is launched (core/engine/worker/deferred_sample.py).
5. Chunks of requests that ask for prompt logprobs also score their prompt positions
   (core/engine/worker/prompt_logprobs.py), from the same hidden states.

Steps that fit a token bucket (decodes, and mixed or prefill steps whose per-token attention stays
cheap) can instead go to a PaddedStepRunner (core/engine/worker/cuda_graphs.py), which pads them to a
bucket and replays a CUDA graph ("graphs") or runs the padded step eagerly ("padded"); the others
run eagerly as above, as do steps that score prompt tokens (they need every row's hidden state).
"""

from __future__ import annotations

from itertools import compress
from operator import attrgetter

import torch

from deepinfer.core.engine.sched.request import Request
from deepinfer.core.engine.sched.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from deepinfer.core.engine.worker.cuda_graphs import PaddedStepRunner
from deepinfer.core.engine.worker.deferred_sample import DeferredSample, enqueue_sampling
from deepinfer.core.engine.worker.inflight import InflightStep
from deepinfer.core.engine.worker.prompt_logprobs import gather_prompt_logprobs, wants_prompt_logprobs
from deepinfer.core.engine.worker.sampler import Sampler, SamplingRow
from deepinfer.core.engine.worker.step_inputs import StepInputs, request_stager
from deepinfer.core.kv.cache import KVCache
from deepinfer.core.kv.kv_manager import cdiv
from deepinfer.core.structured.step_mask import StepMasks

_sample, _sampling_row = attrgetter("sample"), attrgetter("request.sampling_row")


class ModelRunner:
    def __init__(
        self, model, kv_cache: KVCache, device: torch.device, *, block_size: int, max_num_batched_tokens: int,
        max_num_seqs: int, max_model_len: int, sampler: Sampler | None = None,
        step_runner: PaddedStepRunner | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = block_size
        self.sampler = sampler or Sampler()
        self.step_runner = step_runner  # steps it serves run padded to buckets (None: all eager)
        self.grammar_masks = StepMasks(device)
        self._stager = request_stager(max_num_batched_tokens, max_num_seqs, cdiv(max_model_len, block_size),
                                      block_size, device)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens (warm-up, tests; the engine launches)."""
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, previous: InflightStep | None = None) -> InflightStep:
        """Enqueue the step (inputs, forward, logits, sampling) without waiting for the device.
        `previous`: the step in flight, whose sampled tokens are this step's pending input tokens."""
        if previous is not None:  # its sampling reads its logits: before this step's forward overwrites them
            enqueue_sampling(previous.sampled)
        chunks = scheduler_output.chunks
        prompt_logprobs = None
        scores_prompt = wants_prompt_logprobs(chunks)
        padded = self.step_runner is not None and not scores_prompt and self.step_runner.serves(chunks)
        if padded:
            # [n, vocab] float32, the sampling chunks'
            logits = self.step_runner.run(chunks, previous, scheduler_output.block_tables)
            # Steady decoding: every chunk samples, the list is the step's own.
            sampling_chunks = chunks if all(map(_sample, chunks)) else list(compress(chunks, map(_sample, chunks)))
        else:
            inputs = self.prepare_inputs(scheduler_output, previous)
            # [T, hidden]
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata, self.kv_cache)
            sampling_chunks = inputs.sampling_chunks
            logits = self.model.compute_logits(hidden[inputs.logits_indices]) if sampling_chunks else None
            if scores_prompt:
                prompt_logprobs = gather_prompt_logprobs(self.model, hidden, _ordered(chunks))
        if not sampling_chunks:
            return InflightStep(scheduler_output, [], None, prompt_logprobs)
        rows = list(map(_sampling_row, sampling_chunks))
        if not all(rows):  # a request's first sampled step makes its row
            rows = [row or sampling_row(chunk.request) for row, chunk in zip(rows, sampling_chunks)]
        # After the forward is enqueued: a worker fills the masks while the device runs it and this thread goes on.
        mask = self.grammar_masks.start(sampling_chunks, previous.token_of if previous is not None else None,
                                        logits.shape[1])
        if mask is None:
            # A padded step's tokens go straight into the static input ids, where the next step reads them.
            out = self.step_runner.buffers.sampled_ids(len(rows)) if padded else None
            sampled = self.sampler.sample(logits, rows, out=out)
        else:
            sampled = DeferredSample(self.sampler, logits, rows, mask)
        return InflightStep(scheduler_output, sampling_chunks, sampled, prompt_logprobs)

    def prepare_inputs(self, scheduler_output: SchedulerOutput,
                       previous: InflightStep | None = None) -> StepInputs:
        return self._stager.stage_requests(_ordered(scheduler_output.chunks), previous,
                                           scheduler_output.block_tables)


def _ordered(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """The chunks in the order an eager step lays out their rows: decodes (one token) first."""
    if sum(chunk.num_tokens for chunk in chunks) != len(chunks):  # not all decodes
        return sorted(chunks, key=lambda c: c.num_tokens != 1)  # stable
    return chunks


def sampling_row(request: Request) -> SamplingRow:
    """The request's SamplingRow, made once: it holds the live output list, so it stays current."""
    request.sampling_row = SamplingRow(params=request.params, prompt_token_ids=request.prompt_token_ids,
                                       output_token_ids=request.output_token_ids, generator=request.generator,
                                       token_counts=request.token_counts)
    return request.sampling_row

