"""Sampler: turns one step's logits (one row per request) into next tokens, batched on the device.

Per row, in this order (vLLM v1's order):
  0. constrained rows (structured outputs): tokens their grammar forbids get -inf
     (core/structured/step_mask.py builds the mask);
  0. logit_bias (OpenAI's): each listed token's bias is added to its logit (a masked token stays -inf);
  1. penalties on the raw logits: repetition (HF/CTRL: over prompt + output tokens, a positive
     logit is divided by the penalty, a negative one multiplied), then frequency and presence
     (OpenAI: `logit -= frequency * count + presence * (count > 0)` over output tokens);
  2. greedy rows (temperature below 1e-5) take the argmax; ties go to the lowest token id;
  3. other rows: divide by temperature; min-p drops tokens whose probability is below
     `min_p * max_probability`; top-k keeps the k most likely; top-p keeps the smallest
     most-likely prefix whose mass (renormalized after min-p and top-k) reaches top_p;
  4. draw by an exponential race: `argmax(probs / noise)` with noise ~ Exp(1), which picks
     token i with probability probs[i].

Logprobs are those of the model's raw distribution, `log_softmax(logits)` before penalties,
temperature and filtering (vLLM's default "raw_logprobs"; after a grammar's mask, as in vLLM): the
chosen token's and the top `params.logprobs` alternatives, best first.

Seeded requests: `make_generator(params, device)` makes the request's torch.Generator; the engine
keeps it with the request for its whole life (also across preemption and recompute, which never
resample a token already in the history). The sampler draws exactly one noise vector from it per
call in which the row is sampled (not for greedy rows), so a request's n-th token depends only on
its own logits and its seed, whatever else is in the batch. Pass a row only when its token will be
kept; if a row's token is to be discarded (e.g. a partial prefill chunk), save `generator.get_state()`
before and restore it after. For `n > 1` give each sample its own seed (`seed + index`, as vLLM).
(With async scheduling a request that finishes on its token's value may be sampled once more in the
step already launched; that token is discarded, and no kept token depends on the draw.)

Host transfers: `sample` never waits for the device, so the engine can launch it and go on (async
scheduling). It returns a SamplerOutput whose `sampled` ids stay on the device (the next step's
inputs read them there; `out` puts them where those inputs are) while a copy to pinned host memory
runs in the background (a few pinned buffers and events reused in turn, core/engine/worker/transfers.py),
the logprobs of the rows that asked for them in the same way; `token_ids` / `logprobs` wait for that
copy when first read. Greedy batches take one argmax: no sort, no draw. The per-row parameters go
host->device in small non-blocking copies, made once per batch of rows: while a call's rows are the
same objects as the last call's (steady decoding), their facts and device tensors are reused
(core/engine/worker/sampling_batch.py).

Penalties count a row's tokens on the device (core/engine/worker/token_counts.py): a row that carries its
request's TokenCounts is penalized by them, and the token drawn for it is added to them before
`sample` returns, so the next step's penalties see it while its value is still on its way to the
host (async scheduling). A row without one is counted from its host lists.

A row whose sampling raises fails alone: when the batched call raises, the seeded rows' generators
are put back and every row is sampled again by itself; a row that raises then gets token 0 and its
error in `failures` (the engine fails that request), the others get the tokens they would have got
in a batch without it (a row's token depends only on its own logits, parameters and generator).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cached_property

import torch

from deepinfer.core.engine.frontend.outputs import TokenLogprob
from deepinfer.core.engine.sampling_params import LogitBias, SamplingParams
from deepinfer.core.engine.worker.sampling_batch import SamplingBatch
from deepinfer.core.engine.worker.token_counts import PenaltyBatch, TokenCounts
from deepinfer.core.engine.worker.transfers import HostCopy, HostSlots, SlotCopy, to_device
from deepinfer.core.structured.step_mask import GrammarMask, apply_grammar_mask

logger = logging.getLogger(__name__)

@dataclass(eq=False)
class SamplingRow:
    """One row of the logits: the request's parameters and token history. Compared by identity: a
    SamplingBatch is reused while a call's rows are the same objects."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # on the host so far (a pending token of the step in flight is not)
    generator: torch.Generator | None = None  # from make_generator; None for unseeded requests
    # The request's counts on the device (penalized rows); None: counted from the two lists above.
    token_counts: TokenCounts | None = None

    def __post_init__(self) -> None:
        self.params = self.params.resolved()  # fields left to the model's defaults: the built-in values


