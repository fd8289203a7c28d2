"""How `deepinfer chat` shows a reasoning model's thinking: dimmed and apart from the answer.

Folded (the default) the thinking is one dim line that counts it as it streams ("thinking... 812
characters"); unfolded it streams in full, dimmed. Ctrl-T at the prompt (or /think) switches
between the two, and /think also shows the last answer's thinking. The answer alone goes on in
normal text, and only the answer is kept in the conversation (templates such as Qwen3's expect
earlier turns without their thinking).
"""

from __future__ import annotations

from collections.abc import Callable

DIM, RESET, CLEAR_LINE = "\x1b[2m", "\x1b[0m", "\r\x1b[2K"


class ThinkingView:
    """Writes one streamed answer: thinking deltas dimmed (folded or not), content deltas as they are."""

    def __init__(self, stream, write: Callable[[str], None], unfolded: bool) -> None:
        self.stream, self.write, self.unfolded = stream, write, unfolded
        self.thinking = ""
        self._thinking_open = False  # a dim section (or the folded line) is on screen

    def feed(self, piece: str, final: bool = False) -> None:
        thinking, content = self.stream.feed(piece, final)
        if thinking:
            self.thinking += thinking
            if self.unfolded:
                self.write((DIM if not self._thinking_open else "") + thinking)
            else:
                self.write(f"{CLEAR_LINE}{DIM}thinking... {len(self.thinking)} characters (Ctrl-T unfolds){RESET}")
            self._thinking_open = True
        if content:
            self._close()
            self.write(content)

    def finish(self) -> None:
        self.feed("", final=True)
        self._close()

    def _close(self) -> None:
        if not self._thinking_open:
            return
        if self.unfolded:
            self.write(RESET + "\n\n")
        else:
            self.write(f"{CLEAR_LINE}{DIM}thought for {len(self.thinking)} characters (/think shows it){RESET}\n")
        self._thinking_open = False
