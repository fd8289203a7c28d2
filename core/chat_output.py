"""ChatCompletionOutput: one sample of a chat reply, with its reasoning apart from its answer.

`LLM.chat` hands these back in place of plain CompletionOutputs: `text` is what the model wrote,
`reasoning_content` the thinking of a reasoning model (None when it wrote none, or without a
reasoning parser) and `content` the answer after it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from deepinfer.core.engine.frontend.outputs import CompletionOutput
from deepinfer.core.reasoning import ReasoningSplit


@dataclass
class ChatCompletionOutput(CompletionOutput):
    reasoning_content: str | None = None
    content: str = ""

    @classmethod
    def of(cls, output: CompletionOutput, reasoning: ReasoningSplit | None) -> ChatCompletionOutput:
        thinking, content = reasoning.split(output.text) if reasoning is not None else (None, output.text)
        values = {f.name: getattr(output, f.name) for f in fields(CompletionOutput)}
        return cls(**values, reasoning_content=thinking, content=content)
