"""Grammars without a model: compiled constraints on SmolLM2's real vocabulary (49152 tokens).

References are independent of llguidance: jsonschema validates, hypothesis-jsonschema writes valid
instances, Python's `re` matches, and the allowed tokens of a choice are worked out by decoding
every token. Soundness is checked by random walks: tokens drawn at random among those the mask
allows, until the end token; whatever comes out must parse and validate.
"""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from deepinfer.core.structured.compiler import GrammarCompiler, GrammarError
from deepinfer.core.structured.params import MAX_CONSTRAINT_CHARS, StructuredOutputsParams
from deepinfer.core.structured.step_mask import GrammarMask, apply_grammar_mask
from deepinfer.core.tokenizer import ByteTokenizer, Tokenizer

VOCAB = 49152


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf):
    return Tokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def compiler(smol_tokenizer):
    return GrammarCompiler(smol_tokenizer, VOCAB, smol_tokenizer.eos_token_ids)


def allowed_tokens(matcher) -> torch.Tensor:
    """[V] bool: the tokens the matcher's next mask allows (llguidance's own bitmask, unpacked)."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:VOCAB].bool()


def random_walk(compiler, params, tokenizer, seed: int, max_steps: int = 400) -> tuple[str, bool]:
    """Draw tokens uniformly among the allowed ones until an end token -> (text, ended)."""
    rng = random.Random(seed)
    grammar = compiler.compile(params).new_request_grammar()
    eos = sorted(tokenizer.eos_token_ids)
    output: list[int] = []
    for _ in range(max_steps):
        allowed = allowed_tokens(grammar.matcher).nonzero().flatten().tolist()
        token = rng.choice(allowed)
        if token in eos:
            return tokenizer.decode(output), True
        output.append(token)
        grammar.catch_up(output)
    return tokenizer.decode(output), False


def accepts(compiler, params, tokenizer, text: str) -> bool:
    """Whether the grammar takes the tokenized text and then an end token."""
    grammar = compiler.compile(params).new_request_grammar()
    tokens = tokenizer.encode(text, add_special_tokens=False) + [min(tokenizer.eos_token_ids)]
    for i in range(len(tokens)):
        if not allowed_tokens(grammar.matcher)[tokens[i]]:
            return False
        grammar.catch_up(tokens[:i + 1])
    return grammar.is_stopped


# Schemas whose every instance is short (bounded strings, arrays and integers), all properties
# required and in order, so an instance written in schema order is what the grammar must take.
_scalar = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
              st.integers(1, 4), st.integers(0, 4)),
    st.just({"type": "string", "pattern": "^[a-z]{1,6}-[0-9]{2}$"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text("abcxyz ", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}),
    st.integers(0, 9).map(lambda v: {"const": v}),
)
_names = st.lists(st.text("abcdefghij_", min_size=1, max_size=6), min_size=1, max_size=3, unique=True)


def _extend(children):
    objects = st.builds(
        lambda names, values: {"type": "object", "properties": dict(zip(names, values)), "required": names,
                               "additionalProperties": False},
        _names, st.lists(children, min_size=3, max_size=3))
    arrays = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children,
                       st.integers(0, 3))
    nullable = children.map(lambda s: {"anyOf": [s, {"type": "null"}]})
    return st.one_of(objects, arrays, nullable)


SCHEMAS = st.recursive(_scalar, _extend, max_leaves=6)


def in_schema_order(value, schema):
    """The instance with its object keys in the schema's property order (the order the grammar writes)."""
    if isinstance(value, dict) and "properties" in schema:
        return {k: in_schema_order(value[k], schema["properties"][k]) for k in schema["properties"] if k in value}
    if isinstance(value, list) and "items" in schema:
        return [in_schema_order(v, schema["items"]) for v in value]
    if isinstance(value, dict) and "anyOf" in schema:
        return in_schema_order(value, schema["anyOf"][0])
    if isinstance(value, list) and "anyOf" in schema:
        return in_schema_order(value, schema["anyOf"][0])
    return value


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema=SCHEMAS, data=st.data())
def test_random_schemas_accept_their_valid_instances_and_walks_validate(compiler, smol_tokenizer, schema, data):
    params = StructuredOutputsParams(json=schema)
    instance = data.draw(from_schema(schema))
    jsonschema.validate(instance, schema)
    text = dumps(in_schema_order(instance, schema))
    # SmolLM2's vocabulary lacks some byte tokens (it cannot write U+40000, say): such text cannot be the
    # model's output, so it says nothing of the grammar.
    assume(smol_tokenizer.decode(smol_tokenizer.encode(text, add_special_tokens=False)) == text)
    assert accepts(compiler, params, smol_tokenizer, text), text

    walk, ended = random_walk(compiler, params, smol_tokenizer, seed=data.draw(st.integers(0, 2**16)))
    assert ended, walk
    jsonschema.validate(json.loads(walk), schema)


