"""A tiny Qwen3 checkpoint that reasons on cue: the real Qwen3 chat template and a scripted reply.

Its layers add nothing (attention and MLP outputs are zero), so each next token depends on the
current one only, and its head is built so that greedy decoding follows one chain of tokens:
the generation prompt's last token ("\\n") -> "<think>", a sentence of 16 tokens, "</think>",
"Paris." then the end token. The reply is therefore known in advance, and every deviation (a mask that forbids
the reasoning, a constraint that picks other tokens) shows in the text.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from conftest import build_tiny_tokenizer, save_tiny_model

TEMPLATES = Path(__file__).parent / "chat_templates"
REASONING = "The quick brown fox jumps over the lazy dog"  # 16 distinct tokens
ANSWER = "Paris."
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, non-special tokens as in Qwen3


def qwen3_tokenizer(template: str = "qwen3.jinja"):
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(MARKERS)
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


def script_ids(tokenizer) -> list[int]:
    """The chain greedy decoding follows, from the generation prompt's last token to the end token."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    chain = [*encode("\n"), *encode("<think>"), *encode(REASONING), *encode("</think>"), *encode(ANSWER),
             tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "a token twice would make the chain loop"
    return chain


def save_reasoning_model(directory: Path) -> Path:
    tokenizer = qwen3_tokenizer()
    model = save_tiny_model("qwen3", directory, tokenizer, tie_word_embeddings=False)
    chain = script_ids(tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
            elif name == "model.norm.weight":
                param.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed.copy_(torch.randn(embed.shape, generator=generator))
        head = model.lm_head.weight
        head.zero_()
        for current, following in itertools.pairwise(chain):
            head[following] = 20.0 * embed[current] / embed[current].norm()
    model.save_pretrained(directory)
    return directory
