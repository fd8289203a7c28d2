"""Tokenizer: one interface over an HF fast tokenizer (from tokenizer.json or built from GGUF vocab).

Chat templates are code from the model file: they are compiled when the tokenizer loads (one that
does not parse fails the load) and rendered by core/chat_template.py, in jinja2's sandbox with
limits on time, loop iterations and size (a template past them raises ChatTemplateError, an
InvalidRequestError). A model without a chat template has no fallback: `apply_chat_template`
raises InvalidRequestError (the caller should send a plain completion prompt instead).

Text to encode must be valid Unicode (no lone surrogates, which have no UTF-8 form): anything
else is an InvalidRequestError.

A rendered chat prompt already carries its special tokens (BOS included), so `encode_chat`
tokenizes it with `add_special_tokens=False`.

`ByteTokenizer` is the last resort for dummy-weight runs when no real tokenizer is around:
one id per UTF-8 byte, no special tokens, no chat template.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deepinfer.core.chat_template import ChatTemplate
from deepinfer.core.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = (), bos_token_id: int | None = None,
                 where: str | None = None) -> None:
        """`where` (the model path) names the model in the error of a chat template that does not parse."""
        self.hf_tokenizer = hf_tokenizer
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: set[int] = eos
        self.bos_token_id: int | None = bos_token_id if bos_token_id is not None else hf_tokenizer.bos_token_id
        self.chat_template = _default_chat_template(getattr(hf_tokenizer, "chat_template", None), where)

    @classmethod
    def from_pretrained(cls, path: Path, gguf_file: str | None = None, eos_token_ids: Iterable[int] = (),
                        bos_token_id: int | None = None) -> Tokenizer:
        """Load from an HF directory, or from `path/gguf_file` (vocab, merges and template inside the GGUF)."""
        from transformers import AutoTokenizer

        from deepinfer.core.weights.file_checks import check_tokenizer_files, checked_file

        where = path / gguf_file if gguf_file else path
        if gguf_file:
            checked_file(where, what="GGUF file")
        else:
            check_tokenizer_files(path)  # regular files inside the model directory, of bounded size
        try:
            if gguf_file:
                hf_tokenizer = _gguf_tokenizer(path / gguf_file)
            else:
                hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as err:  # noqa: BLE001 - transformers raises many types for a broken or absent tokenizer
            raise ModelLoadError(f"cannot load the tokenizer from {where}: {type(err).__name__}: {err}") from None
        return cls(hf_tokenizer, eos_token_ids, bos_token_id, where=str(where))

    @property
    def vocab_size(self) -> int:
        return len(self.hf_tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_encodable(text)
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf_tokenizer.convert_ids_to_tokens(ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_variables: dict[str, Any] | None = None) -> str:
        """Render messages with the model's own template (sandboxed, bounded Jinja2) -> prompt text.
        `tools`: OpenAI function tools, given to the template as transformers does (`tools=`);
        `template_variables`: more variables (`enable_thinking`), as transformers' extra kwargs.
        Raises ChatTemplateError (an InvalidRequestError) when the template fails or runs past a limit."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain completion prompt instead")
        return self.chat_template.render(messages, add_generation_prompt,
                                         **{**self.hf_tokenizer.special_tokens_map, **(template_variables or {}),
                                            "tools": tools})

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


_BYTE_IDS = frozenset(range(256))


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; ids beyond decode to nothing. For dummy weights only."""

    has_chat_template = False

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ModelLoadError(f"a byte tokenizer needs a vocabulary of at least 256 ids, the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids: set[int] = set()  # dummy runs stop on max_tokens only
        self.bos_token_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_encodable(text)
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # filter with a builtin predicate runs in C: the detokenizer calls this on a few ids every token
        return bytes(filter(_BYTE_IDS.__contains__, ids)).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) if 0 <= i < 256 else f"<{i}>" for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_variables: dict[str, Any] | None = None) -> str:
        raise InvalidRequestError("the byte tokenizer of a dummy model has no chat template")

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def check_encodable(text: Any) -> None:
    """`text` is a str with a UTF-8 form (no lone surrogates); InvalidRequestError otherwise."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(f"the text is not valid Unicode: a lone surrogate {text[err.start]!r} at "
                                  f"character {err.start}") from None


def _default_chat_template(template: Any, where: str | None) -> ChatTemplate | None:
    """The tokenizer's chat template compiled (or None). A dict of named templates gives its "default",
    as transformers picks it when no tools are passed; each of them must parse."""
    if not template:
        return None
    if isinstance(template, dict):
        compiled = {name: ChatTemplate(source, f"{where} (chat template {name!r})" if where else None)
                    for name, source in template.items()}
        return compiled.get("default")
    return ChatTemplate(template, where)


def _gguf_tokenizer(gguf_path: Path) -> Any:
    """The HF tokenizer transformers builds from a GGUF's vocab, cached as tokenizer.json.

    Building it parses the whole GGUF metadata again (tens of seconds for a 49k vocab on a small
    CPU), so the result is saved once per file (keyed by size and mtime) under the user cache and
    loaded from there afterwards; the cache entry is written to a temp dir and renamed.
    """
    import os
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    from deepinfer.core.weights.default_model import cache_root

    stat = gguf_path.stat()
    cached = cache_root() / "tokenizers" / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
    try:
        hf_tokenizer.save_pretrained(str(staging))
        os.replace(staging, cached)
    except OSError:  # another process won the race, or the cache is read-only: the tokenizer is still good
        shutil.rmtree(staging, ignore_errors=True)
    return hf_tokenizer
