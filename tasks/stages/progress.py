"""Progress bars for the long stages (rollout, window calibration) that show in a terminal and in
Prefect's logs (issue 19, item 13).

`stage_progress(total, desc)` yields the callback `advance(n)` that `cast_core.rollout.rollout` and
`cast_core.calibration.similarity_curves` call after each denoising step. Inside a Prefect run the
tqdm bar writes to the run's logger, one INFO line per refresh and at most one every
`LOG_INTERVAL_S` seconds, so it shows in the worker's output (what `scripts/main.sh` prints), in
`python -m flows.cast` and in the UI; outside a run it is a plain tqdm bar on stderr, shown only
when stderr is a terminal.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm import tqdm

LOG_INTERVAL_S = 10.0


class LoggerStream(io.TextIOBase):
    """A text stream that logs each non-empty line tqdm writes (tqdm starts each with '\\r')."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter) -> None:
        self.logger = logger

    def write(self, text: str) -> int:
        line = text.strip("\r\n ")
        if line:
            self.logger.info(line)
        return len(text)


def _run_logger() -> logging.Logger | logging.LoggerAdapter | None:
    """The Prefect run logger, or None outside a flow or task run."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return None


@contextmanager
def stage_progress(total: int, desc: str, unit: str = "step",
                   logger: logging.Logger | logging.LoggerAdapter | None = None,
                   ) -> Iterator[Callable[[int], None]]:
    """A tqdm bar of `total` units for the current stage; yields its `update`. Lines go to
    `logger`, else to the Prefect run's logger inside a run, else to a terminal's stderr."""
    logger = logger or _run_logger()
    if logger is None:
        bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None)
    else:
        bar = tqdm(total=total, desc=desc, unit=unit, file=LoggerStream(logger), ascii=True,
                   ncols=90, mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S)
    with bar:
        yield bar.update
