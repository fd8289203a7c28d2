"""Chat templates: the model file's Jinja2 code, rendered in a sandbox with limits on time and size.

A chat template comes from the model file and runs on every chat request, so it is untrusted code.
It runs in jinja2's ImmutableSandboxedEnvironment (no attribute escapes, no mutation of its
inputs), with the globals, filters and tags transformers gives templates (`raise_exception`,
`strftime_now`, `tojson`, `namespace`, `dict`, `{% generation %}`, `{% break %}`), so a template
renders here as under `apply_chat_template`. On top of the sandbox its cost is bounded whatever it
does; a template that runs past a limit raises ChatTemplateError (an InvalidRequestError: a 400):

- time: a wall-clock budget, checked at every loop iteration, call and piece of output;
- loops: `range()` holds at most MAX_RANGE items, and a render makes at most `max_iterations`
  loop iterations in all (nested loops multiply quickly);
- size: the rendered prompt holds at most `max_output_chars` (plus OUTPUT_PER_INPUT_CHAR per
  character of the messages), and every string, list or output piece the template builds (`~`,
  `+`, `*`, `%`, filters, method calls, macro results) is charged, by its size in bytes, to an
  allocation budget (`max_allocated_bytes`, plus ALLOCATION_PER_INPUT_CHAR per input character). Calls that
  amplify (`center`, `ljust`, `replace`, `join`, `format`, `indent`, `wordwrap`, `batch`, `sum`,
  `*`, `%`, ...) are charged their result's size before they run, so no single step allocates
  past the budget;
- numbers: integer arithmetic stays within 64 bits (no bignum towers).

The limits are enforced by rewriting the parsed template before it is compiled: every `for`
iterates through a counting iterator, every output piece and every `~` goes through a charging
call (all reached as attributes of the environment, which template code cannot rebind).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from deepinfer.core.errors import InvalidRequestError, ModelLoadError

MAX_TEMPLATE_CHARS = 1 << 20  # real templates are a few KB; the largest tool-use ones ~50 KB
MAX_RANGE = 100_000  # range() items (jinja2's own sandbox cap)
MAX_INT_BITS = 64
MAX_JSON_INDENT = 64
OUTPUT_PER_INPUT_CHAR = 4  # a template wraps each message in role tags, it does not multiply it
ALLOCATION_PER_INPUT_CHAR = 32


class ChatTemplateError(InvalidRequestError):
    """The model's chat template failed on these messages, or ran past a limit (time, size, loops)."""


@dataclass(frozen=True)
class TemplateLimits:
    max_seconds: float = 2.0
    max_iterations: int = 1_000_000
    max_output_chars: int = 1 << 20
    max_allocated_bytes: int = 32 << 20


class _Budget:
    """What one render may still spend."""

    def __init__(self, limits: TemplateLimits, input_chars: int) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds
        self.iterations = limits.max_iterations
        self.output_limit = limits.max_output_chars + OUTPUT_PER_INPUT_CHAR * input_chars
        self.allocation_limit = limits.max_allocated_bytes + ALLOCATION_PER_INPUT_CHAR * input_chars
        self.allocated = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template ran past its time limit of {self.limits.max_seconds:g} s")

    def iterate(self) -> None:
        self.iterations -= 1
        if self.iterations < 0:
            raise ChatTemplateError(f"the chat template made more than {self.limits.max_iterations} loop iterations")
        self.check_time()

    def charge(self, size: int) -> None:
        """Count `size` bytes about to be built (see `_size`); refuse past the allocation budget."""
        self.allocated += size
        if self.allocated > self.allocation_limit:
            raise ChatTemplateError(f"the chat template built more than {self.allocation_limit} bytes "
                                    f"of strings and lists")
        self.check_time()


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)
# Filters folded while the template compiles (constant arguments) run with this budget.
_COMPILE_TIME_LIMITS = TemplateLimits()


def _budget() -> _Budget:
    budget = _BUDGET.get()
    return budget if budget is not None else _Budget(_COMPILE_TIME_LIMITS, 0)