@pytest.mark.parametrize("schema, invalid", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}, {"a": 1, "b": 2}),
    ({"enum": ["red", "green"]}, "blue"),
    ({"type": "string", "maxLength": 3}, "abcd"),
    ({"type": "string", "pattern": "^[a-z]+-[0-9]+$"}, "AB-12"),
    ({"type": "integer", "minimum": 1, "maximum": 9}, 10),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2, 3]),
    ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "x"),
    ({"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}, ["x"]),
])
def test_invalid_instances_are_refused(compiler, smol_tokenizer, schema, invalid):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(invalid, schema)
    assert not accepts(compiler, StructuredOutputsParams(json=schema), smol_tokenizer, dumps(invalid))


def test_regex_walks_match_and_json_object_walks_are_objects(compiler, smol_tokenizer):
    pattern = r"(yes|no) \(confidence: 0\.[0-9]{2}\)"
    for seed in range(3):
        text, ended = random_walk(compiler, StructuredOutputsParams(regex=pattern), smol_tokenizer, seed)
        assert ended and re.fullmatch(pattern, text), text
    text, ended = random_walk(compiler, StructuredOutputsParams(json_object=True), smol_tokenizer, 0, max_steps=60)
    if ended:
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_gbnf_and_lark_grammars(compiler, smol_tokenizer):
    gbnf = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    for grammar in (gbnf, lark):
        params = StructuredOutputsParams(grammar=grammar)
        assert accepts(compiler, params, smol_tokenizer, "The answer is no.")
        assert not accepts(compiler, params, smol_tokenizer, "The answer is maybe.")


def test_choice_mask_is_the_tokens_that_start_a_choice(compiler, smol_tokenizer):
    """Reference: decode every token; it is allowed first iff its text is a prefix of a choice."""
    choices = ["Paris", "Pari is", "London"]
    grammar = compiler.compile(StructuredOutputsParams(choice=choices)).new_request_grammar()
    allowed = allowed_tokens(grammar.matcher)
    hf = smol_tokenizer.hf_tokenizer
    special = set(hf.all_special_ids)
    expected = torch.zeros(VOCAB, dtype=torch.bool)
    for token in range(len(hf)):
        text = hf.decode([token])
        if token not in special and text and "\ufffd" not in text and any(c.startswith(text) for c in choices):
            expected[token] = True
    assert allowed.sum() > 3
    assert torch.equal(allowed, expected)


def test_apply_grammar_mask_matches_a_loop_in_place():
    torch.manual_seed(0)
    vocab, rows = 70, [3, 0]  # 70 ids: the last word is partly padding
    logits = torch.randn(5, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32)
    expected = logits.clone()
    for k, row in enumerate(rows):
        for token in range(vocab):
            word = int(bitmask[k, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_grammar_mask(logits, GrammarMask(torch.tensor(rows, dtype=torch.int32), bitmask))
    assert torch.equal(logits, expected)  # rows 1, 2 and 4 untouched


def test_byte_vocabulary_of_dummy_models():
    tokenizer = ByteTokenizer(400)
    compiler = GrammarCompiler(tokenizer, 400, tokenizer.eos_token_ids)
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "yz"]}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99}},
              "required": ["k", "n"]}
    grammar = compiler.compile(StructuredOutputsParams(json=schema)).new_request_grammar()
    rng, output = random.Random(0), []
    while True:
        allowed = allowed_tokens_of(grammar.matcher, 400)
        assert all(t < 257 for t in allowed)  # bytes, or the end token
        token = rng.choice(allowed)
        if token == 256:
            break
        output.append(token)
        grammar.catch_up(output)
    jsonschema.validate(json.loads(bytes(output)), schema)


