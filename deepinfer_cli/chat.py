"""`deepinfer chat`: an interactive REPL that streams tokens, or one answer with --prompt.

The conversation is kept as OpenAI-style messages and rendered by the model's own chat template
on every turn, so multi-turn history is exactly what the model was trained to see.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import typer

from deepinfer.cli.options import (
    AsyncSchedulingOpt,
    BlockSizeOpt,
    DeviceOpt,
    DtypeOpt,
    KvCacheDtypeOpt,
    MaxModelLenOpt,
    MaxVramOpt,
    ModelOpt,
    engine_config,
)

HELP = "Commands: /reset (forget the conversation), /system TEXT (set the system prompt), /exit."


def chat(
    model: ModelOpt = None,
    prompt: Annotated[str | None, typer.Option(
        "--prompt", "-p", help="Answer this one message (chat template applied), print only the answer, exit.")] = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.9,
    top_k: Annotated[int, typer.Option("--top-k", help="0 disables.")] = 0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most tokens per answer.")] = 512,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed (reproducible answers).")] = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    block_size: BlockSizeOpt = 16,
    max_model_len: MaxModelLenOpt = None,
    max_vram: MaxVramOpt = None,
    async_scheduling: AsyncSchedulingOpt = True,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show engine logs.")] = False,
) -> None:
    """Chat with a model (default: SmolLM2-135M-Instruct, fetched once into the user cache)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from deepinfer.core.engine.sampling_params import SamplingParams

    config = engine_config(model=model, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype,
                           block_size=block_size, max_model_len=max_model_len, max_vram=max_vram,
                           async_scheduling=async_scheduling, max_num_seqs=4)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)
    asyncio.run(_run(config, params, prompt, system))


async def _run(config, params, prompt: str | None, system: str | None) -> None:
    from rich.console import Console

    from deepinfer.core.engine.async_engine import AsyncEngine

    console = Console(highlight=False)
    err_console = Console(stderr=True, highlight=False)
    if prompt is None:
        with err_console.status("loading model..."):
            engine = AsyncEngine(config)
    else:
        engine = AsyncEngine(config)
    await engine.start()
    try:
        if prompt is not None:
            answer = await _answer(engine, _messages(system, [("user", prompt)]), params, console, stream=False)
            console.print(answer, markup=False)
            return
        await _repl(engine, params, system, console)
    finally:
        await engine.shutdown()


def _messages(system: str | None, turns: list[tuple[str, str]]) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": role, "content": content} for role, content in turns]


async def _answer(engine, messages: list[dict], params, console, stream: bool) -> str:
    """Run one turn; with stream=True print tokens as they come. Returns the full answer."""
    prompt_text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    request = engine.add_request(engine.tokenizer.encode(prompt_text, add_special_tokens=False), params)
    text = ""
    async for output in request:
        completion = output.outputs[0]
        if stream and completion.delta_text:
            console.print(completion.delta_text, end="", markup=False, soft_wrap=True)
        text = completion.text
    if stream:
        console.print()
    return text


async def _repl(engine, params, system: str | None, console) -> None:
    console.print(f"[bold]deepinfer chat[/bold] · {engine.model_name} · {HELP}")
    turns: list[tuple[str, str]] = []
    loop = asyncio.get_running_loop()
    while True:
        try:
            line = await loop.run_in_executor(None, lambda: console.input("[bold green]> [/bold green]"))
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            turns.clear()
            console.print("[dim](conversation cleared)[/dim]")
            continue
        if line.startswith("/system"):
            system = line[len("/system"):].strip() or None
            turns.clear()
            console.print(f"[dim](system prompt {'set' if system else 'cleared'}; conversation cleared)[/dim]")
            continue
        if line.startswith("/"):
            console.print(f"[red]unknown command {line.split()[0]}[/red]. {HELP}")
            continue
        turns.append(("user", line))
        try:
            answer = await _answer(engine, _messages(system, turns), params, console, stream=True)
        except KeyboardInterrupt:
            turns.pop()
            continue
        except ValueError as err:  # e.g. the conversation outgrew the context: say so, keep the REPL alive
            turns.pop()
            console.print(f"[red]error:[/red] {err}")
            continue
        turns.append(("assistant", answer))