def _size(value: Any) -> int:
    """Bytes `value` holds, roughly: a byte per character, a pointer per item (more per dict entry)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return 8 * len(value)
    if isinstance(value, dict):
        return 32 * len(value)
    return 0


def _check_int(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise ChatTemplateError(f"the chat template computed an integer of more than {MAX_INT_BITS} bits")
    return value


def _int_arg(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _percent_size(fmt: str, args: Any) -> int:
    """An upper bound on len(fmt % args): the format, its arguments and every width and precision."""
    widths = 0
    for match in _PERCENT_FIELD.finditer(fmt):
        if "*" in match.group(0):
            raise ChatTemplateError("the chat template used a '*' width in % formatting")
        widths += sum(int(group) for group in match.groups() if group)
    values = args.values() if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
    return len(fmt) + widths + sum(len(str(value)) for value in values)


def _format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """An upper bound on len(fmt.format(*args, **kwargs))."""
    widths = 0
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec:
            if "{" in spec:
                raise ChatTemplateError("the chat template nested a field in a format spec")
            widths += sum(int(number) for number in re.findall(r"\d+", spec))
    return len(fmt) + widths + sum(len(str(v)) for v in (*args, *kwargs.values()))


def _str_method_size(text: str, name: str, args: tuple, kwargs: dict) -> int | None:
    """An upper bound on the size of `text.<name>(*args)` for the str methods that amplify."""
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(text), _int_arg(args[0] if args else kwargs.get("width", 0)))
    if name == "expandtabs":
        return len(text) + text.count("\t") * _int_arg(args[0] if args else kwargs.get("tabsize", 8))
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = text.count(args[0]) if args[0] else len(text) + 1
        if len(args) > 2 and _int_arg(args[2]) >= 0:
            count = min(count, _int_arg(args[2]))
        return len(text) + count * max(0, len(args[1]) - len(args[0]))
    if name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        return len(text) * max(1, longest)
    if name in ("format", "format_map"):
        mapping = (args[0],) if name == "format_map" and args and isinstance(args[0], Mapping) else ()
        return _format_size(text, args if not mapping else (), kwargs if not mapping else dict(mapping[0]))
    if name == "encode":
        return 4 * len(text)
    return None


def _join_size(separator: str, items: list) -> int:
    return max(0, len(items) - 1) * len(separator) + sum(len(str(item)) for item in items)


def _environment_class() -> type:
    """The sandbox class, built on first use so that importing this module does not import jinja2."""
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace
    from jinja2.visitor import NodeTransformer

    class GenerationTag(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (marks assistant text): renders its body."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` without exposing the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(Namespace):
        """jinja2's namespace, refusing underscore names (no reach into CPython internals)."""

        def __init__(*args, **kwargs):  # jinja2.utils.Namespace's own signature: `self` may be a key
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot store underscore attributes on a namespace ({name!r})")

    def raise_exception(message):
        raise TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        if indent is not None and not (isinstance(indent, int) and 0 <= indent <= MAX_JSON_INDENT):
            raise ChatTemplateError(f"tojson indent must be an integer in [0, {MAX_JSON_INDENT}]")
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def bounded_range(*args):
        if not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
            raise ChatTemplateError("range() takes integers")
        items = range(*args)
        if len(items) > MAX_RANGE:
            raise ChatTemplateError(f"range() of {len(items)} items is more than the {MAX_RANGE} a chat template "
                                    f"may make")
        return items

    def guard(name: str, make: Callable) -> Callable:
        """A filter charged its result's size (and, where it amplifies, an upper bound before it runs)."""

        @functools.wraps(make)
        def filtered(*args, **kwargs):
            budget = _budget()
            # Context- and environment-taking filters get those first: the value follows them.
            offset = 1 if getattr(make, "jinja_pass_arg", None) is not None else 0
            value, rest = (args[offset], args[offset + 1:]) if len(args) > offset else (None, ())
            estimate = _filter_size(name, value, rest, kwargs)
            if estimate is not None:
                budget.charge(estimate)
            result = make(*args, **kwargs)
            if estimate is None:
                budget.charge(_size(result))
            return _check_int(result)

        return filtered

    def _filter_size(name: str, value: Any, rest: tuple, kwargs: dict) -> int | None:
        """An upper bound on the result of the filters that amplify; None for the others."""
        if name not in ("center", "indent", "wordwrap", "replace", "format", "batch", "slice"):
            return None
        text = value if isinstance(value, str) else "" if value is None else str(value)
        if name == "center":
            return max(len(text), _int_arg(rest[0] if rest else kwargs.get("width", 80)))
        if name == "indent":
            width = rest[0] if rest else kwargs.get("width", 4)
            width = len(width) if isinstance(width, str) else _int_arg(width)
            return len(text) + (text.count("\n") + 1) * width
        if name == "wordwrap":
            wrap = rest[2] if len(rest) > 2 else kwargs.get("wrapstring") or "\n"
            return len(text) * (1 + len(wrap))
        if name == "replace" and len(rest) >= 2:
            return _str_method_size(text, "replace", tuple(rest), {})
        if name == "format":
            return _percent_size(text, tuple(rest) or kwargs)
        if name == "batch" or name == "slice":
            return _int_arg(rest[0] if rest else 0) + _size(value)
        return None

    def join_filter(make: Callable) -> Callable:
        @functools.wraps(make)
        def joined(eval_ctx, value, d="", attribute=None):
            items = list(value) if value is not None else []
            _budget().charge(_join_size(str(d), items))
            return make(eval_ctx, items, d, attribute)

        return joined

    def sum_filter(make: Callable) -> Callable:
        @functools.wraps(make)
        def summed(environment, iterable, attribute=None, start=0):
            items = list(iterable)
            if isinstance(start, (str, list, tuple)):  # sequences are copied at every step: quadratic
                total = _size(start) + sum(_size(item) for item in items)
                _budget().charge(total * max(1, len(items)))
            return _check_int(make(environment, items, attribute, start))

        return summed

    class Rewriter(NodeTransformer):
        """Routes every loop, output piece and `~` through the environment's counting calls."""

        def __init__(self, environment) -> None:
            self.environment = environment

        def call(self, name: str, args: list, lineno: int):
            node = nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None, lineno=lineno)
            return node.set_environment(self.environment)

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = self.call("_bounded_iter", [node.iter], node.lineno)
            return node

        def visit_Output(self, node):
            node = self.generic_visit(node)
            node.nodes = [self.call("_output_piece", [child], child.lineno) for child in node.nodes]
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return self.call("_concat", list(node.nodes), node.lineno)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def __init__(self) -> None:
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
            self.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                                namespace=TemplateNamespace, range=bounded_range)
            self.filters["tojson"] = tojson
            for name, make in list(self.filters.items()):
                self.filters[name] = guard(name, make)
            self.filters["join"] = join_filter(self.filters["join"].__wrapped__)
            self.filters["sum"] = sum_filter(self.filters["sum"].__wrapped__)

        def compile_bounded(self, source: str):
            tree = Rewriter(self).visit(self.parse(source))
            return self.from_string(tree)

        # Called by the rewritten template ---------------------------------------------------
        def _bounded_iter(self, iterable: Iterable) -> Iterator:
            budget = _budget()
            for item in iterable:
                budget.iterate()
                yield item

        def _output_piece(self, value: Any) -> str:
            text = str(value)
            _budget().charge(len(text))
            return text

        def _concat(self, *values: Any) -> str:
            parts = [str(value) for value in values]
            _budget().charge(sum(len(part) for part in parts))
            return "".join(parts)

        # Sandbox hooks ------------------------------------------------------------------------
        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            budget = _budget()
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if (abs(left).bit_length() - 1) * right > MAX_INT_BITS:
                    raise ChatTemplateError(f"the chat template computed an integer of more than {MAX_INT_BITS} bits")
            elif operator == "*":
                for sequence, count in ((left, right), (right, left)):
                    if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
                        budget.charge(_size(sequence) * max(0, count))
            elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                budget.charge(_size(left) + _size(right))
            elif operator == "%" and isinstance(left, str):
                budget.charge(_percent_size(left, right))
            budget.check_time()
            return _check_int(super().call_binop(context, operator, left, right))

        def call(self, context, obj, /, *args, **kwargs):
            budget = _budget()
            budget.check_time()
            if getattr(obj, "__self__", None) is self:  # the rewriter's own calls
                return context.call(obj, *args, **kwargs)
            if isinstance(obj, LoopContext) and args:  # `loop(children)` of a recursive for
                args = (self._bounded_iter(args[0]),) + args[1:]
            method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
            owner = getattr(method, "__self__", None)
            estimate = None
            if isinstance(owner, str):
                name = getattr(method, "__name__", "")
                if name == "join" and args:
                    args = (list(args[0]),) + args[1:]
                    estimate = _join_size(owner, args[0])
                else:
                    estimate = _str_method_size(owner, name, args, kwargs)
            if estimate is not None:
                budget.charge(estimate)
            result = super().call(context, obj, *args, **kwargs)
            if estimate is None:
                budget.charge(_size(result))
            return _check_int(result)

    return BoundedSandbox