class SamplerOutput:
    """One call's tokens: `sampled` on the device at once, `token_ids` and `logprobs` on the host
    when first read (waiting for the copy started at construction)."""

    def __init__(self, sampled: torch.Tensor, logprob_table: torch.Tensor | None,
                 num_top: list[int | None], token_copy: SlotCopy | None = None) -> None:
        """sampled: [N] int64; logprob_table: [L, 2 + 2K] float64 for the L rows whose num_top is
        not None (see `_logprob_table`); num_top: [N], each row's params.logprobs; token_copy: the copy of
        `sampled` to the host, already started (None: started here)."""
        self.sampled = sampled
        self.failures: dict[int, str] = {}  # row -> error, for rows whose sampling raised
        self.has_logprobs = logprob_table is not None  # whether a row asked for logprobs
        self._num_top = num_top
        self._tokens = token_copy if token_copy is not None else HostCopy([sampled])
        self._table = None if logprob_table is None else HostCopy([logprob_table])

    @cached_property
    def token_ids(self) -> list[int]:
        """[N], one per row."""
        return self._tokens.get()[0].tolist()

    @cached_property
    def logprobs(self) -> list[TokenLogprob | None]:
        """[N]; None for rows whose params.logprobs is None."""
        logprobs: list[TokenLogprob | None] = [None] * len(self._num_top)
        if self._table is None:
            return logprobs
        table = self._table.get()[0].tolist()
        max_top = (len(table[0]) - 2) // 2
        rows = [i for i, num_top in enumerate(self._num_top) if num_top is not None]
        for row, values in zip(rows, table):
            top = [(int(values[2 + max_top + j]), values[2 + j]) for j in range(self._num_top[row])]
            logprobs[row] = TokenLogprob(token_id=int(values[0]), logprob=values[1], top=top)
        return logprobs


