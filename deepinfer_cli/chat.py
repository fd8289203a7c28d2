"""`deepinfer chat`: an interactive REPL (deepinfer_cli/repl.py) that streams tokens, or one answer.

With --prompt (or text piped on stdin) the answer alone goes to stdout, byte for byte as the model
wrote it (UTF-8, no wrapping or markup), then a newline; logs, spinners and progress go to stderr.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from deepinfer.cli.errors import fail
from deepinfer.cli.options import engine_config, engine_flags


@engine_flags("chat")
def chat(
    prompt: Annotated[str | None, typer.Option(
        "--prompt", "-p", help="Answer this one message (chat template applied), print only the answer, exit.")] = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most tokens per answer.")] = 512,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed (reproducible answers).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show engine logs.")] = False,
    reasoning_parser: Annotated[str | None, typer.Option(
        "--reasoning-parser", help="qwen3 | deepseek_r1 | none: how the model writes its thinking, shown dimmed and "
                                   "apart from the answer (default: detected from its chat template).")] = None,
    engine_process: Annotated[bool, typer.Option(
        "--engine-process/--no-engine-process",
        help="Run the engine core in its own process (this one keeps the terminal, tokenization and "
             "detokenization).")] = False,
    *,
    engine: dict,
) -> None:
    """Chat with a model (default: SmolLM2-135M-Instruct, fetched once into the user cache)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from deepinfer.core.engine.sampling_params import SamplingParams

    # temperature, top-p, top-k, min-p, repetition penalty: the model's defaults under the sampling
    # flags (engine["override_generation_config"]), filled in once the model is loaded
    params = SamplingParams(max_tokens=max_tokens, seed=seed)
    if prompt is not None and not prompt.strip():
        fail("--prompt is empty: pass the message to answer, or leave --prompt out to chat in a terminal")
    if prompt is None and (sys.stdin is None or not sys.stdin.isatty()):
        # `echo question | deepinfer chat`: one answer, as with --prompt (echo's newline is not part of it)
        prompt = sys.stdin.read().strip() if sys.stdin is not None else ""
        if not prompt:
            fail("stdin is not a terminal and holds no message: pass --prompt TEXT, or run chat in a terminal")
    model_label = engine.get("model") or "SmolLM2-135M-Instruct (default)"
    config = engine_config(engine)
    from deepinfer.core.reasoning import NO_PARSER, REASONING_PARSERS

    if reasoning_parser not in (None, NO_PARSER, *REASONING_PARSERS):
        fail(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} or none, got {reasoning_parser!r}")
    if prompt is not None:
        _one_answer(config, params, prompt, system, reasoning_parser, engine_process)
    else:
        _interactive(config, params, system, model_label, reasoning_parser, engine_process)


def _load(config, quiet: bool, engine_process: bool):
    """A loaded ChatEngine. Ctrl-C while the model loads leaves at once (exit 130): the SIGINT handler
    exits itself, so no library's `except` on the way can swallow a KeyboardInterrupt."""
    from contextlib import nullcontext

    from rich.console import Console

    from deepinfer.cli.chat_engine import ChatEngine, flush_and_exit, sigint_handler

    chat = ChatEngine()
    stderr = Console(stderr=True)
    status = nullcontext() if quiet or not stderr.is_terminal else stderr.status("loading model…")

    def leave(signum, frame) -> None:
        if hasattr(status, "stop"):
            status.stop()  # gives the cursor back
        print(file=sys.stderr)
        flush_and_exit(130)

    with sigint_handler(leave), status:
        chat.load(config, engine_process)
    return chat


def _one_answer(config, params, prompt: str, system: str | None, reasoning_parser: str | None,
                engine_process: bool) -> None:
    """Only the answer is printed: a reasoning model's thinking is left out."""
    from deepinfer.cli.conversation import Conversation
    from deepinfer.core.reasoning import ReasoningSplit, make_reasoning_parser

    chat = _load(config, quiet=True, engine_process=engine_process)
    params = params.with_defaults(chat.engine.sampling_defaults)
    try:
        tokenizer = chat.engine.tokenizer
        text = tokenizer.apply_chat_template(Conversation(system).messages(prompt))
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        parser = make_reasoning_parser(reasoning_parser, tokenizer)
        split = ReasoningSplit(parser, parser.opening(text)).stream() if parser is not None else None
        out = sys.stdout.buffer

        def write(piece: str) -> None:
            out.write(piece.encode("utf-8"))
            out.flush()

        def write_answer(piece: str) -> None:
            write(split.feed(piece, final=False)[1])

        answer = chat.stream_answer(prompt_ids, params, write_answer if split is not None else write)
        if split is not None:
            write(split.feed("", final=True)[1])
        write("\n")
        if answer.interrupted:
            raise SystemExit(130)
    finally:
        chat.shutdown()


def _interactive(config, params, system: str | None, model_label: str, reasoning_parser: str | None,
                 engine_process: bool) -> None:
    from deepinfer.cli.conversation import Conversation
    from deepinfer.cli.repl import ChatRepl
    from deepinfer.core.reasoning import make_reasoning_parser
    from deepinfer.core.weights.default_model import cache_root

    chat = _load(config, quiet=False, engine_process=engine_process)
    defaults = chat.engine.sampling_defaults
    try:
        ChatRepl(chat, params.with_defaults(defaults), Conversation(system), model_label,
                 cache_root() / "chat_history", defaults,
                 make_reasoning_parser(reasoning_parser, chat.engine.tokenizer)).run()
    finally:
        chat.shutdown()
