"""The token windows a perplexity is computed over, as llama.cpp's llama-perplexity lays them out.

A text of N tokens is cut into windows of `ctx` tokens starting every `stride` tokens (stride = ctx:
back to back, llama-perplexity's chunks); only complete windows count. Within a window the model sees
its tokens from the window's start, and only the second half is scored (token j predicted from the
logits at j - 1, for j from ctx // 2 on), so every scored token has at least ctx // 2 tokens of context.
With stride = ctx // 2 every token after the first half-window is scored exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window in the text
    end: int  # one past its last token (end - start = ctx)
    first_scored: int  # offset in the window of the first scored token (ctx // 2)

    @property
    def num_scored(self) -> int:
        return self.end - self.start - self.first_scored


def plan_windows(num_tokens: int, ctx: int, stride: int | None = None, max_windows: int | None = None) -> list[Window]:
    """The complete windows of `ctx` tokens every `stride` (default ctx) tokens, at most `max_windows`."""
    stride = ctx if stride is None else stride
    if ctx < 2 or stride < 1:
        raise ValueError(f"--ctx must be at least 2 and --stride at least 1 (got ctx {ctx}, stride {stride})")
    if num_tokens < ctx:
        raise ValueError(f"the text has {num_tokens} tokens, fewer than one window of --ctx {ctx}")
    starts = range(0, num_tokens - ctx + 1, stride)
    windows = [Window(start, start + ctx, ctx // 2) for start in starts]
    return windows if max_windows is None else windows[:max_windows]
