"""The other ranks: which rank runs on which host, so that a rank that goes away mid-run can be named, and waiting
for them at a barrier, said when it takes long.

The backends only say that a connection closed, at best with the peer's address (gloo: `Connection closed by
peer [10.213.0.12]:41234`); the table gathered at start-up turns that address into ranks and a host name.
"""

from __future__ import annotations

import re
import socket
import time

import torch.distributed as dist

from ds_exp.core.waits import POLL_S, Wait

_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def gather_hosts() -> list[tuple[str, list[str]]]:
    """(host name, its addresses) of every rank, in rank order; one small collective at start-up."""
    host = socket.gethostname()
    try:
        addresses = sorted(set(socket.gethostbyname_ex(host)[2]))
    except OSError:
        addresses = []
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, (host, addresses))
    return [(str(name), list(addrs)) for name, addrs in table]


def lost_ranks(error: str, hosts: list[tuple[str, list[str]]], own_rank: int, world: int) -> str:
    """The rank(s) a backend error points at, for a message: `rank 1 (node2)`; `another rank` if unknown.

    With two ranks the other one is the lost one; otherwise the peer address in the error picks the ranks on
    that host (all of them: the backend does not say which process on it went away)."""
    others = [rank for rank in range(world) if rank != own_rank]
    named = [host for host, _ in hosts]
    if len(others) != 1:
        peers = set(_ADDRESS.findall(error))
        others = [r for r, (_, addrs) in enumerate(hosts) if r != own_rank and peers & set(addrs)]
    if not others:
        return "another rank"
    where = sorted({named[r] for r in others}) if len(named) == world else []
    ranks = ", ".join(map(str, others))
    label = f"rank {ranks}" if len(others) == 1 else f"ranks {ranks}"
    return f"{label} ({', '.join(where)})" if where else label


def barrier(point: str) -> None:
    """Collective: wait until every rank reached `point` (what it is, for people: "the end of the save of step100").
    A wait past a few seconds is said (rank 0 prints, every rank logs: ds_exp.core.waits); the group's timeout bounds
    it (dist.timeout_minutes, then torch raises and the session names the rank that is gone)."""
    work = dist.barrier(async_op=True)
    if work is None:
        return
    wait = Wait(f"the other ranks to reach {point}", limit_s=None, fix="", bound="dist.timeout_minutes bounds it")
    pause = 0.001  # most barriers end at once: polled quickly first, then every POLL_S
    while not work.is_completed():
        wait.tick()
        time.sleep(pause)
        pause = min(POLL_S, pause * 2)
    work.wait()  # raises what the backend saw (a timeout, a peer gone)
