"""Where the ranks meet (torch's env:// rendezvous, through DeepSpeed): waiting for it without holding off the stop
signals, and what went wrong as one message (a port already taken, ranks that never came, no rank 0 to find)."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from typing import Protocol

from ds_exp.core.errors import RunFailed
from ds_exp.core.waits import WaitGaveUp, run_announced


class Ranks(Protocol):
    """What the messages name of a launch (ds_exp.launch.environment.LaunchInfo, which imports this module)."""

    @property
    def launcher(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def master_addr(self) -> str: ...
    @property
    def master_port(self) -> int: ...


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_rendezvous(start: Callable[[], object], launch: Ranks, timeout_minutes: int) -> None:
    """Run `start` (the rendezvous) in a thread so a blocked one does not hold off Ctrl-C and SIGTERM."""
    where = f"{launch.master_addr}:{launch.master_port}"
    what = (
        f"the {launch.world_size} ranks to meet at {where} (this is rank {launch.rank})"
        if launch.world_size > 1
        else f"the rendezvous at {where}"
    )
    try:
        run_announced(
            what,
            start,
            # torch gives up after dist.timeout_minutes; this is a backstop should it not
            limit_s=timeout_minutes * 60 + 60,
            fix=f"check that every rank was started and can reach {where}, or raise dist.timeout_minutes",
            speak=True,
            bound=f"torch gives up after dist.timeout_minutes={timeout_minutes}",
        )
    except WaitGaveUp:
        raise
    except BaseException as exc:
        message = rendezvous_failure(exc, launch, timeout_minutes)
        if message is not None:
            raise RunFailed(message) from exc
        raise


_JOINED = re.compile(r"(\d+)/(\d+) clients joined")


def rendezvous_failure(exc: BaseException, launch: Ranks, timeout_minutes: int) -> str | None:
    """torch's error text of a failed rendezvous as one message naming the variables to fix; None for anything else."""
    text = " ".join(str(exc).split())
    where = f"{launch.master_addr}:{launch.master_port}"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        fixes = {
            "single": "unset MASTER_PORT (one process then picks a free port itself) or set it to a free one",
            "env": "start the launcher on a free port (torchrun --master_port PORT, or MASTER_PORT=PORT)",
            "mpi": "give every rank a free port (mpirun -x MASTER_PORT=PORT)",
        }
        fix = fixes.get(launch.launcher, "set MASTER_PORT to a free port in the job's environment")
        return (
            f"MASTER_PORT={launch.master_port}: rank 0 cannot open the rendezvous on port {launch.master_port} "
            f"(address already in use: another run or program listens there); {fix}, e.g. {free_port()}"
        )
    joined = _JOINED.search(text)
    if joined is not None and "timed out" in text.lower():
        came, world = int(joined.group(1)), int(joined.group(2))
        others = "rank 1" if world == 2 else f"ranks 1 to {world - 1}"
        missing = (
            f"{others} never joined"
            if came <= 1
            else f"{world - came} of {others} never joined (the ranks that did name themselves in their logs)"
        )
        return (
            f"only {came} of the {world} ranks reached the rendezvous at {where} within dist.timeout_minutes="
            f"{timeout_minutes}: {missing}. Start every rank (the launcher's process count must be WORLD_SIZE="
            f"{world}), check that each can reach {where} (MASTER_ADDR, MASTER_PORT, a firewall), or raise "
            "dist.timeout_minutes if they start late"
        )
    if launch.rank != 0 and "timed out" in text.lower() and "connect" in text.lower():
        return (
            f"rank {launch.rank} could not reach rank 0 at {where} within dist.timeout_minutes={timeout_minutes}: "
            f"rank 0 never opened the rendezvous there. Check that rank 0 was started and that MASTER_ADDR="
            f"{launch.master_addr} and MASTER_PORT={launch.master_port} name its host and a port it can open"
        )
    return None