class RowwiseSamplerOutput:
    """The tokens of a batch sampled row by row (some rows failed): what SamplerOutput gives, from
    one SamplerOutput per row (None for a failed row, whose token is 0)."""

    def __init__(self, rows: list[SamplerOutput | None], failures: dict[int, str], device: torch.device) -> None:
        self._rows = rows
        self.failures = failures
        self.has_logprobs = any(row is not None and row.has_logprobs for row in rows)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        self.sampled = torch.cat([zero if row is None else row.sampled for row in rows])  # [N]

    @cached_property
    def token_ids(self) -> list[int]:
        return [0 if row is None else row.token_ids[0] for row in self._rows]

    @cached_property
    def logprobs(self) -> list[TokenLogprob | None]:
        return [None if row is None else row.logprobs[0] for row in self._rows]


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's random generator, seeded from params.seed; None when it has no seed.

    `device` must be the device the logits will be on (a CUDA generator cannot fill CPU noise).
    """
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


class Sampler:
    def __init__(self) -> None:
        self._batch: SamplingBatch | None = None  # the last call's rows' facts, reused while they stay the same
        self._token_slots: HostSlots | None = None  # where the sampled tokens are copied back to the host

    def _copy_to_host(self, token_ids: torch.Tensor) -> SlotCopy:
        slots = self._token_slots
        if slots is None or slots.device != token_ids.device:
            slots = self._token_slots = HostSlots(torch.int64, token_ids.device)
        return slots.copy(token_ids)

    def _batch_of(self, rows: list[SamplingRow], logits: torch.Tensor) -> SamplingBatch:
        batch = self._batch
        if batch is None or not batch.serves(rows, logits.device, logits.shape[1]):
            batch = self._batch = SamplingBatch(rows, logits.device, logits.shape[1])
        return batch

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], grammar_mask: GrammarMask | None = None,
               out: torch.Tensor | None = None) -> SamplerOutput | RowwiseSamplerOutput:
        """logits: [N, V] float32, row i belongs to rows[i]. The caller's tensor is not modified, except by
        grammar_mask: the token masks of the constrained rows (None when there are none), which set the
        disallowed tokens of float32 logits to -inf in place (the runner's logits are the step's own).
        out: [N] int64 on the logits' device, where the tokens are written (the `sampled` of the result;
        the padded runner's next input ids), or None for a fresh tensor.
        A row whose sampling raises fails alone (see the module docstring)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"sampler: logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        if grammar_mask is not None:
            logits = _float32(logits)
            apply_grammar_mask(logits, grammar_mask)
        # The seeded rows' generators, to put back if the batched call raises (from the batch: no loop per row).
        states = [(generator, generator.get_state()) for generator in self._batch_of(rows, logits).generators]
        try:
            return self._sample_batch(logits, rows, out)
        except Exception:  # whatever one row's parameters made fail, the others go on
            logger.warning("sampling a batch of %d rows failed; sampling them one by one", len(rows), exc_info=True)
        for generator, state in states:  # the failed call may have drawn from them
            generator.set_state(state)
        outputs: list[SamplerOutput | None] = []
        failures: dict[int, str] = {}
        for index, row in enumerate(rows):
            try:
                outputs.append(self._sample_batch(logits[index:index + 1], [row]))
            except Exception as err:  # noqa: BLE001 - this row fails alone
                outputs.append(None)
                failures[index] = f"sampling failed: {type(err).__name__}: {err}"
        return RowwiseSamplerOutput(outputs, failures, logits.device)

    def _sample_batch(self, logits: torch.Tensor, rows: list[SamplingRow],
                      out: torch.Tensor | None = None) -> SamplerOutput:
        logits = _float32(logits)
        batch = self._batch_of(rows, logits)
        logprob_index = batch.logprob_index
        raw_logprobs = None  # [L, V]
        if batch.logprob_rows:
            chosen_logits = logits if logprob_index is None else logits.index_select(0, logprob_index)
            raw_logprobs = torch.log_softmax(chosen_logits, dim=-1)

        logits = _add_logit_bias(logits, rows, batch.biased)
        logits, penalized = _penalize(logits, rows, batch)
        if batch.all_greedy:  # no sort, no draw
            token_ids = logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)  # [N]
        else:
            token_ids = _sample_random(logits, batch)
            if out is not None:
                token_ids = out.copy_(token_ids)

        table = None
        if raw_logprobs is not None:
            chosen_ids = token_ids if logprob_index is None else token_ids.index_select(0, logprob_index)
            table = _logprob_table(raw_logprobs, chosen_ids, batch.max_top)
        if penalized is not None:  # last: a call that raised has counted nothing
            penalized.add(token_ids)
        return SamplerOutput(token_ids, table, batch.num_top, self._copy_to_host(token_ids))


