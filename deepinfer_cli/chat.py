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
    if prompt is not None:
        _one_answer(config, params, prompt, system)
    else:
        _interactive(config, params, system, model_label)


def _load(config, quiet: bool):
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
        chat.load(config)
    return chat


def _one_answer(config, params, prompt: str, system: str | None) -> None:
    from deepinfer.cli.conversation import Conversation

    chat = _load(config, quiet=True)
    params = params.with_defaults(chat.engine.sampling_defaults)
    try:
        prompt_ids = chat.engine.tokenizer.encode_chat(Conversation(system).messages(prompt))
        out = sys.stdout.buffer

        def write(piece: str) -> None:
            out.write(piece.encode("utf-8"))
            out.flush()

        answer = chat.stream_answer(prompt_ids, params, write)
        write("\n")
        if answer.interrupted:
            raise SystemExit(130)
    finally:
        chat.shutdown()


def _interactive(config, params, system: str | None, model_label: str) -> None:
    from deepinfer.cli.conversation import Conversation
    from deepinfer.cli.repl import ChatRepl
    from deepinfer.core.weights.default_model import cache_root

    chat = _load(config, quiet=False)
    defaults = chat.engine.sampling_defaults
    try:
        ChatRepl(chat, params.with_defaults(defaults), Conversation(system), model_label,
                 cache_root() / "chat_history", defaults).run()
    finally:
        chat.shutdown()
