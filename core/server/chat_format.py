"""OpenAI chat messages -> the prompt text the model's chat template makes of them.

Only text is accepted: a content given as parts is joined from its "text" parts; images and
audio are a 400. The "developer" role (OpenAI's newer name for system) is passed to templates
as "system", which every template knows.
"""

from __future__ import annotations

from deepinfer.core.errors import DeepInferError
from deepinfer.core.server.errors import InvalidParameter
from deepinfer.core.server.protocol import ChatMessage

CHAT_ROLES = ("system", "developer", "user", "assistant")


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


def to_template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Validated, plain {"role", "content"} dicts in the order given."""
    if not messages:
        raise InvalidParameter("messages must contain at least one message", param="messages")
    plain = []
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidParameter(
                f"messages[{index}].role: unknown role {message.role!r}; use one of {', '.join(CHAT_ROLES)}",
                param=f"messages.{index}.role")
        role = "system" if message.role == "developer" else message.role
        plain.append({"role": role, "content": _message_text(message, index)})
    return plain


def render_chat_prompt(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """The prompt text the model sees. The tokenizer raises InvalidRequestError when the model has no
    template, the template refuses the conversation (roles that do not alternate: templates call
    raise_exception) or it runs past its time or size budget; each is answered with a 400.
    Runs on a preprocessing thread: a slow template holds that thread, never the event loop."""
    plain = to_template_messages(messages)
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except DeepInferError as err:
        raise InvalidParameter(str(err), param="messages") from None
