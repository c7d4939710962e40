"""Progress of work on a Ray actor, shown by the stage's progress bar in the flow's process.

In the flow's process a long stage shows a bar (`tasks.stages.progress`); on an actor the bar
would be drawn in the actor's process, where no one reads it (its stderr is no terminal, and the
Prefect run's logger is in the flow's process). The run keeps a `ProgressCounter` actor beside its
policy and scorer actors (`start_counter`, from `ray_workers.connect`; it reserves no CPU, so it
fits on a cluster that the run's actors fill). `remote_progress` opens the stage's bar in the
flow's process and clears the counter of what earlier stages' calls left in it. The actors' work
is given a `Tally`, the `progress(n)` callback it calls after each unit of work (an ODE step of a
chunk), which adds to the counter without waiting for an answer, so counting neither slows the
work nor fails it. `RemoteProgress.get` waits for the actors' calls and every `POLL_S` seconds
moves the bar by what the counter took in; when the calls have returned it fills the bar (adds
still in flight then are counted as done, and a call Ray retried counts no more than the total).
The counter is started once a run, not once a stage: starting an actor starts a worker process
(about a second on two busy cores), which a short stage such as a small rollout would wait for.
The bar logs as the local one does: inside a Prefect run one line at most every
`progress.LOG_INTERVAL_S` seconds, so the relayed counts do not flood the run's logs.

Ray is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tasks.stages.progress import stage_progress

POLL_S = 0.5  # how often the flow's process asks the counter


class ProgressCounter:
    """Units of work counted since the flow's process last took them (a Ray actor, made by
    `start_counter`)."""

    def __init__(self) -> None:
        self.units = 0

    def add(self, n: int) -> None:
        self.units += n

    def take(self) -> int:
        """The units added since the last take."""
        taken, self.units = self.units, 0
        return taken


@dataclass(frozen=True)
class Tally:
    """The `progress(n)` callback to pass to an actor's call: adds n to the counter, without
    waiting for the counter to answer."""

    counter: Any  # the ProgressCounter actor's handle

    def __call__(self, n: int) -> None:
        self.counter.add.remote(n)


@dataclass(frozen=True)
class RemoteProgress:
    """A stage's bar of `total` units in the flow's process (`advance` moves it), moved by what
    the actors' calls count with `tally`."""

    tally: Tally
    advance: Callable[[int], object]
    total: int

    def get(self, calls: list) -> list:
        """`ray.get(calls)`, moving the bar by the units counted while they run; the bar is full
        once they have returned. A counter lost meanwhile only stops the bar."""
        import ray

        shown, pending, counting = 0, list(calls), True
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            if counting:
                try:
                    shown += self._show(ray.get(self.tally.counter.take.remote()), shown)
                except ray.exceptions.RayError:
                    counting = False
        results = ray.get(calls)
        self._show(self.total, shown)
        return results

    def _show(self, n: int, shown: int) -> int:
        """Move the bar by n units, at most up to `total` -> the units it moved."""
        step = max(0, min(n, self.total - shown))
        if step:
            self.advance(step)
        return step


def start_counter(**options: Any):
    """A `ProgressCounter` actor reserving no CPU -> its handle; `options` go to Ray's actor
    options (its name, lifetime, runtime environment...)."""
    import ray

    return ray.remote(ProgressCounter).options(num_cpus=0, **options).remote()


@contextmanager
def remote_progress(total: int, desc: str, counter: Any) -> Iterator[RemoteProgress]:
    """The stage's bar of `total` units (`progress.stage_progress`), moved by what the actors
    count into `counter` (a `start_counter` handle). The counter is first cleared of what
    earlier stages' calls added after their last take, without waiting for it: it runs this
    process's calls in order, so the clearing comes before this stage's takes (an add that
    overtakes it, only possible while the counter starts, is lost to the bar until the fill)."""
    with stage_progress(total, desc) as advance:
        counter.take.remote()
        yield RemoteProgress(Tally(counter), advance, total)
