"""How the process was launched, from the environment only (no torch): launcher, rank, world size, rendezvous address;
inconsistent launcher variables; the backend and CPU threads a rank should use."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import overload

from ds_exp.config.schema import DistConfig, plain
from ds_exp.core.errors import ConfigError
from ds_exp.launch.rendezvous import free_port


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # single | env | mpi | submitit | slurm
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_world_size: int = 1  # ranks on this node (they share its CPU cores)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@overload
def _int_env(*names: str, default: int) -> int: ...
@overload
def _int_env(*names: str, default: None = None) -> int | None: ...
def _int_env(*names: str, default: int | None = None) -> int | None:
    """The first of `names` set to a whole number in the environment, else `default`."""
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return default


def _in_submitit_job() -> bool:
    return "SUBMITIT_EXECUTOR" in os.environ or "SUBMITIT_FOLDER" in os.environ


def _auto_launcher() -> str:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "env"
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env or "PMIX_RANK" in env:
        return "mpi"
    if _in_submitit_job():
        return "submitit"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and _int_env("SLURM_NTASKS", default=1) > 1:
        return "slurm"
    return "single"


def detect_launch(dist_cfg: DistConfig | None = None) -> LaunchInfo:
    launcher = plain(dist_cfg.launcher) if dist_cfg is not None else "auto"
    default_port = int(dist_cfg.master_port) if dist_cfg is not None else 29500
    if launcher == "auto":
        launcher = _auto_launcher()
    env = os.environ
    port = _int_env("MASTER_PORT", default=default_port)
    if launcher == "single":
        # alone: any free port (two single-GPU runs on one machine would both take 29500)
        port = _int_env("MASTER_PORT") or free_port()
        return LaunchInfo("single", 0, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), port)
    if launcher == "env":
        return LaunchInfo(
            "env",
            _int_env("RANK", default=0),
            _int_env("LOCAL_RANK", default=0),
            _int_env("WORLD_SIZE", default=1),
            env.get("MASTER_ADDR", "127.0.0.1"),
            port,
            _int_env("LOCAL_WORLD_SIZE", default=_int_env("WORLD_SIZE", default=1)),
        )
    if launcher == "mpi":
        rank = _int_env("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", default=0)
        world = _int_env("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)
        local = _int_env("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID", default=None)
        if local is None:
            local = rank  # single node MPICH without a local-rank variable
        # every rank must agree on the address: without MASTER_ADDR it can only be this node (single node)
        local_world = _int_env("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", default=world)
        return LaunchInfo("mpi", rank, local, world, env.get("MASTER_ADDR", "127.0.0.1"), port, local_world)
    if launcher == "submitit":
        # JobEnvironment reads SLURM's variables only (not CUDA_VISIBLE_DEVICES); the rendezvous is a plain srun's
        import submitit  # only inside a submitit job: every other launch starts without its import time

        try:
            job_env = submitit.JobEnvironment()
        except RuntimeError:  # not a job submitit started: submitit finds no environment of its own
            raise ConfigError(
                "dist.launcher=submitit, but this process is not a job submitit started; leave dist.launcher=auto, "
                "or sweep with hydra/launcher=slurm (or local), which starts its jobs through submitit"
            ) from None
        master = _first_slurm_host()
        # submitit's local executor sets no SLURM variables: its own job id keeps concurrent jobs apart there
        job_id = env.get("SLURM_JOB_ID") or job_env.job_id
        job_port = _int_env("MASTER_PORT", default=_job_port(job_id, default_port))
        return LaunchInfo(
            "submitit",
            job_env.global_rank,
            job_env.local_rank,
            job_env.num_tasks,
            env.get("MASTER_ADDR", master),
            job_port,
            job_env.num_tasks // max(job_env.num_nodes, 1),
        )
    if launcher == "slurm":
        return LaunchInfo(
            "slurm",
            _int_env("SLURM_PROCID", default=0),
            _int_env("SLURM_LOCALID", default=0),
            _int_env("SLURM_NTASKS", default=1),
            env.get("MASTER_ADDR") or _first_slurm_host(),
            _int_env("MASTER_PORT", default=_job_port(env.get("SLURM_JOB_ID"), default_port)),
            _int_env("SLURM_NTASKS", default=1) // max(_int_env("SLURM_NNODES", default=1), 1),
        )
    raise ValueError(f"unknown dist.launcher {launcher}")


_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def launch_env_problems() -> list[str]:
    """Launcher variables that cannot describe a launch (a process would wait for ranks that never come)."""
    env = os.environ
    problems = []
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        value = env.get(name)
        if value is not None and not value.strip().isdigit():
            problems.append(f"{name}={value!r} is not a whole number; unset it or let the launcher set it")
    rank, world = _int_env("RANK"), _int_env("WORLD_SIZE")
    local, local_world = _int_env("LOCAL_RANK"), _int_env("LOCAL_WORLD_SIZE")
    if world is not None and world > 1 and rank is None and not any(v in env for v in _RANK_VARIABLES):
        problems.append(
            f"WORLD_SIZE={world} is set but RANK is not: each of the {world} processes needs its own RANK. Start "
            f"them with a launcher (torchrun --nproc_per_node {world} -m ds_exp ...), or unset WORLD_SIZE to train "
            "in one process"
        )
    if rank is not None and world is None:
        problems.append(f"RANK={rank} is set but WORLD_SIZE is not: set both (a launcher does), or unset RANK")
    if rank is not None and world is not None and not 0 <= rank < world:
        problems.append(f"RANK={rank} with WORLD_SIZE={world}: ranks go from 0 to {world - 1}; fix RANK or WORLD_SIZE")
    if local is not None and local_world is not None and not 0 <= local < local_world:
        problems.append(
            f"LOCAL_RANK={local} with LOCAL_WORLD_SIZE={local_world}: local ranks go from 0 to {local_world - 1}"
        )
    port = _int_env("MASTER_PORT")
    # 0 lets the system pick a port: fine alone, but then no other rank can know it
    if port is not None and not (1 if (world or 1) > 1 else 0) <= port <= 65535:
        problems.append(
            f"MASTER_PORT={port} is not a TCP port the ranks can meet on (1 to 65535); set MASTER_PORT to a free "
            "port, e.g. 29500, or unset it"
        )
    return problems


def _job_port(job_id: str | None, default: int) -> int:
    """A port derived from the SLURM job id, so concurrent jobs on one node do not collide."""
    digits = "".join(ch for ch in str(job_id or "") if ch.isdigit())
    return 20000 + int(digits) % 20000 if digits else default


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return "127.0.0.1"

    hosts = slurm_hostnames(nodelist)
    return hosts[0] if hosts else socket.gethostname()


def export_launch_env(info: LaunchInfo) -> None:
    """Publish the launch as the torch.distributed env:// variables, keeping whatever the launcher set."""
    values = {
        "RANK": info.rank,
        "LOCAL_RANK": info.local_rank,
        "WORLD_SIZE": info.world_size,
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": info.master_port,
    }
    for name, value in values.items():
        os.environ.setdefault(name, str(value))


