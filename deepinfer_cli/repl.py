"""The interactive loop of `deepinfer chat`, on prompt_toolkit.

Keys: the arrow keys walk the history (kept in the deepinfer cache as chat_history) and edit the
line; Enter sends; a message opened with \"\"\" runs over several lines until \"\"\" closes it, and a
pasted block (bracketed paste) is one message too; Ctrl-C clears a line with text, stops an answer
being written (the partial answer stays in the history, marked), and leaves at an empty prompt;
Ctrl-D leaves. A reasoning model's thinking is shown dimmed and folded (thinking.py); Ctrl-T or
/think unfolds it.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from deepinfer.cli.chat_engine import ChatEngine
from deepinfer.cli.conversation import Conversation
from deepinfer.cli.thinking import ThinkingView
from deepinfer.core.reasoning import ReasoningSplit

BLOCK = '"""'
PROMPT = ">>> "
CONTINUATION = "... "
HELP = f"""\
  /help           this list
  /reset          forget the conversation (the system prompt and the sampling settings stay)
  /system TEXT    set the system prompt and start over; /system alone removes it
  /think          show the last answer's thinking, and fold or unfold the thinking of the next ones
  /exit, /bye     leave (so do Ctrl-D, and Ctrl-C at an empty prompt)
  {BLOCK}             open a message of several lines; {BLOCK} again closes it (pasted text is one message)
  Ctrl-C          stop the answer being written; it stays in the history, marked
  Ctrl-T          fold or unfold a reasoning model's thinking (shown dimmed, never kept in the history)
  Up / Down       walk the history of what you typed"""


def block_is_open(text: str) -> bool:
    """Whether `text` opened a \"\"\" block that is not closed yet (Enter then adds a line)."""
    stripped = text.strip()
    return stripped.startswith(BLOCK) and (len(stripped) < 2 * len(BLOCK) or not stripped.endswith(BLOCK))


def message_of(text: str) -> str:
    """The message a submitted input holds: a \"\"\" block without its quotes, else the text."""
    stripped = text.strip()
    if stripped.startswith(BLOCK):
        stripped = stripped[len(BLOCK):]
        stripped = stripped.removesuffix(BLOCK)
        return stripped.strip()
    return stripped


def banner(model_label: str) -> list[str]:
    """The REPL's first lines (Rich markup), short enough for an 80-column terminal."""
    return [f"[bold]deepinfer chat[/bold] · {escape(model_label)}", "/help for commands, Ctrl-D to leave"]


def make_session(history_file: Path, on_toggle_thinking=None):
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    bindings = KeyBindings()

    @bindings.add("enter")
    def _enter(event) -> None:
        buffer = event.current_buffer
        if block_is_open(buffer.text):
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    @bindings.add("c-c")
    def _interrupt(event) -> None:
        buffer = event.current_buffer
        if buffer.text:
            buffer.reset()
        else:
            event.app.exit(exception=EOFError())

    @bindings.add("c-t")
    def _toggle_thinking(event) -> None:
        if on_toggle_thinking is not None:
            from prompt_toolkit.application import run_in_terminal

            run_in_terminal(on_toggle_thinking)

    try:
        history_file.parent.mkdir(parents=True, exist_ok=True)
        history = FileHistory(str(history_file))
    except OSError:  # a read-only home: the history lasts for this session only
        history = InMemoryHistory()
    return PromptSession(history=history, multiline=True, key_bindings=bindings,
                         prompt_continuation=CONTINUATION)


