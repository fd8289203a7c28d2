"""RequestGrammar: one sample's place in its grammar, kept in step with its output tokens.

The engine never pushes tokens into it as they are applied. Instead, right before the mask of a
step is computed, the matcher catches up with whatever output tokens it has not seen yet: the
applied ones (`Request.output_token_ids`, up to the count the runner saw when it launched the step)
and, with async scheduling, the one the step in flight sampled (read from that step's host copy, not
applied yet). Tokens are only ever appended to a request's output (preemption keeps them, recompute
never resamples them), so the matcher is always at the state of the tokens before the row it masks,
whatever the order of launches and applies. The catch-up runs on the mask worker thread
(step_mask.py) while the engine thread may be appending the step in flight's token to the same list,
so it reads the list only up to that launch-time count.

Once the grammar is complete, llguidance allows only the end tokens; after one is consumed the
matcher is stopped and further tokens (`ignore_eos` keeps sampling) are not fed to it: its mask
keeps allowing only the end tokens. A token the matcher refuses (it cannot be: the mask forbade
it) puts it in its error state, whose mask also allows only the end tokens, so the request ends.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(self, matcher) -> None:
        self.matcher = matcher  # llguidance.LLMatcher, this sample's own
        self.num_consumed = 0  # output tokens fed to (or skipped by a stopped) matcher

    def unseen_tokens(self, output_token_ids: list[int], num_applied: int, pending_token: int | None) -> list[int]:
        """The tokens the matcher has not seen: output_token_ids[num_consumed:num_applied], then `pending_token`
        (sampled by the step in flight, not applied) when the matcher has seen all applied ones."""
        tokens = output_token_ids[self.num_consumed:num_applied]
        if pending_token is not None and self.num_consumed + len(tokens) == num_applied:
            tokens.append(pending_token)
        return tokens

    def catch_up(self, output_token_ids: list[int], pending_token: int | None = None) -> None:
        """Feed the output tokens the matcher has not seen, then `pending_token` (sampled, not applied)."""
        self.consume(self.unseen_tokens(output_token_ids, len(output_token_ids), pending_token))

    def consume(self, tokens: list[int]) -> None:
        """Feed `tokens` one by one (a stopped matcher skips them)."""
        matcher = self.matcher
        for token in tokens:
            self.num_consumed += 1
            if matcher.is_stopped():
                continue
            if not matcher.consume_token(token):
                logger.warning("the grammar refused sampled token %d: %s", token, matcher.get_error())

    def consumed_in_batch(self, token: int, accepted: bool) -> None:
        """Record one token fed by llguidance's batched consume (step_mask.py), or skipped by a stopped matcher."""
        self.num_consumed += 1
        if not accepted:
            logger.warning("the grammar refused sampled token %d: %s", token, self.matcher.get_error())

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()
