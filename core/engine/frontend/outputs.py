"""What the engine hands back: per request, one CompletionOutput per sample (`n` of them).

`LLM.generate` returns finished RequestOutputs. `AsyncEngine.generate` yields a RequestOutput
each time a request makes progress; `delta_text` / `delta_token_ids` hold what is new since the
previous yield of that request, the other fields are cumulative.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens at this step, best first
    rank: int | None = None  # 1 + the tokens more likely than this one (prompt logprobs only)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)  # one per request and step: slots make it small and quick to build
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed alone (finish_reason "error")
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    # The single-sample view most callers want (vLLM keeps these under outputs[0]).
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class PendingOutputs:
    """The outputs of one request that its reader has not taken yet, held as one output.

    A reader that falls behind (a client that stops reading its stream) would otherwise hold every
    step's snapshot, each with the whole text so far: memory quadratic in the tokens generated.
    Here a new snapshot replaces the previous one (the cumulative fields and finish state are the
    newest's) and only the previous one's deltas are kept, per sample, as parts joined on `take`:
    what is held grows with the tokens not taken, once each.
    """

    def __init__(self) -> None:
        self._latest: RequestOutput | None = None
        self._texts: list[list[str]] = []  # [sample] the older delta texts, in order
        self._token_ids: list[list[int]] = []
        self._logprobs: list[list[TokenLogprob] | None] = []

    def __bool__(self) -> bool:
        return self._latest is not None

    def add(self, output: RequestOutput) -> None:
        previous = self._latest
        if previous is not None:
            if not self._texts:
                self._texts = [[] for _ in previous.outputs]
                self._token_ids = [[] for _ in previous.outputs]
                self._logprobs = [None for _ in previous.outputs]
            for i, completion in enumerate(previous.outputs):
                self._texts[i].append(completion.delta_text)
                self._token_ids[i] += completion.delta_token_ids
                if completion.delta_logprobs is not None:
                    if self._logprobs[i] is None:
                        self._logprobs[i] = []
                    self._logprobs[i] += completion.delta_logprobs
        self._latest = output

    def take(self) -> RequestOutput:
        """The newest output, its deltas being everything since the previous take."""
        output, self._latest = self._latest, None
        if self._texts:
            for i, completion in enumerate(output.outputs):
                completion.delta_text = "".join(self._texts[i]) + completion.delta_text
                completion.delta_token_ids = self._token_ids[i] + completion.delta_token_ids
                if self._logprobs[i] is not None:
                    completion.delta_logprobs = self._logprobs[i] + (completion.delta_logprobs or [])
            self._texts, self._token_ids, self._logprobs = [], [], []
        return output
