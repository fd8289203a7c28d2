"""SamplingParams: how one request turns logits into tokens and when it stops.

Validated on construction, so a bad value becomes a clear ValueError at the API edge
(the server maps it to a 400) and never reaches the engine loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token; None = no logprobs
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (or -1 to disable), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.logit_bias is None or all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0
                                            for t, b in self.logit_bias.items()),
             "logit_bias must map token ids to biases in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
