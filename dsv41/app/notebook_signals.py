"""How a `dsv41 notebooks` run stops, shared by the runner (`notebooks.py`) and its papermill
engine (`notebook_engine.py`), which both import it: the cell statuses an executed notebook
records, `RunInterrupted`, and the signal state that lets a kernel shutdown finish before a signal
stops the run. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

# The file a run folder's summary is written to (the runner writes it; a repeated signal says so).
SUMMARY_NAME = "summary.json"
# Cell statuses in the executed notebook's papermill metadata: papermill's own four, and ours for a
# cell a signal stopped. "pending" is papermill's word for a cell that has not run.
PENDING, RUNNING, COMPLETED, FAILED, INTERRUPTED = "pending", "running", "completed", "failed", "interrupted"


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run (a KeyboardInterrupt, so asyncio and the kernel client let
    it through as they do Ctrl-C)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def as_interrupt(exc: KeyboardInterrupt) -> RunInterrupted:
    """A plain KeyboardInterrupt (Python's own SIGINT handler) is a SIGINT."""
    return exc if isinstance(exc, RunInterrupted) else RunInterrupted(signal.SIGINT)


class SignalState:
    """What `stop_on_signals` shares with the kernel code: whether a stop was raised, and whether a
    signal must wait (`deferred`) because raising it would tear a kernel shutdown in half."""

    def __init__(self) -> None:
        self.installed = False
        self.raised = False
        self.finished = False  # the run folder is complete: a late signal changes nothing
        self.depth = 0
        self.pending: int | None = None

    def handler(self, signum, frame) -> None:
        if self.finished:
            return
        if self.raised:
            # os.write, not print: a handler may run in the middle of a print to stderr
            os.write(
                2,
                f"dsv41 notebooks: {signal.Signals(signum).name} again; already stopping, "
                f"writing {SUMMARY_NAME}\n".encode(),
            )
            return
        if self.depth:
            self.pending = signum
            return
        self.raised = True
        raise RunInterrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal that arrives inside is raised when the block ends (at once if it raised too)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None and not self.raised:
                signum, self.pending, self.raised = self.pending, None, True
                raise RunInterrupted(signum)


SIGNALS = SignalState()


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM raise RunInterrupted in the main thread, once: a repeated
    signal while the run winds down (kernel shut down, summary written) is ignored with a note, so
    the run folder is left whole, and one during a kernel shutdown waits until it is done. Outside
    the main thread, or nested, this changes nothing."""
    if threading.current_thread() is not threading.main_thread() or SIGNALS.installed:
        yield
        return
    SIGNALS.__init__()
    SIGNALS.installed = True
    previous = {s: signal.signal(s, SIGNALS.handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        SIGNALS.__init__()
