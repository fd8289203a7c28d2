"""The chat history `deepinfer chat` keeps, and how it is cut to fit the model's context.

Turns are kept as OpenAI-style messages and rendered by the model's own chat template on every
turn. When the conversation outgrows the context (prompt + the answer's max_tokens), the oldest
exchanges (a user message and the answer to it) are dropped; the system prompt always stays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.core.errors import PromptTooLongError


@dataclass
class Turn:
    role: str  # "user" | "assistant"
    content: str
    interrupted: bool = False  # an answer stopped with Ctrl-C: the partial text stays in the history


@dataclass
class Fit:
    dropped_turns: int  # turns removed from the front of the history to make room
    max_tokens: int  # the answer's budget: the asked max_tokens, or less when one message fills the context


@dataclass
class Conversation:
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def messages(self, pending: str | None = None) -> list[dict]:
        """The chat-template messages: system prompt, history, then `pending` (the new user message)."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages += [{"role": t.role, "content": t.content} for t in self.turns]
        if pending is not None:
            messages.append({"role": "user", "content": pending})
        return messages

    def add(self, role: str, content: str, interrupted: bool = False) -> None:
        self.turns.append(Turn(role, content, interrupted))

    def reset(self) -> None:
        self.turns.clear()

    def fit(self, pending: str, count_tokens: Callable[[list[dict]], int], max_model_len: int,
            max_tokens: int) -> Fit:
        """Drop the oldest exchanges until the prompt with `pending` leaves `max_tokens` of room.

        `count_tokens(messages)` is the prompt length the chat template makes of them. With the
        history gone and still no room, the answer gets what is left; a message that leaves
        no room at all raises PromptTooLongError (the history is then left as it was).
        """
        kept = Conversation(self.system, list(self.turns))
        while kept.turns and count_tokens(kept.messages(pending)) + max_tokens > max_model_len:
            cut = 1
            while cut < len(kept.turns) and kept.turns[cut].role != "user":
                cut += 1  # one exchange: the user message and every answer to it
            del kept.turns[:cut]
        prompt_len = count_tokens(kept.messages(pending))
        if prompt_len >= max_model_len:
            raise PromptTooLongError(f"this message makes a {prompt_len}-token prompt with the chat template"
                                     f"{' and the system prompt' if self.system else ''}, and the context holds "
                                     f"{max_model_len}; shorten it")
        dropped = len(self.turns) - len(kept.turns)
        self.turns = kept.turns
        return Fit(dropped, min(max_tokens, max_model_len - prompt_len))
