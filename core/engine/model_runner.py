"""ModelRunner: owns the tensors of a step. SchedulerOutput in, sampled tokens out.

`launch(scheduler_output, previous)` enqueues a whole step on the device and returns an
InflightStep (core/engine/inflight.py) without waiting for it; `execute` launches and waits.
Per step:
1. `prepare_inputs` orders the chunks decodes first (query length 1, what AttentionMetadata
   expects), then fills host buffers (pinned on CUDA, allocated once at the largest step size)
   with input ids, positions, slot mapping, block tables, and copies them to the device
   non_blocking. All input preparation lives here, so persistent device buffers (CUDA graphs)
   can be added in one place. A decode whose input token is still pending (sampled by the
   `previous` step, in flight: async scheduling) gets it on the device, scattered from that
   step's sampled tokens into the copied input ids.
2. `model.forward` over the flat batch; the hidden rows of each sampling chunk's last token go
   through `compute_logits` (a prefill chunk that stops short of the prompt's end samples nothing).
3. Constrained rows (structured outputs) get their token masks, computed on the host while the
   device runs the forward (core/structured/step_mask.py).
4. The sampler draws one token per sampling chunk on the device and starts copying the tokens
   (and logprobs) to the host; `InflightStep.result` waits for that copy, the step's one sync.

Steps that fit a token bucket (decodes, and mixed or prefill steps whose per-token attention stays
cheap) can instead go to a PaddedStepRunner (core/engine/cuda_graphs.py), which pads them to a
bucket and replays a CUDA graph ("graphs") or runs the padded step eagerly ("padded"); the others
run eagerly as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.core.attention.metadata import AttentionMetadata
from deepinfer.core.engine.cuda_graphs import PaddedStepRunner
from deepinfer.core.engine.inflight import InflightStep, fill_pending_tokens, stage_pending_tokens
from deepinfer.core.engine.request import Request
from deepinfer.core.engine.sampler import Sampler, SamplingRow
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.scheduler_output import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from deepinfer.core.kv.cache import KVCache
from deepinfer.core.kv.kv_manager import cdiv
from deepinfer.core.structured.step_mask import step_grammar_mask


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: hidden rows whose logits are sampled
    sampling_chunks: list[ScheduledChunk]  # [N], the requests of those rows, same order


class _HostBuffers:
    """Host staging tensors sized for the largest step, with numpy views for fast filling."""

    def __init__(self, max_tokens: int, max_requests: int, max_blocks: int, pin: bool) -> None:
        def make(shape, dtype):
            tensor = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return tensor, tensor.numpy()

        # The input ids, then room for the fill index of pending tokens (inflight.stage_pending_tokens).
        self.input_ids, self.input_ids_np = make(max_tokens + 2 * max_requests, torch.int64)
        self.positions, self.positions_np = make(max_tokens, torch.int64)
        self.slot_mapping, self.slot_mapping_np = make(max_tokens, torch.int64)
        self.query_start_loc, self.query_start_loc_np = make(max_requests + 1, torch.int32)
        self.seq_lens, self.seq_lens_np = make(max_requests, torch.int32)
        self.logits_indices, self.logits_indices_np = make(max_requests, torch.int64)
        self.block_tables, self.block_tables_np = make((max_requests, max_blocks), torch.int32)


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
        self._host = _HostBuffers(max_num_batched_tokens, max_num_seqs, cdiv(max_model_len, block_size),
                                  pin=device.type == "cuda")
        # Set after each step's host->device copies; refilling the host buffers waits for it, since a
        # step that samples nothing has no sync that would order the copies before the next fill.
        self._inputs_copied = torch.cuda.Event() if device.type == "cuda" else None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens (warm-up, tests; the engine launches)."""
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, previous: InflightStep | None = None) -> InflightStep:
        """Enqueue the step (inputs, forward, logits, sampling) without waiting for the device.
        `previous`: the step in flight, whose sampled tokens are this step's pending input tokens."""
        chunks = scheduler_output.chunks
        if self.step_runner is not None and self.step_runner.serves(chunks):
            logits = self.step_runner.run(chunks, previous)  # [n, vocab] float32, the sampling chunks'
            sampling_chunks = [chunk for chunk in chunks if chunk.sample]
        else:
            inputs = self.prepare_inputs(scheduler_output, previous)
            # [T, hidden]
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata, self.kv_cache)
            sampling_chunks = inputs.sampling_chunks
            logits = self.model.compute_logits(hidden[inputs.logits_indices]) if sampling_chunks else None
        if not sampling_chunks:
            return InflightStep(scheduler_output, [], None)
        rows = [sampling_row(chunk.request) for chunk in sampling_chunks]
        # After the forward is enqueued: the host fills the masks while the device runs it.
        grammar_mask = step_grammar_mask(sampling_chunks, previous, logits.shape[1], self.device)
        return InflightStep(scheduler_output, sampling_chunks, self.sampler.sample(logits, rows, grammar_mask))

    def prepare_inputs(self, scheduler_output: SchedulerOutput,
                       previous: InflightStep | None = None) -> StepInputs:
        chunks = sorted(scheduler_output.chunks, key=lambda c: c.num_tokens != 1)  # stable: decodes first
        host, bs = self._host, self.block_size
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        num_requests = len(chunks)
        num_decodes = sum(1 for c in chunks if c.num_tokens == 1)
        max_blocks = max(cdiv(c.seq_len, bs) for c in chunks)
        host.block_tables_np[:num_requests, :max_blocks] = 0
        query_lens, seq_lens, sampling_chunks = [], [], []
        pending: list[tuple[int, str]] = []  # (input row, request id) of pending input tokens
        token = 0
        host.query_start_loc_np[0] = 0
        for i, chunk in enumerate(chunks):
            start, n = chunk.start_pos, chunk.num_tokens
            table = chunk.block_table[:cdiv(start + n, bs)]
            host.block_tables_np[i, :len(table)] = table
            if n == 1:
                if start < chunk.request.num_tokens:
                    host.input_ids_np[token] = chunk.request.all_token_ids[start]
                else:  # the previous step samples it: filled on the device below
                    pending.append((token, chunk.request_id))
                host.positions_np[token] = start
                host.slot_mapping_np[token] = table[start // bs] * bs + start % bs
            else:
                positions = np.arange(start, start + n)
                host.input_ids_np[token:token + n] = chunk.token_ids
                host.positions_np[token:token + n] = positions
                slots = np.asarray(table)[positions // bs] * bs + positions % bs
                host.slot_mapping_np[token:token + n] = slots
            token += n
            host.query_start_loc_np[i + 1] = token
            host.seq_lens_np[i] = start + n
            query_lens.append(n)
            seq_lens.append(start + n)
            if chunk.sample:
                host.logits_indices_np[len(sampling_chunks)] = token - 1
                sampling_chunks.append(chunk)

        metadata = AttentionMetadata(
            slot_mapping=self._to_device(host.slot_mapping[:token]),
            query_start_loc=self._to_device(host.query_start_loc[:num_requests + 1]),
            seq_lens=self._to_device(host.seq_lens[:num_requests]),
            block_tables=self._to_device(host.block_tables[:num_requests, :max_blocks]),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        num_index = stage_pending_tokens(host.input_ids_np[token:], pending, previous)
        ids_and_index = self._to_device(host.input_ids[:token + num_index])  # one copy for both
        if num_index:
            fill_pending_tokens(ids_and_index[:token], ids_and_index[token:], previous)
        inputs = StepInputs(
            input_ids=ids_and_index[:token],
            positions=self._to_device(host.positions[:token]),
            attn_metadata=metadata,
            logits_indices=self._to_device(host.logits_indices[:len(sampling_chunks)]),
            sampling_chunks=sampling_chunks,
        )
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return inputs

    def _to_device(self, host_tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_tensor.clone()  # the host buffers are refilled next step
        return host_tensor.to(self.device, non_blocking=True)


def sampling_row(request: Request) -> SamplingRow:
    return SamplingRow(params=request.params, prompt_token_ids=request.prompt_token_ids,
                       output_token_ids=request.output_token_ids, generator=request.generator)


def warmup_requests(num_tokens: int, max_num_seqs: int, block_size: int,
                    max_model_len: int) -> tuple[SchedulerOutput, int]:
    """The largest step the engine will run: `num_tokens` tokens from max_num_seqs requests, a prefill
    chunk that ends a `max_model_len`-long context (attention's costliest case) plus single-token
    requests, all sampling with top-k/top-p (the sampler's costliest path).
    -> (step, blocks its scratch cache needs).

    The long context costs no memory of its own: its block table cycles over the few blocks the
    chunk writes, so the scratch cache holds only about `num_tokens` tokens.
    """
    num_requests = max(1, min(max_num_seqs, num_tokens))
    prefill_len = num_tokens - (num_requests - 1)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
    context_len = max(prefill_len, max_model_len)
    num_prefill_blocks = cdiv(prefill_len, block_size) + 1  # the chunk may straddle one more block
    prefill_table = [i % num_prefill_blocks for i in range(cdiv(context_len, block_size))]
    prefill = Request("warmup-0", [0] * context_len, params)
    out = SchedulerOutput(num_batched_tokens=num_tokens)
    start = context_len - prefill_len
    out.chunks.append(ScheduledChunk(prefill, start, prefill_len, prefill_table, sample=True))
    for i in range(1, num_requests):
        decode = Request(f"warmup-{i}", [0], params)
        out.chunks.append(ScheduledChunk(decode, 0, 1, [num_prefill_blocks + i - 1], sample=True))
    return out, num_prefill_blocks + num_requests - 1
