"""Errors the engine raises on purpose. Each carries a message meant for the user as is.

The CLI prints `str(err)` on one line and exits non-zero (a traceback only with --debug);
the server maps them to OpenAI-shaped 4xx answers.
"""


class DeepInferError(Exception):
    """Base of every error deepinfer raises for bad input or an impossible request."""


class ModelLoadError(DeepInferError):
    """The model path, its files or its config cannot be used (missing, truncated, malformed)."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but its architecture or quantization is not supported."""


class InvalidRequestError(DeepInferError, ValueError):
    """A request the engine can never serve as asked (bad parameters, prompt too long)."""


class PromptTooLongError(InvalidRequestError):
    """prompt + max_tokens exceed the context length, or the prompt can never fit the KV pool."""


class QueueFullError(DeepInferError):
    """The bounded waiting queue is full; the caller should retry later (HTTP 429)."""


class EngineDeadError(DeepInferError):
    """The engine loop stopped after an unrecoverable error; no request can be served."""


class ConversionError(DeepInferError):
    """`deepinfer convert` cannot do what was asked (output exists, option the source cannot honour)."""