def _float32(logits: torch.Tensor) -> torch.Tensor:
    """The logits as float32: themselves when they are (a dtype check costs no torch call)."""
    return logits if logits.dtype == torch.float32 else logits.float()


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Returns new logits [N, V] with each row's logit_bias added; the same tensor when no row has one.
    The biases are added with one indexed add of the rows' dense bias rows (`logit_bias_row`), so a
    step costs the same for one biased token as for the whole vocabulary."""
    return _add_logit_bias(logits, rows, [i for i, row in enumerate(rows) if row.params.logit_bias])


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], biased: list[int]) -> torch.Tensor:
    """`apply_logit_bias` for the rows `biased` (those with a bias)."""
    if not biased:
        return logits
    device, width = logits.device, logits.shape[1]
    bias_rows = [logit_bias_row(rows[i].params.logit_bias, width, device) for i in biased]
    bias_rows = bias_rows[0].unsqueeze(0) if len(bias_rows) == 1 else torch.stack(bias_rows)  # [B, V]
    if len(biased) == len(rows):
        return logits + bias_rows
    return logits.index_add(0, to_device(biased, torch.int64, device), bias_rows)


def logit_bias_row(logit_bias: LogitBias, width: int, device: torch.device) -> torch.Tensor:
    """The request's bias as a dense float32 row [width] on `device`: made at its first sampled step,
    then kept in `logit_bias.device_rows` for the request's life (its samples share it)."""
    key = (device, width)
    row = logit_bias.device_rows.get(key)
    if row is None:
        token_ids = to_device(list(logit_bias.keys()), torch.int64, device)  # [B]
        biases = to_device(list(logit_bias.values()), torch.float32, device)  # [B]
        row = torch.zeros(width, dtype=torch.float32, device=device).index_put_((token_ids,), biases)
        logit_bias.device_rows[key] = row
    return row


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Returns new logits [N, V] with the penalties applied to the rows that have any."""
    return _penalize(logits, rows, SamplingBatch(rows, logits.device, logits.shape[1]))[0]


def _penalize(logits: torch.Tensor, rows: list[SamplingRow],
              sampling: SamplingBatch) -> tuple[torch.Tensor, PenaltyBatch | None]:
    """(new logits [N, V] with the penalties applied, the penalized rows' counts) or (logits, None)."""
    penalized = sampling.penalized
    if not penalized:
        return logits, None
    device, vocab_size = logits.device, logits.shape[1]
    batch = PenaltyBatch.gather(penalized, [rows[i].token_counts for i in penalized],
                                [rows[i].prompt_token_ids for i in penalized],
                                [rows[i].output_token_ids for i in penalized], vocab_size, device)
    factors = sampling.penalty_factors()  # [P, 3]: repetition, frequency, presence
    output_counts = batch.output  # [P, V]
    sub = logits[batch.index]  # [P, V]
    if sampling.any_repetition_penalty():
        repetition = factors[:, 0:1]
        penalized_sub = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(batch.seen, penalized_sub, sub)
    sub = sub - factors[:, 1:2] * output_counts - factors[:, 2:3] * (output_counts > 0).float()
    return logits.index_copy(0, batch.index, sub), batch


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[N] int64 token ids: random draws for non-greedy rows, argmax for greedy ones."""
    settings = batch.random_settings()  # [N, 5], see SamplingBatch.random_settings
    scaled = logits / settings[:, 0:1]  # [N, V]

    if batch.any_min_p:
        # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p); no softmax needed.
        too_unlikely = scaled - scaled.max(dim=-1, keepdim=True).values < settings[:, 3:4]
        scaled = scaled.masked_fill(too_unlikely, -math.inf)
    if batch.uses_top_p or batch.uses_top_k:
        scaled = _apply_top_k_top_p(scaled, settings[:, 2], settings[:, 1] if batch.uses_top_p else None)

    probs = torch.softmax(scaled, dim=-1)  # [N, V]
    noise = torch.empty_like(probs).exponential_()
    for i, generator in batch.seeded:
        noise[i].exponential_(generator=generator)
    # Exp(1) draws can round to 0 in float32; a zero would turn a masked 0/0 into NaN.
    sampled = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)  # [N]
    if batch.any_greedy:
        sampled = torch.where(settings[:, 4] > 0, logits.argmax(dim=-1), sampled)
    return sampled


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks scaled logits [N, V] outside top-k ([N]), then outside top-p ([N]) of what is left; one sort."""
    sorted_logits, sorted_index = scaled.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    rank = torch.arange(scaled.shape[1], device=scaled.device)  # [V]
    outside = rank[None, :] >= top_k[:, None]  # [N, V], sorted order
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits.masked_fill(outside, -math.inf), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V]
        # Rows with top_p == 1 are skipped: float rounding can push mass_before above 1.
        outside |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    outside_by_token = torch.empty_like(outside).scatter_(1, sorted_index, outside)
    return scaled.masked_fill(outside_by_token, -math.inf)


def _logprob_table(raw_logprobs: torch.Tensor, chosen_ids: torch.Tensor, max_top: int) -> torch.Tensor:
    """raw_logprobs [L, V], chosen_ids [L] -> [L, 2 + 2 * max_top] float64 rows: chosen id, its
    logprob, the top max_top logprobs (best first), their ids. One table, so one device->host copy;
    float64 holds the float32 logprobs and the token ids exactly."""
    chosen = raw_logprobs.gather(1, chosen_ids[:, None])  # [L, 1]
    top_values, top_ids = raw_logprobs.topk(max_top, dim=-1)  # [L, K], best first
    return torch.cat([t.double() for t in (chosen_ids[:, None], chosen, top_values, top_ids)], dim=1)
