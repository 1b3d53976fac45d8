"""SLURM node lists (`node[1-3,5],gpu7`) as host names: where a SLURM launch without MASTER_ADDR meets (rank 0's
host). Light: the standard library only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess


def slurm_hostnames(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list (`node[1-3,5],gpu7`), in SLURM's order: the first is where rank 0 runs.

    No library has a public function for this (submitit's `_parse_node_list` is private: not used), so SLURM's own
    `scontrol show hostnames` expands it; where scontrol is missing or cannot answer, `parse_slurm_nodelist` does.
    If either goes wrong, a SLURM launch without MASTER_ADDR rendezvouses at the wrong host
    (tests/system/test_slurm_multinode.py, tests/integration/test_distributed.py)."""
    scontrol = shutil.which("scontrol")
    conf = os.environ.get("SLURM_CONF")
    if scontrol and not (conf and not os.path.exists(conf)):  # a missing SLURM_CONF: scontrol retries for 60 s
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10, check=False
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return parse_slurm_nodelist(nodelist)


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """SLURM's host list syntax: comma-separated names, each with bracketed ranges expanded in order, zero padding
    kept (`gpu[08-10],cpu1,rack[1-2]-n[1,3]`). Raises ValueError on unbalanced or malformed brackets."""
    groups, depth, start = [], 0, 0
    for pos, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"unrecognised SLURM node list {nodelist!r}")
        if char == "," and depth == 0:
            groups.append(nodelist[start:pos])
            start = pos + 1
    if depth:
        raise ValueError(f"unrecognised SLURM node list {nodelist!r}")
    groups.append(nodelist[start:])
    hosts: list[str] = []
    for group in filter(None, (g.strip() for g in groups)):
        names = [""]
        for part in re.split(r"(\[[^\]]*\])", group):
            values = _bracket_values(part[1:-1], nodelist) if part.startswith("[") else [part]
            names = [name + value for name in names for value in values]
        hosts.extend(names)
    return hosts


def _bracket_values(ranges: str, nodelist: str) -> list[str]:
    values = []
    for item in ranges.split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise ValueError(f"unrecognised SLURM node list {nodelist!r}")
        values += [f"{number:0{len(low)}d}" for number in range(int(low), int(high or low) + 1)]
    return values