def launch_rank_from_env() -> int:
    """This process's global rank as any launcher announces it (0 when alone); reads the environment only."""
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        value = _int_env(name)
        if value is not None:
            return value
    if "SLURM_STEP_ID" in os.environ and _int_env("SLURM_NTASKS", default=1) > 1 and not _in_submitit_job():
        return _int_env("SLURM_PROCID", default=0)
    return 0


def launched_with_several_ranks() -> bool:
    """torchrun, the deepspeed launcher, mpirun or srun started this process as one of several."""
    world = _int_env("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=None)
    if world is None and "SLURM_STEP_ID" in os.environ and not _in_submitit_job():
        world = _int_env("SLURM_NTASKS", default=1)
    return (world or 1) > 1


def choose_backend(requested: str, accelerator: str) -> str:
    """nccl on CUDA, hccl on Ascend, ccl where oneCCL's bindings import, gloo otherwise; `requested` wins."""
    if requested != "auto":
        return requested
    if accelerator == "cuda":
        return "nccl"
    if accelerator in ("npu", "hpu"):
        return "hccl"
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401
    except ImportError:
        return "gloo"
    return "ccl"


def cpu_threads_per_rank(launch: LaunchInfo) -> int | None:
    """Intra-op threads per rank unless OMP_NUM_THREADS is set: SLURM's CPUs per task, else the node's cores shared."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    per_task = _int_env("SLURM_CPUS_PER_TASK")
    if per_task and launch.launcher in ("submitit", "slurm"):
        return per_task
    return max(1, len(os.sched_getaffinity(0)) // max(launch.local_world_size, 1))


def slurm_hostnames(nodelist: str) -> list[str]:
    """A SLURM node list's hosts in order (first: rank 0's), by `scontrol show hostnames` or parse_slurm_nodelist."""
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
    """SLURM's host list syntax (`gpu[08-10],rack[1-2]-n[1,3]`), zero padding kept; ValueError on malformed brackets."""
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
