"""`python -m ds_exp.tools.torchrun` (what launchers/torchrun.sh runs): torch's elastic launcher, torchrun, with an
end a person reads.

torchrun ends a failed launch with a 30-line report (ChildFailedError's traceback and a table of each rank's exit)
after the rank that failed first has said why itself: ds_exp's ranks say it on the console, once for all of them
(ds_exp/launch/console.py). Here that rank's message stays the last line and its exit status is torchrun's (2: a
refusal, nothing was done; 130, 143: stopped by a signal, with the command that continues). A rank that a signal
ended without a word (the kernel's out-of-memory killer, `kill -9`) gets one line naming it. torchrun's own notices
of the launch (the SIGTERM it sends the other ranks, each rank's exit) go unsaid; its arguments are torchrun's.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from ds_exp.launch.console import entry_point

# the agent's loggers: what each rank's exit already said, again
_NOTICES = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def quiet_notices() -> None:
    """torchrun's agent logs every rank's exit (ERROR) and the signals it sends the others (WARNING): the ranks'
    own lines and the one line below say what matters. Its loggers set their level when created (LOGLEVEL)."""
    for name in list(logging.root.manager.loggerDict):
        if any(name == prefix or name.startswith(f"{prefix}.") for prefix in _NOTICES):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def failure_status(err: ChildFailedError) -> tuple[int, str | None]:
    """The exit status of a failed launch, the first failure's, and what to print (None: the rank said why)."""
    rank, failure = err.get_first_failure()
    if failure.exitcode >= 0:
        return failure.exitcode, None  # exited by itself: ds_exp's boundary (or Python) printed why
    signum = -failure.exitcode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    line = (
        f"ds_exp: error: rank {rank} (pid {failure.pid} on {socket.gethostname()}) was ended by {name} before it "
        "could say why (the out-of-memory killer sends SIGKILL); torchrun stopped the other ranks. Its log, up to "
        "then, is logs/rank<N>.log in the run directory"
    )
    return 128 + signum, line


@entry_point("ds_exp.tools.torchrun")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    quiet_notices()
    try:
        run(args)
    except ChildFailedError as err:
        status, line = failure_status(err)
        if line is not None:
            print(line, file=sys.stderr)
        return status
    except SignalException as err:  # torchrun itself was stopped (SIGTERM): it passed the signal to the ranks
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
