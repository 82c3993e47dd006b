"""The papermill engine `dsv41 notebooks` runs each notebook with.

It is papermill's nbclient engine with three changes, none of which touches what a cell
computes. (1) Papermill marks a cell "completed" whenever its execution ends, and at the end
marks every "pending" cell "completed" too, so a timeout or a signal left a notebook claiming
that every cell ran; here a cell an exception leaves (a timeout, a dead kernel: "failed"; a
signal: "interrupted") says so, and the cells after it stay "pending". (2) That cell is
interrupted in the kernel before the kernel is shut down, so the shutdown is quick and the
kernel prints no traceback. (3) A signal while the kernel starts kills it (it has run nothing),
and one during the kernel's shutdown waits until the shutdown is done, so no kernel outlives
the run.

This module imports papermill, nbclient and jupyter_core at its top, so `dsv41.app.notebooks` imports it
only when a run starts (`notebooks._engine`), and `dsv41 notebooks --help` stays light; what the two
share (the cell statuses, the signal state) is `notebook_signals.py`'s, so the imports go one way.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import signal
import time

from jupyter_core.utils import ensure_async, run_sync
from nbclient.exceptions import CellExecutionError
from papermill.clientwrap import PapermillNotebookClient
from papermill.engines import NBClientEngine, NotebookExecutionManager, papermill_engines
from papermill.utils import merge_kwargs, remove_args

from .notebook_signals import FAILED, INTERRUPTED, RUNNING, SIGNALS

ENGINE_NAME = "dsv41"
# nbclient's own log lines ("Timeout waiting for execute reply") would interleave with the progress
# lines; what they say reaches the progress line and summary.json as the error
_CLIENT_LOG = logging.getLogger("dsv41.app.notebooks.nbclient")
_CLIENT_LOG.addHandler(logging.NullHandler())


class Manager(NotebookExecutionManager):
    stopped_by: BaseException | None = None

    def stop(self, exc: BaseException) -> None:
        """`exc` ended the execution: the cell still "running" did not finish."""
        self.stopped_by = exc
        interrupted = isinstance(exc, KeyboardInterrupt)
        now = self.now()
        for cell in self.nb.cells:
            meta = cell.metadata.get("papermill", {})
            if meta.get("status") != RUNNING:
                continue
            meta["status"] = INTERRUPTED if interrupted else FAILED
            meta["exception"] = not interrupted
            meta["end_time"] = now.isoformat()
            if meta.get("start_time"):
                begun = datetime.datetime.fromisoformat(meta["start_time"])
                meta["duration"] = (now - begun).total_seconds()
        if not interrupted:
            self.nb.metadata.papermill["exception"] = True

    def notebook_complete(self, **kwargs):
        if self.stopped_by is None:
            return super().notebook_complete(**kwargs)
        # papermill's version marks every "pending" cell "completed"; after a stop they never ran
        self.end_time = self.now()
        self.nb.metadata.papermill["end_time"] = self.end_time.isoformat()
        if self.start_time is not None:
            self.nb.metadata.papermill["duration"] = (self.end_time - self.start_time).total_seconds()
        self.cleanup_pbar()
        self.save()


class Client(PapermillNotebookClient):
    def papermill_execute_cells(self):
        # papermill's loop, except that a cell an exception leaves stays "running" (the manager
        # marks it) instead of being marked "completed" on the way out
        for index, cell in enumerate(self.nb.cells):
            self.nb_man.cell_start(cell, index)
            try:
                self.execute_cell(cell, index)
            except CellExecutionError as ex:
                self.nb_man.cell_exception(self.nb.cells[index], cell_index=index, exception=ex)
                self.nb_man.cell_complete(self.nb.cells[index], cell_index=index)
                break
            except BaseException:
                self._interrupt_busy_kernel()
                raise
            self.nb_man.cell_complete(self.nb.cells[index], cell_index=index)

    def _interrupt_busy_kernel(self) -> None:
        with SIGNALS.deferred():
            if self.km is not None and self.km.has_kernel:
                with contextlib.suppress(Exception):
                    run_sync(self._async_interrupt_busy_kernel)()

    async def _async_end_left_over_tasks(self) -> None:
        """End the tasks a KeyboardInterrupt left on the event loop (nbclient polls the kernel's
        channels in tasks of its own; they would read the replies waited for next), reading
        their exceptions (nbclient turns a cancellation into DeadKernelError) so that asyncio
        does not print them as never retrieved."""
        import asyncio

        left_over = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in left_over:
            task.cancel()
        if left_over:
            await asyncio.wait(left_over, timeout=2)
        for task in left_over:
            if task.done() and not task.cancelled():
                task.exception()

    async def _async_interrupt_busy_kernel(self, wait_s: float = 5.0) -> None:
        """Interrupt the running cell and wait (at most `wait_s`) until the kernel has answered a
        request sent after it, so that the shutdown that follows closes no socket the kernel is
        still replying on (it would print a traceback)."""
        import queue

        await self._async_end_left_over_tasks()
        await ensure_async(self.km.interrupt_kernel())
        if self.kc is None:
            return
        msg_id = self.kc.kernel_info()  # shell requests are answered in order
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await ensure_async(self.kc.shell_channel.get_msg(timeout=left))
            except queue.Empty:
                return
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return

    async def _async_kill_starting_kernel(self) -> None:
        await self._async_end_left_over_tasks()
        await ensure_async(self.km.signal_kernel(signal.SIGKILL))

    @contextlib.contextmanager
    def setup_kernel(self, **kwargs):
        # nbclient's, except that a signal while the kernel starts kills it (it has run nothing;
        # a shutdown would interrupt its imports and print their traceback, and nbclient cleans
        # up only after an Exception), and one during the shutdown waits until the shutdown ends
        cleanup_kc = kwargs.pop("cleanup_kc", self.owns_km)
        if self.km is None:
            self.km = self.create_kernel_manager()
        try:
            if not self.km.has_kernel:
                self.start_new_kernel(**kwargs)
            if self.kc is None:
                self.start_new_kernel_client()
        except KeyboardInterrupt:
            with SIGNALS.deferred():
                if self.km is not None and self.km.has_kernel:
                    with contextlib.suppress(Exception):
                        run_sync(self._async_kill_starting_kernel)()
                if self.km is not None:
                    with contextlib.suppress(Exception):
                        self._cleanup_kernel()
            raise
        try:
            yield
        finally:
            if cleanup_kc and self.km is not None:
                with SIGNALS.deferred():
                    self._cleanup_kernel()


class Engine(NBClientEngine):
    @classmethod
    def execute_notebook(
        cls, nb, kernel_name, output_path=None, progress_bar=True, log_output=False, autosave_cell_every=30, **kwargs
    ):
        nb_man = Manager(
            nb,
            output_path=output_path,
            progress_bar=progress_bar,
            log_output=log_output,
            autosave_cell_every=autosave_cell_every,
        )
        nb_man.notebook_start()
        try:
            cls.execute_managed_notebook(nb_man, kernel_name, log_output=log_output, **kwargs)
        except BaseException as exc:
            nb_man.stop(exc)
            raise
        finally:
            nb_man.cleanup_pbar()
            nb_man.notebook_complete()
        return nb_man.nb

    @classmethod
    def execute_managed_notebook(
        cls,
        nb_man,
        kernel_name,
        log_output=False,
        stdout_file=None,
        stderr_file=None,
        start_timeout=60,
        execution_timeout=None,
        **kwargs,
    ):
        # NBClientEngine's, with this module's client and its quiet log
        kwargs = remove_args(["input_path"], **kwargs)
        safe_kwargs = remove_args(["timeout", "startup_timeout"], **kwargs)
        final_kwargs = merge_kwargs(
            safe_kwargs,
            timeout=execution_timeout if execution_timeout else kwargs.get("timeout"),
            startup_timeout=start_timeout,
            kernel_name=kernel_name,
            log=_CLIENT_LOG,
            log_output=log_output,
            stdout_file=stdout_file,
            stderr_file=stderr_file,
        )
        return Client(nb_man, **final_kwargs).execute()


def register() -> str:
    """Register the engine with papermill under ENGINE_NAME and return that name."""
    papermill_engines.register(ENGINE_NAME, Engine)
    return ENGINE_NAME
