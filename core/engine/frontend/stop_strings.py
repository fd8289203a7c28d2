"""StopStringMatcher: finds a request's stop strings in output text that grows at its end.

Each step hands over only the text the step added (`feed`), and each character is looked at once:
per stop string the matcher keeps the length of the longest prefix of the stop that the text ends
with (Knuth-Morris-Pratt), and advances it over the new characters with the stop's failure table.
So a step costs time in its own new characters (amortized; a failure-table fall-back never undoes
more than earlier characters advanced), never in the text generated so far nor, beyond the one-off
table, in the stops' lengths. The same state says how much of the text's tail could still grow into
a stop (`held_back`), which the stream must not release yet.
"""

from __future__ import annotations


def failure_table(stop: str) -> list[int]:
    """[len(stop)]: entry i is the length of the longest proper prefix of stop[:i + 1] that is also
    its suffix."""
    table = [0] * len(stop)
    length = 0
    for i in range(1, len(stop)):
        while length and stop[i] != stop[length]:
            length = table[length - 1]
        if stop[i] == stop[length]:
            length += 1
        table[i] = length
    return table


class StopStringMatcher:
    def __init__(self, stops: list[str], failure_tables: list[list[int]] | None = None) -> None:
        """failure_tables: `failure_table(stop)` of each stop, when the caller has them already."""
        self.stops = list(stops)
        self._tables = list(failure_tables) if failure_tables is not None else [failure_table(s) for s in stops]
        self._matched = [0] * len(self.stops)  # per stop: how many of its first characters end the text
        # Plain attributes, read once per token: the length of the longest tail of the text that is a proper
        # prefix of a stop (max of _matched), and the characters fed so far.
        self.held_back = 0
        self.text_len = 0
        self._first_chars = frozenset(stop[0] for stop in self.stops)

    def feed(self, new_text: str) -> tuple[int, str] | None:
        """Takes the text's next characters; returns (start in the whole text, stop) of the match
        that starts earliest among the first match of each stop that these characters complete,
        or None when they complete none."""
        base = self.text_len
        self.text_len += len(new_text)
        if not self.held_back and self._first_chars.isdisjoint(new_text):
            return None  # most steps: no stop in progress and no stop's first character among the new ones
        earliest: tuple[int, str] | None = None
        for index, stop in enumerate(self.stops):
            matched = self._matched[index]
            if matched == 0 and stop[0] not in new_text:
                continue  # from no progress only the stop's first character advances
            table = self._tables[index]
            for offset, char in enumerate(new_text):
                while matched and char != stop[matched]:
                    matched = table[matched - 1]
                if char == stop[matched]:
                    matched += 1
                if matched == len(stop):
                    start = base + offset + 1 - len(stop)
                    if earliest is None or start < earliest[0]:
                        earliest = (start, stop)
                    matched = table[matched - 1]
                    break
            self._matched[index] = matched
        self.held_back = max(self._matched)
        return earliest

