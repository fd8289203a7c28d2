"""GrammarCompiler: a request's constraint -> a compiled llguidance grammar, checked and cached.

Compiling builds llguidance's lexer and parser for the model's vocabulary (about a millisecond for
a typical schema). Each compiled grammar is a template matcher that is never advanced; a request's
samples get deep copies of it (microseconds). Templates live in an LRU cache keyed by the
constraint (`StructuredOutputsParams.cache_key`), bounded in number.

Bounds, so hostile input costs little:
- size: params.py refuses constraints over MAX_CONSTRAINT_CHARS before anything is compiled;
- work and memory: llguidance's own limits (`parser_limits`) cap the lexer's construction fuel,
  the grammar's size, the lexer's states (memory) and each mask computation's fuel; past them the
  grammar is refused (compile) or the matcher stops (decode);
- per-token cost: some grammars within those limits still cost a lot per mask (a mask over one
  long literal costs time linear in its length: ~30 ms for 20k characters), and every step of
  every request would wait for it. The first mask is computed at compile time (it is the costliest
  one) and a grammar whose first mask takes over MAX_FIRST_MASK_S of CPU time is refused;
- wall time: `compile_with_timeout` (the server) compiles on a small worker pool and gives up
  after a deadline, cancelling a compile still queued.

A constraint with a reasoning span (params.py) is wrapped so that it starts after the reasoning
(reasoning_gate.py); a reasoning budget alone is the gate's grammar only.

Regex class escapes (\\d \\w \\s) in regex constraints and schema patterns are read as ECMA-262 reads
them (regex_classes.py) before llguidance sees them.

A grammar llguidance refuses (invalid schema, regex, grammar; an unsupported keyword in a strict
schema) raises GrammarError with llguidance's message: the server answers it with a 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict

from deepinfer.core.errors import InvalidRequestError
from deepinfer.core.structured.matcher import RequestGrammar
from deepinfer.core.structured.params import FREE, StructuredOutputsParams
from deepinfer.core.structured.reasoning_gate import gated_grammar
from deepinfer.core.structured.regex_classes import ecma_regex_classes, ecma_schema_patterns

# JSON is written compactly with OpenAI's separators: no free whitespace, so a model cannot spend its
# tokens on blank lines, and the text is the same whatever the model's habits.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 64
DEFAULT_COMPILE_TIMEOUT_S = 5.0
COMPILE_WORKERS = 2
MAX_ERROR_CHARS = 600
MAX_FIRST_MASK_S = 0.02  # typical schemas: under 2 ms on a slow CPU


class GrammarError(InvalidRequestError):
    """The constraint cannot be compiled; the message is the grammar engine's."""


def parser_limits():
    """llguidance's limits: defaults, with fewer lexer states (about 1-2 kB each) and less fuel per
    mask than its defaults, so one request's matcher stays within ~40 MB and ~5 ms per token."""
    import llguidance

    return llguidance.LLParserLimits(max_lexer_states=20_000, step_lexer_fuel=70_000, verbose_errors=False)


def grammar_text(params: StructuredOutputsParams) -> str | None:
    """The llguidance grammar (its JSON form) for the constraint; None for a reasoning budget alone,
    which the reasoning gate writes whole. Raises GrammarError."""
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        if params.kind == FREE:
            return None
        if params.json is not None:
            schema = ecma_schema_patterns(params.json)
            return matcher.grammar_from_json_schema(schema, defaults={**JSON_OPTIONS, "lenient": not params.strict})
        if params.json_object:
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if params.regex is not None:
            return matcher.grammar_from_regex(ecma_regex_classes(params.regex))
        if params.choice is not None:
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)  # GBNF or Lark, told apart by llguidance
    except (ValueError, RecursionError) as err:
        raise GrammarError(f"invalid {params.kind} constraint: {_short(str(err))}") from None


class CompiledGrammar:
    """One compiled constraint: hands out fresh per-request matchers."""

    def __init__(self, template) -> None:
        self._template = template  # llguidance.LLMatcher at the start state; never advanced
        self._lock = threading.Lock()

    def new_request_grammar(self) -> RequestGrammar:
        with self._lock:
            return RequestGrammar(self._template.deep_copy())


class GrammarCompiler:
    """Per engine: the vocabulary (built on first use) and the cache of compiled grammars. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._workers: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                from deepinfer.core.structured.vocabulary import grammar_tokenizer

                self._ll_tokenizer = grammar_tokenizer(self._tokenizer, self.vocab_size, self._eos_token_ids)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params`, from the cache when it is there. Raises GrammarError."""
        key = params.cache_key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = CompiledGrammar(self._build(params))
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, params: StructuredOutputsParams):
        import llguidance

        text = grammar_text(params)
        if params.reasoning is not None:
            text = gated_grammar(text, params.reasoning, self._num_real_tokens())
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(f"invalid {params.kind} constraint: {_short(matcher.get_error())}")
        probe = matcher.deep_copy()
        start = time.thread_time()  # CPU time of this thread: a loaded machine must not refuse a cheap grammar
        probe.compute_bitmask()
        cost_s = time.thread_time() - start
        if cost_s > MAX_FIRST_MASK_S:
            raise GrammarError(f"the {params.kind} constraint is too costly: its first token mask took "
                               f"{1e3 * cost_s:.0f} ms (at most {1e3 * MAX_FIRST_MASK_S:.0f} ms are accepted)")
        if probe.is_error():
            raise GrammarError(f"invalid {params.kind} constraint: {_short(probe.get_error())}")
        return matcher

    def _num_real_tokens(self) -> int:
        """The ids the tokenizer has (the logits' padded ids past them are never allowed)."""
        return min(self.vocab_size, getattr(self._tokenizer, "vocab_size", self.vocab_size))

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    async def compile_with_timeout(self, params: StructuredOutputsParams,
                                   timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """`compile` on the worker pool, within `timeout_s` (the vocabulary's one-time build is not
        counted). Raises GrammarError, also on the timeout (InvalidRequestError: no usable vocabulary)."""
        with self._lock:
            if self._workers is None:
                self._workers = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, "deepinfer-grammar")
            workers = self._workers
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(workers, lambda: self.ll_tokenizer)
        future = workers.submit(self.compile, params)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            future.cancel()  # a compile still queued never runs; a running one ends at llguidance's limits
            raise GrammarError(f"compiling the {params.kind} constraint took longer than {timeout_s:g} s") from None


def _short(message: str) -> str:
    """llguidance's message without the grammar listing it may append, on one line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines[:4])
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."
