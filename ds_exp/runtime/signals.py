"""Stop signals: every rank saves a checkpoint after the same step (voted), then leaves (under submitit requeued, else
with 128 + the signal). Before the first step a signal stops at once; off the main thread none are installed."""

from __future__ import annotations

import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

from ds_exp.core import compat
from ds_exp.core.status import RunStatus

log = logging.getLogger(__name__)

# what signal.signal returns and accepts (typeshed's private _HANDLER)
_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None

_REQUEUE_WAIT_S = 300  # how long ranks > 0 wait for the requeue to end them before leaving by themselves


class StopRequested(Exception):
    """Raised by the loop once every rank has agreed to stop and the checkpoint (if any) is complete."""

    def __init__(self, reason: str, step: int | None, checkpoint: str | None, status: RunStatus) -> None:
        self.reason, self.step, self.checkpoint, self.status = reason, step, checkpoint, status
        if step is None:
            super().__init__(f"stopped by {reason} before the first training step; no checkpoint was written")
            return
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step was trained)"
        super().__init__(f"stopped by {reason} after step {step}; {where}")


class StopSignals:
    """Installs the stop handlers for one run and knows how to leave once the run has stopped."""

    def __init__(self, launcher: str) -> None:
        self.under_submitit = launcher == "submitit"
        self.signum: int | None = None
        self.immediate = True  # before the training loop: stop at once (set False when the loop starts)
        self._previous: dict[int, _Handler] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def reason(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def stopped_status(self) -> RunStatus:
        """The run's status once stopped: requeued under submitit, stopped (resumable by hand) elsewhere."""
        return RunStatus.REQUEUED if self.under_submitit else RunStatus.STOPPED

    def watched(self) -> list[int]:
        if self.under_submitit:
            return [compat.submitit_requeue_signal()]  # SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise
        return [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]

    def install(self) -> None:
        self.pid = os.getpid()
        if threading.current_thread() is not threading.main_thread():  # Python handles signals there only
            log.warning(
                "this run is not on the process's main thread, where Python handles signals (ds_exp.train called "
                "from a thread, e.g. asyncio.to_thread): a stop signal (Ctrl-C, SIGTERM) saves no checkpoint for it"
            )
            return
        for signum in self.watched():
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put the handlers found at install() back; they stay known to leave()."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:
            # a forked worker inherited this handler: it dies as by default, for its pool's terminate() to reap
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGHUP:
            leave_hung_up_terminal()
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now, without the checkpoint
        if self.signum is not None and signum == signal.SIGHUP:
            return  # the stop asked first stands (its message names it)
        self.signum = signum
        if self.immediate:
            log.warning("caught %s before training started: stopping now", self.reason)
            raise StopRequested(self.reason, None, None, self.stopped_status)
        log.warning("caught %s: saving a checkpoint after the current step, then stopping", self.reason)

    def behind(self, exc: BaseException) -> StopRequested | None:
        """The stop behind `exc` (a library may raise its own over a signal's: datasets' pool, a TimeoutError)."""
        seen: BaseException | None = exc
        while seen is not None:
            if isinstance(seen, StopRequested):
                return seen
            seen = seen.__cause__ or seen.__context__
        if self.requested and self.immediate:
            return StopRequested(self.reason, None, None, self.stopped_status)
        return None

    def leave(self, rank: int) -> NoReturn:
        """Exit after a stop; under submitit rank 0 requeues, the others wait for SLURM to end them."""
        assert self.signum is not None
        if not self.under_submitit:
            sys.exit(128 + self.signum)
        if rank == 0:
            handler = self._previous.get(self.signum)
            if callable(handler):
                handler(self.signum, None)  # submitit: dump the re-submission, scontrol requeue, sys.exit(-1)
            sys.exit(-1)
        deadline = time.monotonic() + _REQUEUE_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(1)
        sys.exit(-1)


def leave_hung_up_terminal() -> None:
    """Point stdout and stderr away from a terminal that hung up (its writes fail with EIO from now on)."""
    for fd in (1, 2):
        try:
            # a hung-up terminal fails isatty() too: any character device but /dev/null goes; pipes and files stay
            mode = os.fstat(fd)
            if not stat.S_ISCHR(mode.st_mode) or os.path.samestat(mode, os.stat(os.devnull)):
                continue
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except OSError:
            pass