def allowed_tokens_of(matcher, vocab: int) -> list[int]:
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:vocab]
    return bits.nonzero().flatten().tolist()


@pytest.mark.parametrize("params, message", [
    ({"json": {"type": "object", "properties": {"a": {"type": "wrong"}}}}, "json"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "uniqueItems"),
    ({"regex": "(?=look)ahead"}, "look"),
    ({"regex": "[a-"}, "unclosed"),
    ({"grammar": "root ::= missing_rule"}, "grammar"),
])
def test_bad_constraints_raise_the_engines_message(compiler, params, message):
    with pytest.raises(GrammarError, match=message):
        compiler.compile(StructuredOutputsParams(**params))


def test_non_strict_schemas_ignore_keywords_the_engine_cannot_enforce(compiler, smol_tokenizer):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "uniqueItems": True}
    params = StructuredOutputsParams(json=schema, strict=False)
    assert accepts(compiler, params, smol_tokenizer, "[1, 2]")


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "non-empty"),
    ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "at most"),
    ({"json": {"enum": ["x" * MAX_CONSTRAINT_CHARS]}}, "at most"),
])
def test_params_refuse_what_cannot_be_a_constraint(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_pathological_patterns_end_at_the_engines_limits(compiler):
    """Each is refused at compile (lexer limits) or its masks stay within the per-step fuel; none hangs."""
    for regex in ["(a|aa)*(b|bb)*" * 200, "[a-z]{1000}{1000}", "((x+x+)+y){50}"]:
        try:
            grammar = compiler.compile(StructuredOutputsParams(regex=regex)).new_request_grammar()
        except GrammarError:
            continue
        for _ in range(3):
            grammar.matcher.compute_bitmask()


def test_a_grammar_too_costly_per_token_is_refused(compiler):
    """One literal of 60k characters: about 200 ms per mask here, several times the limit on any CPU."""
    with pytest.raises(GrammarError, match="too costly"):
        compiler.compile(StructuredOutputsParams(regex="a" * 60_000))


def test_compile_timeout_and_cancellation(compiler, monkeypatch):
    import asyncio

    def slow_build(params):
        time.sleep(1.0)
        raise AssertionError("a timed-out compile must not be waited for")

    monkeypatch.setattr(compiler, "_build", slow_build)
    with pytest.raises(GrammarError, match="longer than"):
        asyncio.run(compiler.compile_with_timeout(StructuredOutputsParams(regex="slow"), timeout_s=0.05))


def test_compiled_grammars_are_cached_by_key_and_bounded(smol_tokenizer):
    compiler = GrammarCompiler(smol_tokenizer, VOCAB, smol_tokenizer.eos_token_ids, cache_size=2)
    first = compiler.compile(StructuredOutputsParams(regex="a+"))
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    compiler.compile(StructuredOutputsParams(regex="b+"))
    compiler.compile(StructuredOutputsParams(regex="c+"))
    assert compiler.num_cached == 2
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is not first  # evicted, compiled again
    # Key order is part of the key: it is the order the output writes properties in.
    one = compiler.compile(StructuredOutputsParams(json={"properties": {"a": {}, "b": {}}}))
    other = compiler.compile(StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}}))
    assert one is not other


def test_matcher_catch_up_consumes_each_token_once(compiler, smol_tokenizer):
    """The pending token (read from the step in flight) and the same token once applied count once."""
    grammar = compiler.compile(StructuredOutputsParams(choice=["ab"])).new_request_grammar()
    tokens = smol_tokenizer.encode("ab", add_special_tokens=False)
    assert len(tokens) >= 1
    grammar.catch_up([], pending_token=tokens[0])
    grammar.catch_up(tokens[:1])  # applied now: nothing new
    grammar.catch_up(tokens[:1], pending_token=tokens[1] if len(tokens) > 1 else None)
    grammar.catch_up(tokens)
    assert grammar.num_consumed == len(tokens)
    allowed = allowed_tokens(grammar.matcher)
    assert allowed.nonzero().flatten().tolist() == sorted(smol_tokenizer.eos_token_ids)


class _Chunk:
    """What StepMasks.start reads of a scheduled chunk: its request."""

    def __init__(self, request):
        self.request = request


