"""OpenAI chat messages -> the prompt text the model's chat template makes of them.

Only text is accepted: a content given as parts is joined from its "text" parts; images and
audio are a 400. The "developer" role (OpenAI's newer name for system) is passed to templates
as "system", which every template knows. Assistant turns may carry `tool_calls` (then their
content may be null) and `reasoning_content`, and `tool` turns answer one of them; core/structured/tools.py renders them
and the request's tools.
"""

from __future__ import annotations

from typing import Any

from deepinfer.core.errors import DeepInferError
from deepinfer.core.server.errors import InvalidParameter
from deepinfer.core.server.protocol import ChatMessage
from deepinfer.core.structured.tool_parsers import ToolParser
from deepinfer.core.structured.tools import ToolPlan, render_chat

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise InvalidParameter(f"messages[{index}].content is required for role {message.role!r}",
                               param=f"messages.{index}.content")
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidParameter(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                                   param=f"messages.{index}.content")
        texts.append(part.text)
    return "".join(texts)


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validated, plain {"role", "content"} dicts in the order given (with "tool_calls" on assistant
    turns that made calls, "tool_call_id" on tool turns)."""
    if not messages:
        raise InvalidParameter("messages must contain at least one message", param="messages")
    plain = []
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidParameter(
                f"messages[{index}].role: unknown role {message.role!r}; use one of {', '.join(CHAT_ROLES)}",
                param=f"messages.{index}.role")
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": _message_text(message, index)}
        if message.tool_calls and role == "assistant":
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                   for call in message.tool_calls]
        if role == "assistant" and message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        if role == "tool" and message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        plain.append(entry)
    return plain


def render_chat_prompt(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                       parser: ToolParser | None = None, plan: ToolPlan | None = None,
                       template_variables: dict[str, Any] | None = None) -> str:
    """The prompt text the model sees, with the request's tools (`plan`) where it has any. The
    tokenizer raises InvalidRequestError when the model has no template, the template refuses the
    conversation (roles that do not alternate: templates call raise_exception) or it runs past its
    time or size budget; each is answered with a 400. `template_variables`: the request's
    chat_template_kwargs (and reasoning_effort), which the template reads beside the messages. Runs on a preprocessing thread: a slow template
    holds that thread, never the event loop."""
    plain = to_template_messages(messages)
    try:
        if parser is None:
            return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                 template_variables=template_variables)
        return render_chat(tokenizer, plain, add_generation_prompt, parser, plan, template_variables)
    except (DeepInferError, ValueError) as err:
        raise InvalidParameter(str(err), param="messages") from None
