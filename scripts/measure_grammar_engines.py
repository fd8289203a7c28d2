"""Compare xgrammar and llguidance on the default model's vocabulary (SmolLM2, 49152 tokens), on this CPU.

    python scripts/measure_grammar_engines.py --out results/structured_outputs_engines.json

Per engine:
- per-token cost: each schema's valid instance is tokenized as the model's tokenizer would write it
  (then EOS); before each token the engine fills the next-token bitmask (timed: what the engine
  pays per constrained row and step), then the token is accepted (timed separately);
- compile time of each schema with every cache off (what the first request with a new schema waits);
- JSON Schema coverage: for each keyword, a schema using it, one instance that must be accepted and
  one that must be refused. "enforced": the first accepted and the second refused; "loose": both
  accepted (the keyword is ignored); "refused": the schema does not compile; "wrong": the valid
  instance is refused.

Both engines run on one thread (xgrammar's compiler too), as the engine's host loop does. The
load average is recorded: on a shared machine the means and tails move with it, the medians less.
xgrammar is not a deepinfer dependency: `pip install xgrammar` to run this.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from importlib.metadata import version

SCHEMAS = {
    "person": ({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                       "email": {"type": "string"}},
        "required": ["name", "age"], "additionalProperties": False,
    }, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    "order": ({
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {"type": "array", "minItems": 1, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                               "price": {"type": "number"}},
                "required": ["sku", "quantity", "price"]}},
            "notes": {"type": ["string", "null"]},
        },
        "required": ["id", "status", "items", "notes"],
    }, {"id": "ABC-1234", "status": "shipped",
        "items": [{"sku": "pencil", "quantity": 12, "price": 0.5}, {"sku": "paper", "quantity": 1, "price": 4.25}],
        "notes": None}),
    "tool_call": ({
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "unit"]}},
        "required": ["name", "arguments"],
    }, {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}),
    "tree": ({
        "$defs": {"node": {"type": "object", "properties": {
            "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["label", "children"]}},
        "$ref": "#/$defs/node",
    }, {"label": "root", "children": [{"label": "a", "children": []},
                                      {"label": "b", "children": [{"label": "c", "children": []}]}]}),
    "free_json": ({}, {"title": "A long free-form answer", "tags": ["json", "grammar", "masks"],
                       "score": 0.93, "nested": {"ok": True, "list": [1, 2, 3]}}),
}

# keyword -> (schema, valid instance, invalid instance)
COVERAGE = {
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"a": 1}, {}),
    "additionalProperties: false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    "additionalProperties: schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                     {"x": 1}, {"x": "s"}),
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "const": ({"const": 42}, 42, 43),
    "type list (nullable)": ({"type": ["integer", "null"]}, None, "x"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "x", 1.5),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
              {"a": 1, "b": 2}, {"a": 1}),
    "$ref / $defs": ({"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
                     [1, 2], ["x"]),
    "recursive $ref": ({"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                        "required": ["next"]}, {"next": {"next": None}}, {"next": 1}),
    "minLength / maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    "pattern": ({"type": "string", "pattern": "^[a-z]+-[0-9]+$"}, "ab-12", "AB-12"),
    "format: date": ({"type": "string", "format": "date"}, "2024-02-29", "yesterday"),
    "format: email": ({"type": "string", "format": "email"}, "a@b.io", "not-an-email"),
    "format: uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "123"),
    "minimum / maximum": ({"type": "integer", "minimum": 1, "maximum": 9}, 5, 10),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 0}, 1, 0),
    "number bounds": ({"type": "number", "minimum": 0.5, "maximum": 1.5}, 1.25, 2.5),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 10, 7),
    "minItems / maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
                            [1, 2], [1, 2, 3]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                     "items": False}, ["a", 1], [1, "a"]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "contains": ({"type": "array", "contains": {"const": 3}}, [1, 3], [1, 2]),
    "minProperties / maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"},
                                       "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                       "additionalProperties": {"type": "integer"}}, {"ab": 1}, {"AB": 1}),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    "if / then / else": ({"type": "object", "properties": {"k": {"type": "string"}, "v": {}},
                          "required": ["k", "v"],
                          "if": {"properties": {"k": {"const": "n"}}},
                          "then": {"properties": {"v": {"type": "integer"}}},
                          "else": {"properties": {"v": {"type": "string"}}}},
                         {"k": "n", "v": 1}, {"k": "n", "v": "x"}),
    "not": ({"type": "integer", "not": {"const": 0}}, 1, 0),
}


def compact(instance) -> str:
    return json.dumps(instance, separators=(",", ":"))


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.eos = eos[0]

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.eos = eos[0]

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, self.bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_tokens(engine, hf_tokenizer, repeats: int) -> dict:
    per_schema = {}
    all_masks = []
    for name, (schema, instance) in SCHEMAS.items():
        tokens = hf_tokenizer.encode(compact(instance), add_special_tokens=False) + [engine.eos]
        compile_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            compiled = engine.compile(schema)
            engine.matcher(compiled)  # llguidance builds its lexer here
            compile_s.append(time.perf_counter() - start)
        masks, accepts = [], []
        for _ in range(repeats):
            matcher = engine.matcher(compiled)
            for token in tokens:
                start = time.perf_counter()
                engine.fill(matcher)
                masks.append(time.perf_counter() - start)
                start = time.perf_counter()
                if not engine.accept(matcher, token):
                    raise RuntimeError(f"{engine.name} refused token {token} of the valid {name} instance")
                accepts.append(time.perf_counter() - start)
        all_masks += masks
        per_schema[name] = {
            "tokens": len(tokens),
            "compile_ms_median": 1e3 * statistics.median(compile_s),
            "mask_us_median": 1e6 * statistics.median(masks),
            "mask_us_mean": 1e6 * statistics.mean(masks),
            "mask_us_p99": 1e6 * percentile(masks, 0.99),
            "mask_us_max": 1e6 * max(masks),
            "accept_us_mean": 1e6 * statistics.mean(accepts),
        }
    return {"schemas": per_schema, "mask_us_median_all": 1e6 * statistics.median(all_masks),
            "mask_us_mean_all": 1e6 * statistics.mean(all_masks), "mask_us_p99_all": 1e6 * percentile(all_masks, 0.99)}


def accepts_text(engine, compiled, hf_tokenizer, text: str) -> bool:
    matcher = engine.matcher(compiled)
    tokens = hf_tokenizer.encode(text, add_special_tokens=False) + [engine.eos]
    return all(engine.accept(matcher, token) for token in tokens)


def measure_coverage(engine, hf_tokenizer) -> dict:
    verdicts = {}
    for keyword, (schema, valid, invalid) in COVERAGE.items():
        try:
            compiled = engine.compile(schema)
        except Exception:  # noqa: BLE001 - each engine raises its own type for an unsupported schema
            verdicts[keyword] = "refused"
            continue
        if not accepts_text(engine, compiled, hf_tokenizer, compact(valid)):
            verdicts[keyword] = "wrong"
        elif accepts_text(engine, compiled, hf_tokenizer, compact(invalid)):
            verdicts[keyword] = "loose"
        else:
            verdicts[keyword] = "enforced"
    counts = {v: sum(1 for x in verdicts.values() if x == v) for v in ("enforced", "loose", "refused", "wrong")}
    return {"keywords": verdicts, "counts": counts}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from deepinfer.core.tokenizer import Tokenizer
    from deepinfer.core.weights.default_model import default_model_path

    path = default_model_path()
    tokenizer = Tokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_tokenizer, vocab_size, eos = tokenizer.hf_tokenizer, 49152, sorted(tokenizer.eos_token_ids)
    results = {"model": path.name, "vocab_size": vocab_size, "cpu": _cpu_model(), "cpus": os.cpu_count(),
               "load_average_1min": os.getloadavg()[0], "python": platform.python_version(), "engines": {}}
    for engine_class, package in ((XGrammarEngine, "xgrammar"), (LLGuidanceEngine, "llguidance")):
        start = time.perf_counter()
        engine = engine_class(hf_tokenizer, vocab_size, eos)
        setup_s = time.perf_counter() - start
        results["engines"][engine.name] = {
            "version": version(package),
            "tokenizer_setup_s": setup_s,
            **measure_tokens(engine, hf_tokenizer, args.repeats),
            "coverage": measure_coverage(engine, hf_tokenizer),
        }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
