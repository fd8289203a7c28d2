"""Sampler against hand computations and an independent pure-Python reference distribution."""

import math

import pytest
import torch

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.worker.sampler import Sampler, SamplingRow, apply_penalties, make_generator

# A 6-token distribution with no ties and no top-p boundary cases for the settings below.
BASE_PROBS = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]
BASE_LOGITS = torch.tensor([math.log(p) + 3.0 for p in BASE_PROBS])  # shifted: softmax ignores it


def row(params: SamplingParams, prompt=(), output=(), device="cpu") -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), make_generator(params, device))


def reference_probs(probs, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """The filtered, renormalized distribution, in plain Python: min-p, top-k, then top-p."""
    scaled = [math.exp(math.log(p) / temperature) for p in probs]
    scaled = [p / sum(scaled) for p in scaled]
    order = sorted(range(len(probs)), key=lambda i: -scaled[i])
    kept = [i for i in order if scaled[i] >= min_p * scaled[order[0]]]
    if top_k > 0:
        kept = kept[:top_k]
    total = sum(scaled[i] for i in kept)
    mass, final = 0.0, []
    for i in kept:
        if mass < top_p:
            final.append(i)
        mass += scaled[i] / total
    total = sum(scaled[i] for i in final)
    return [scaled[i] / total if i in final else 0.0 for i in range(len(probs))]


def frequencies(token_ids: list[int], vocab_size: int) -> list[float]:
    counts = torch.bincount(torch.tensor(token_ids), minlength=vocab_size)
    return (counts.double() / len(token_ids)).tolist()


def test_greedy_is_argmax_with_ties_to_lowest_id():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    logits[4] = 0.0
    logits[4, [7, 3, 30]] = 2.0
    out = Sampler().sample(logits, [row(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert out.token_ids[:4] == logits[:4].argmax(dim=-1).tolist()
    assert out.token_ids[4] == 3
    assert out.logprobs == [None] * 5


def test_tiny_temperature_is_greedy_and_caller_logits_untouched():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    before = logits.clone()
    params = SamplingParams(temperature=1e-7, top_p=0.5, repetition_penalty=1.3)
    out = Sampler().sample(logits, [row(params, prompt=[1, 2]) for _ in range(3)])
    assert out.token_ids == apply_penalties(logits, [row(params, prompt=[1, 2])] * 3).argmax(-1).tolist()
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_equals_greedy(temperature):
    torch.manual_seed(2)
    logits = torch.randn(16, 100)
    rows = [row(SamplingParams(temperature=temperature, top_k=1, seed=i if i % 2 else None)) for i in range(16)]
    assert Sampler().sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_seeded_rows_repeat_and_ignore_batch_composition():
    torch.manual_seed(3)
    logits = torch.randn(20, 64)  # one row of logits per step, fairly flat
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(batch_with_others: bool, seed_params=params) -> list[int]:
        target = row(seed_params)
        others = [row(SamplingParams(temperature=0.8, seed=7)), row(SamplingParams(temperature=1.2))]
        tokens = []
        for step in range(logits.shape[0]):
            if batch_with_others:
                batch = torch.stack([torch.randn(64), logits[step], torch.randn(64)])
                out = Sampler().sample(batch, [others[0], target, others[1]])
                tokens.append(out.token_ids[1])
            else:
                tokens.append(Sampler().sample(logits[step : step + 1], [target]).token_ids[0])
            target.output_token_ids.append(tokens[-1])
        return tokens

    alone = run(False)
    assert run(False) == alone
    assert run(True) == alone
    assert run(False, SamplingParams(temperature=1.0, top_p=0.95, seed=4321)) != alone
    assert make_generator(SamplingParams(), "cpu") is None


DISTRIBUTION_CASES = [
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.5, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.3},
    {"temperature": 1.3, "top_k": 5, "top_p": 0.8, "min_p": 0.1},
]


@pytest.mark.parametrize("settings", DISTRIBUTION_CASES)
def test_unseeded_distribution_matches_reference(settings):
    torch.manual_seed(4)
    draws = 20_000
    params = SamplingParams(**settings)
    rows = [SamplingRow(params, [], []) for _ in range(draws)]
    out = Sampler().sample(BASE_LOGITS.expand(draws, -1).contiguous(), rows)
    expected = reference_probs(BASE_PROBS, **settings)
    observed = frequencies(out.token_ids, len(BASE_PROBS))
    for p_obs, p_exp in zip(observed, expected):
        # 4.3 standard deviations of a frequency at p = 0.5 over 20k draws; filtered tokens never.
        assert abs(p_obs - p_exp) < 0.015 if p_exp > 0 else p_obs == 0.0


def test_seeded_distribution_matches_reference():
    settings = DISTRIBUTION_CASES[-1]
    draws = 4_000
    rows = [row(SamplingParams(seed=seed, **settings)) for seed in range(draws)]
    out = Sampler().sample(BASE_LOGITS.expand(draws, -1).contiguous(), rows)
    expected = reference_probs(BASE_PROBS, **settings)
    for p_obs, p_exp in zip(frequencies(out.token_ids, len(BASE_PROBS)), expected):
        assert abs(p_obs - p_exp) < 0.035 if p_exp > 0 else p_obs == 0.0


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3)
    both = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    presence_only = SamplingParams(temperature=0.0, presence_penalty=-1.0)
    rows = [
        row(both, prompt=[0, 1], output=[3, 3, 2]),
        row(SamplingParams(temperature=0.0), prompt=[0, 1], output=[3, 3, 2]),
        row(presence_only, prompt=[5], output=[4, 4]),
    ]
    # Row 0 -- repetition over {0,1,2,3}: 2/2, -1*2, .5/2, 3/2; then frequency/presence on output
    # counts {3: 2, 2: 1}: token 3: 1.5 - 0.5*2 - 0.25 = 0.25, token 2: 0.25 - 0.5 - 0.25 = -0.5.
    # Row 2 -- presence -1 on token 4 only (the prompt does not count): -2 + 1 = -1.
    expected = torch.tensor([
        [1.0, -2.0, -0.5, 0.25, -2.0, 1.0],
        [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        [2.0, -1.0, 0.5, 3.0, -1.0, 1.0],
    ])
    torch.testing.assert_close(apply_penalties(logits, rows), expected)
    # The penalized row's argmax moves from 3 to the tie 0/5 -> lowest id.
    assert Sampler().sample(logits, rows).token_ids == [0, 3, 3]


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives():
    torch.manual_seed(5)
    logits = torch.randn(4, 30) * 3
    rows = [
        row(SamplingParams(temperature=0.7, top_k=5, logprobs=5, frequency_penalty=1.0), output=[1, 2]),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams(temperature=1.0, logprobs=3, seed=9)),
    ]
    out = Sampler().sample(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == []
    for i, num_top in [(0, 5), (2, 0), (3, 3)]:
        entry = out.logprobs[i]
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(reference[i, entry.token_id].item(), abs=1e-5)
        expected_ids = reference[i].argsort(descending=True)[:num_top].tolist()
        assert [token for token, _ in entry.top] == expected_ids
        for token, value in entry.top:
            assert value == pytest.approx(reference[i, token].item(), abs=1e-5)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="does not match 2 rows"):
        Sampler().sample(torch.zeros(3, 10), [row(SamplingParams())] * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_and_filtered_sampling():
    logits = torch.randn(64, 32000, device="cuda")

    def run() -> list[int]:
        rows = [row(SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05, seed=i), device="cuda")
                for i in range(64)]
        return Sampler().sample(logits, rows).token_ids

    first = run()
    assert run() == first
    top50 = logits.topk(50, dim=-1).indices.cpu()
    assert all(token in top50[i].tolist() for i, token in enumerate(first))


def test_rows_that_change_between_calls_sample_by_their_own_parameters():
    """The sampler keeps its rows' facts while a call's rows are the same objects (core/engine/worker/sampling_batch.py);
    the same rows again, reordered, joined by a new one, or over another vocabulary must each still sample by
    their own parameters (hand-computed: a bias that forces token 3, a penalty, top-k 1, logprobs)."""
    bias = row(SamplingParams(temperature=0.0, logit_bias={3: 100.0}))
    top1 = row(SamplingParams(temperature=0.8, top_k=1, seed=7))
    penalized = row(SamplingParams(temperature=0.0, repetition_penalty=4.0), prompt=[5], output=[6])
    scored = row(SamplingParams(temperature=0.0, logprobs=1))
    plain = row(SamplingParams(temperature=0.0))

    def expected(r: SamplingRow, logits: torch.Tensor) -> int:
        if r is bias:
            return 3
        if r is penalized:
            logits = logits.clone()
            for token in (5, 6):
                logits[token] = logits[token] / 4.0 if logits[token] > 0 else logits[token] * 4.0
        return int(logits.argmax())

    sampler, generator = Sampler(), torch.Generator().manual_seed(0)
    for rows, vocab in [([bias, top1, penalized, scored], 50), ([bias, top1, penalized, scored], 50),
                        ([scored, penalized, bias], 50), ([plain, top1, bias], 50), ([penalized, bias, scored], 40)]:
        logits = torch.randn(len(rows), vocab, generator=generator)
        logits[:, 5:7] = 3.0 + torch.rand(len(rows), 2, generator=generator)  # the penalized tokens lead
        out = sampler.sample(logits, rows)
        assert out.token_ids == [expected(r, logits[i]) for i, r in enumerate(rows)]
        for i, r in enumerate(rows):
            if r is scored:
                assert out.logprobs[i].logprob == pytest.approx(
                    torch.log_softmax(logits[i], dim=-1)[out.token_ids[i]].item(), abs=1e-6)
            else:
                assert out.logprobs[i] is None


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tokens_written_into_a_reused_buffer_stay_each_calls_own(temperature):
    """`out` is the padded runner's input ids, overwritten by the next step: each call's token_ids are still its
    own, also for calls read only after more calls than the sampler keeps host slots for."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=temperature, top_k=3, seed=5)
    out = torch.full((8,), -1, dtype=torch.int64)
    sampler, outputs, expected = Sampler(), [], []
    for _ in range(7):
        logits = torch.randn(3, 50)
        rows = [row(params) for _ in range(3)]
        reference = Sampler().sample(logits, [row(params) for _ in range(3)]).token_ids
        result = sampler.sample(logits, rows, out=out[:3])
        assert result.sampled.data_ptr() == out.data_ptr() and out[:3].tolist() == reference
        out.fill_(-1)  # the next step's inputs overwrite the buffer
        outputs.append(result)
        expected.append(reference)
    assert [result.token_ids for result in outputs] == expected
