"""The other ranks: the host of each (gathered at start-up), so that a rank whose connection closed mid-run can be named
from the peer address the backend gives; barriers, said when they take long."""

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
    """The rank(s) a backend error points at: the other of two, else every rank on the peer address's host."""
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
    """Collective: wait until every rank reached `point` (said for people when the wait is long)."""
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