@functools.cache
def _environment() -> Any:
    return _environment_class()()


class ChatTemplate:
    """One compiled chat template. `render` is thread-safe (each call has its own budget)."""

    def __init__(self, source: str, where: str | None = None, limits: TemplateLimits | None = None) -> None:
        """Raises ModelLoadError when `source` is not a template that parses; `where` (the model
        file) starts the message."""
        from jinja2.exceptions import TemplateSyntaxError

        prefix = f"{where}: " if where else ""
        if not isinstance(source, str):
            raise ModelLoadError(f"{prefix}the chat template is not a string")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ModelLoadError(f"{prefix}the chat template has {len(source)} characters, more than the "
                                 f"{MAX_TEMPLATE_CHARS} it may have")
        self.source = source
        self.limits = limits or TemplateLimits()
        try:
            self._template = _environment().compile_bounded(source)
        except TemplateSyntaxError as err:
            raise ModelLoadError(f"{prefix}the chat template does not parse: line {err.lineno}: "
                                 f"{err.message}") from None
        except (RecursionError, MemoryError, ValueError, TypeError) as err:
            raise ModelLoadError(f"{prefix}the chat template does not compile: {type(err).__name__}: "
                                 f"{err}") from None

    def __reduce__(self):
        """Pickled as its source (the compiled template is code): the engine process hands its
        tokenizer to the front end this way."""
        return ChatTemplate, (self.source, None, self.limits)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text of `messages` (plain JSON data is passed, None-valued keys dropped, as
        transformers does); `variables` (special tokens, tools) are given to the template too."""
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        chat = [{key: _plain(value) for key, value in message.items() if value is not None}
                for message in messages]
        context = {**_plain(variables), "messages": chat, "tools": _plain(variables.get("tools")),
                   "documents": _plain(variables.get("documents")), "add_generation_prompt": add_generation_prompt}
        budget = _Budget(self.limits, _input_chars(context))
        token = _BUDGET.set(budget)
        try:
            pieces, length = [], 0
            for piece in self._template.generate(context):
                length += len(piece)
                if length > budget.output_limit:
                    raise ChatTemplateError(f"the chat template rendered more than {budget.output_limit} "
                                            f"characters")
                pieces.append(piece)
            return "".join(pieces)
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateError("the chat template recursed too deeply") from None
        except Exception as err:  # noqa: BLE001 - jinja2 errors, SecurityError, template-raised ones
            raise ChatTemplateError(f"the chat template failed on these messages: {type(err).__name__}: "
                                    f"{err}") from None
        finally:
            _BUDGET.reset(token)


def _plain(value: Any) -> Any:
    """JSON-like data only (what templates read), rebuilt so no caller object reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy scalars) carry methods of their own
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return f"<{type(value).__name__}>"


def _input_chars(value: Any) -> int:
    """Characters of the strings in `value` (the messages and variables a render is given)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_input_chars(k) + _input_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_input_chars(item) for item in value)
    return 0
