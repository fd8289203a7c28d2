"""Progress of a benchmark sweep while it runs: one bar per level (requests done, output tok/s), and
each level's result line as soon as the level finishes. A sweep that can estimate its work up front
(jitter: engine steps) also says so in a line and gets a bar over the whole sweep with the time left.

The sweeps (concurrency.py, jitter.py) report to a SweepProgress; the base class reports nothing,
so library callers and tests pay nothing. RichSweepProgress draws on the console it is given
(the CLI gives it stderr, keeping stdout for the result tables). Its per-token and per-step reports
only add to counters (no lock, no Rich call on the engine thread or the event loop); Rich's own
refresh thread copies them into the bars, REFRESH_PER_SECOND times a second, when it redraws.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text


class SweepProgress:
    """What a sweep reports; every method does nothing here."""

    def sweep_started(self, summary: str, total_steps: int) -> None:
        """The whole sweep, in a line, and about how many engine steps it takes."""

    def engine_steps(self, steps: int) -> None:
        """`steps` more engine steps ran (called from the engine thread)."""

    def level_started(self, label: str, num_requests: int) -> None:
        """A level (a concurrency, a token budget) starts; `num_requests` requests are timed in it."""

    def advance(self, requests: int = 0, tokens: int = 0) -> None:
        """`requests` more requests finished, `tokens` more output tokens arrived."""

    def level_finished(self, line: str) -> None:
        """The level is done; `line` is its result in one line."""


REFRESH_PER_SECOND = 4  # each redraw holds the GIL for a while: a few a second are enough for a person


class _CountersProgress(Progress):
    """A Progress that calls `sync()` before each redraw, on the thread that redraws."""

    def __init__(self, *columns, sync, **kwargs) -> None:
        self._sync = sync  # first: Progress's constructor may draw already
        super().__init__(*columns, **kwargs)

    def get_renderables(self):
        self._sync()
        yield from super().get_renderables()


class _TokensPerSecond(ProgressColumn):
    def render(self, task) -> Text:
        if task.fields.get("unit") != "requests":  # the sweep's bar counts engine steps, not tokens
            return Text(" " * 12)
        elapsed = task.elapsed or 0.0
        tokens = task.fields.get("tokens", 0)
        return Text(f"{tokens / elapsed:6.1f} tok/s" if elapsed > 0 else "     - tok/s")


class _SweepTimeLeft(TimeRemainingColumn):
    """The whole sweep's time left, from its engine steps so far; nothing on a level's bar."""

    def render(self, task) -> Text:
        if task.fields.get("unit") != "steps":
            return Text("")
        return Text.assemble("left ", super().render(task))


class RichSweepProgress(SweepProgress):
    """A rich.progress bar per level; finished levels leave their result line above the bar."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._task = None
        self._sweep_task = None
        # Totals so far, each written by one thread (the event loop, the engine thread), read by the redraw.
        self._requests = 0
        self._tokens = 0
        self._steps = 0
        whole = Column(no_wrap=True)  # at 80 columns the bar gives way, never a number
        self._progress = _CountersProgress(TextColumn("{task.description:<18}", table_column=whole), BarColumn(),
                                  MofNCompleteColumn(table_column=whole),
                                  TextColumn("{task.fields[unit]}", table_column=whole),
                                  _TokensPerSecond(table_column=whole), TimeElapsedColumn(table_column=whole),
                                  console=console, transient=True, refresh_per_second=REFRESH_PER_SECOND,
                                  sync=self._sync)

    def __enter__(self):
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def sweep_started(self, summary: str, total_steps: int) -> None:
        self._progress.console.print(summary, markup=False, highlight=False, soft_wrap=True)
        self._progress.columns = (*self._progress.columns, _SweepTimeLeft(table_column=Column(no_wrap=True)))
        self._sweep_task = self._progress.add_task("sweep", total=total_steps, tokens=0, unit="steps")

    def engine_steps(self, steps: int) -> None:
        self._steps += steps

    def level_started(self, label: str, num_requests: int) -> None:
        self._remove_task()
        self._requests = self._tokens = 0
        self._task = self._progress.add_task(label, total=num_requests, tokens=0, unit="requests")

    def advance(self, requests: int = 0, tokens: int = 0) -> None:
        self._requests += requests
        self._tokens += tokens

    def _sync(self) -> None:
        task, sweep_task = self._task, self._sweep_task
        try:
            if task is not None:
                self._progress.update(task, completed=self._requests, tokens=self._tokens)
            if sweep_task is not None:
                self._progress.update(sweep_task, completed=self._steps)
        except KeyError:  # the level's bar was removed meanwhile (it ended); the next redraw has the new one
            pass

    def level_finished(self, line: str) -> None:
        self._sync()  # the level's bar as it ends
        self._remove_task()
        self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _remove_task(self) -> None:
        if self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None