class _Request:
    def __init__(self, request_id, grammar, output_token_ids):
        self.request_id, self.grammar, self.output_token_ids = request_id, grammar, output_token_ids


def test_step_masks_from_the_worker_equal_each_matchers_own_mask(compiler, smol_tokenizer):
    """Rows of one step: a plain row, rows with a pending token (the step in flight's), a row with applied tokens the
    matcher has not seen, a row whose grammar is complete (only the end tokens). The worker's bitmask rows must be
    llguidance's own mask of a matcher fed the same tokens one by one; the engine thread appending the pending
    token to a request's output while the worker runs changes nothing (the worker reads up to the launch count)."""
    from deepinfer.core.structured.step_mask import StepMasks

    constraints = [StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                                 "required": ["n"]}),
                   StructuredOutputsParams(regex="[a-z]{2,5}"), StructuredOutputsParams(choice=["yes", "no"])]
    encode = lambda text: smol_tokenizer.encode(text, add_special_tokens=False)
    # (constraint, applied output tokens, pending token or None)
    cases = [(constraints[0], encode('{"n": '), encode("4")[0]), (constraints[1], [], encode("ab")[0]),
             (constraints[1], encode("ab"), None), (constraints[2], encode("yes"), None)]
    requests, chunks, references = [], [], []
    for index, (params, applied, pending) in enumerate(cases):
        grammar = compiler.compile(params).new_request_grammar()
        grammar.catch_up(applied[:1])  # seen one applied token before; the rest is new to it
        requests.append(_Request(f"r{index}", grammar, list(applied)))
        reference = compiler.compile(params).new_request_grammar()
        reference.catch_up(applied, pending)
        references.append(allowed_tokens(reference.matcher))
    plain = _Request("plain", None, [])
    chunks = [_Chunk(requests[0]), _Chunk(plain), *map(_Chunk, requests[1:])]
    pending = {f"r{i}": case[2] for i, case in enumerate(cases) if case[2] is not None}
    masks = StepMasks(torch.device("cpu"))
    started = masks.start(chunks, pending.get, VOCAB)
    for request_id, token in pending.items():  # the step in flight is applied meanwhile
        next(r for r in requests if r.request_id == request_id).output_token_ids.append(token)
    mask = started.result()
    assert mask.rows.tolist() == [0, 2, 3, 4]
    for row, expected in enumerate(references):
        bits = (mask.bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        assert torch.equal(bits.view(-1)[:VOCAB].bool(), expected), row
    assert references[3].nonzero().flatten().tolist() == sorted(smol_tokenizer.eos_token_ids)
    # The next step: applied tokens are not consumed twice; the second host slot serves it.
    again = masks.start(chunks, None, VOCAB).result()
    assert torch.equal(again.bitmask, mask.bitmask) and again.bitmask.data_ptr() != mask.bitmask.data_ptr()
    assert masks.start([_Chunk(plain)], None, VOCAB) is None


def test_a_mask_that_fails_fails_its_steps_rows(compiler):
    from deepinfer.core.engine.sampling_params import SamplingParams
    from deepinfer.core.engine.worker.deferred_sample import DeferredSample
    from deepinfer.core.engine.worker.sampler import Sampler, SamplingRow

    class Failing:
        def result(self):
            raise RuntimeError("matcher exploded")

    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], []) for _ in range(2)]
    sampled = DeferredSample(Sampler(), torch.zeros(2, 8), rows, Failing())
    assert sampled.token_ids == [0, 0]
    assert sampled.failures == {0: "grammar mask failed: RuntimeError: matcher exploded",
                                1: "grammar mask failed: RuntimeError: matcher exploded"}


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [70, 151936])
def test_token_bitmask_kernel_equals_the_reference(vocab):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.core.ops.token_bitmask import apply_token_bitmask_reference
    from deepinfer.kernels.token_bitmask import apply_token_bitmask_

    torch.manual_seed(vocab)
    logits = torch.randn(9, vocab, device="cuda")
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, device="cuda")
    rows = torch.tensor([8, 0, 4], dtype=torch.int32, device="cuda")
    expected = logits.clone()
    apply_token_bitmask_reference(expected, rows, bitmask)
    apply_token_bitmask_(logits, rows, bitmask)
    assert torch.equal(logits, expected)
