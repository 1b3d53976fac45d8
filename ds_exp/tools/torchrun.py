"""`python -m ds_exp.tools.torchrun` (launchers/torchrun.sh): torchrun ending on the failed rank's own message and exit
status, not its 30-line report; a rank a signal ended silently gets one line naming it."""

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
    for name in list(logging.root.manager.loggerDict):  # torchrun's agent: no notices of each rank's exit and signals
        if any(name == prefix or name.startswith(f"{prefix}.") for prefix in _NOTICES):
            logging.getLogger(name).setLevel(logging.CRITICAL)
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