class ChatRepl:
    def __init__(self, chat: ChatEngine, params, conversation: Conversation, model_label: str,
                 history_file: Path, sampling_defaults=None, reasoning_parser=None) -> None:
        """`params`: every answer's SamplingParams; `sampling_defaults`: the SamplingDefaults they were
        filled from (where each value came from), shown at the start and by /help; `reasoning_parser`:
        the model's (core/reasoning), or None."""
        self.chat, self.params, self.conversation = chat, params, conversation
        self.model_label, self.history_file = model_label, history_file
        self.sampling_defaults = sampling_defaults
        self.console = Console(highlight=False)
        self.tokenizer = chat.engine.tokenizer
        self.max_model_len = chat.engine.max_model_len
        self.reasoning_parser = reasoning_parser
        self.unfold_thinking = False
        self.last_thinking: str | None = None

    def run(self) -> None:
        session = make_session(self.history_file, self.toggle_thinking)
        for line in banner(self.model_label):
            self.console.print(line)
        self.say(self.sampling_line())
        if self.reasoning_parser is not None:
            self.say(f"reasoning parser: {self.reasoning_parser.name} (thinking dimmed and folded; Ctrl-T unfolds)")
        while True:
            try:
                text = session.prompt(PROMPT)
            except (EOFError, KeyboardInterrupt):
                return
            message = message_of(text)
            if not message:
                continue
            if message.startswith("/") and not text.strip().startswith(BLOCK):
                if self.command(message) == "exit":
                    return
                continue
            self.answer(message)

    def sampling_line(self) -> str:
        """`sampling: temperature 0.2 (model), top_p 0.9 (flag), ...`: the values in force, from where."""
        if self.sampling_defaults is None:
            return f"sampling: temperature {self.params.temperature:g}, top_p {self.params.top_p:g}"
        return f"sampling: {self.sampling_defaults.describe()}"

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{escape(text)}[/dim]")

    def command(self, line: str) -> str | None:
        name, _, argument = line.partition(" ")
        if name in ("/exit", "/quit", "/bye"):
            return "exit"
        if name in ("/help", "/?"):
            self.console.print(HELP, markup=False)
            self.say(self.sampling_line())
            self.say("  model: the model's generation config; flag: chat's --temperature, --top-p, --top-k, "
                     "--min-p, --repetition-penalty; built-in: neither sets it")
        elif name == "/think":
            if self.last_thinking:
                self.say(self.last_thinking)
            self.toggle_thinking()
        elif name == "/reset":
            self.conversation.reset()
            kept = (f"the system prompt ({self.conversation.system!r})" if self.conversation.system
                    else "no system prompt (none is set)")
            self.say(f"(conversation forgotten; kept: {kept} and the sampling settings)")
        elif name == "/system":
            self.conversation.system = argument.strip() or None
            self.conversation.reset()
            self.say(f"(system prompt {'set' if self.conversation.system else 'removed'}; conversation forgotten)")
        else:
            self.console.print(f"[red]unknown command {escape(name)}[/red]; /help lists them")
        return None

    def toggle_thinking(self) -> None:
        self.unfold_thinking = not self.unfold_thinking
        self.say(f"(thinking {'unfolded' if self.unfold_thinking else 'folded'})")

    def answer(self, message: str) -> None:
        from deepinfer.core.errors import DeepInferError

        try:
            fit = self.conversation.fit(message, self._count_tokens, self.max_model_len, self.params.max_tokens)
        except DeepInferError as err:
            self.console.print(f"[red]error:[/red] {escape(str(err))}")
            return
        if fit.dropped_turns:
            self.say(f"(the conversation outgrew the {self.max_model_len}-token context: the {fit.dropped_turns} "
                     "oldest turns were dropped; the system prompt stays)")
        prompt = self.tokenizer.apply_chat_template(self.conversation.messages(message))
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        written: list[str] = []

        def write(piece: str) -> None:
            written.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()

        split = ReasoningSplit(self.reasoning_parser, self.reasoning_parser.opening(prompt)) \
            if self.reasoning_parser is not None else None
        view = ThinkingView(split.stream(), write, self.unfold_thinking) if split is not None else None
        try:
            result = self.chat.stream_answer(prompt_ids, replace(self.params, max_tokens=fit.max_tokens),
                                             view.feed if view is not None else write)
        except DeepInferError as err:
            self.console.print(f"\n[red]error:[/red] {escape(str(err))}")
            return
        if view is not None:
            view.finish()
        if not "".join(written).endswith("\n"):
            sys.stdout.write("\n")
        thinking, content = split.split(result.text) if split is not None else (None, result.text)
        self.last_thinking = thinking
        self.conversation.add("user", message)
        self.conversation.add("assistant", content, interrupted=result.interrupted)
        if result.interrupted:
            self.say("[answer interrupted; the part above stays in the conversation]")
        elif result.finish_reason == "length":
            self.say(f"[stopped after {fit.max_tokens} tokens; --max-tokens sets the limit]")

    def _count_tokens(self, messages: list[dict]) -> int:
        return len(self.tokenizer.encode_chat(messages))
