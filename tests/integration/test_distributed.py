"""Launch detection: each launcher's environment gives the right rank, world size and rendezvous, and what
the launcher set is never overwritten."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from ds_exp.config.schema import DistConfig
from ds_exp.launch.environment import (
    choose_backend,
    detect_launch,
    export_launch_env,
    launched_with_several_ranks,
    parse_slurm_nodelist,
)
from ds_exp.runtime.peers import lost_ranks
from tests.training import REPO, free_port

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables; the whole environment is restored afterwards (export_launch_env writes to it)."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "SUBMITIT_")) or name in LAUNCH_VARS:
            monkeypatch.delenv(name)

    def set_vars(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    yield set_vars
    os.environ.clear()
    os.environ.update(saved)


def dist(**kw):
    return OmegaConf.merge(OmegaConf.structured(DistConfig), kw)


def test_single_process(clean_env):
    info = detect_launch(dist())
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)
    # alone, any free port: two single-process runs on one machine must not both take 29500 (issue 14)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", info.master_port))
    clean_env(MASTER_PORT="1234")
    assert detect_launch(dist()).master_port == 1234  # what the user set is kept
    assert not launched_with_several_ranks()


def test_torchrun_and_deepspeed_launcher(clean_env):
    clean_env(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", MASTER_ADDR="node0", MASTER_PORT="1234")
    info = detect_launch(dist())
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("env", 3, 1, 4)
    assert (info.master_addr, info.master_port) == ("node0", 1234)
    assert launched_with_several_ranks()


def test_openmpi(clean_env):
    clean_env(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1")
    info = detect_launch(dist(master_port=29999))
    assert (info.launcher, info.rank, info.local_rank, info.world_size, info.master_port) == ("mpi", 1, 1, 2, 29999)
    export_launch_env(info)
    assert [os.environ[n] for n in LAUNCH_VARS] == ["1", "1", "2", "127.0.0.1", "29999"]


def test_mpich_pmi(clean_env):
    clean_env(PMI_RANK="2", PMI_SIZE="3")
    info = detect_launch(dist())
    assert (info.launcher, info.rank, info.world_size) == ("mpi", 2, 3)


def test_plain_srun(clean_env):
    clean_env(
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_NTASKS="2",
        SLURM_STEP_ID="0",
        SLURM_JOB_ID="4711",
        SLURM_JOB_NODELIST="gpu[3-4]",
    )
    info = detect_launch(dist())
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("slurm", 1, 1, 2)
    assert info.master_addr == "gpu3"
    assert info.master_port == 20000 + 4711  # derived from the job id: concurrent jobs do not collide


NODELISTS = {
    "gpu3": ["gpu3"],
    "node[1-3,5],other": ["node1", "node2", "node3", "node5", "other"],
    "a[08-11]": ["a08", "a09", "a10", "a11"],
    "rack[01-02]-gpu[1,3]": ["rack01-gpu1", "rack01-gpu3", "rack02-gpu1", "rack02-gpu3"],
    "z[9-10],x1": ["z9", "z10", "x1"],
}


@pytest.mark.parametrize("nodelist", NODELISTS)
def test_slurm_nodelist_parser(nodelist):
    assert parse_slurm_nodelist(nodelist) == NODELISTS[nodelist]


@pytest.mark.parametrize("nodelist", ["a[1-2", "a]1[", "a[2-1]", "a[x]", "a[[1]]"])
def test_malformed_slurm_nodelist_is_refused(nodelist):
    with pytest.raises(ValueError, match="unrecognised SLURM node list"):
        parse_slurm_nodelist(nodelist)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="no scontrol here (apt-get install slurm-client)")
@pytest.mark.parametrize("nodelist", NODELISTS)
def test_parser_agrees_with_scontrol(nodelist):
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == parse_slurm_nodelist(nodelist)


def test_plain_srun_without_scontrol(clean_env, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)  # slurm_hostnames falls back to the parser
    clean_env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[07-08]")
    assert detect_launch(dist()).master_addr == "n07"


def test_submitit_rendezvous_comes_from_slurm(clean_env):
    """A submitit task of a two-node job: address = the step's first node, port = derived from SLURM_JOB_ID
    (an array task's own id), the same on every rank."""
    clean_env(
        SUBMITIT_EXECUTOR="slurm",
        SLURM_JOB_ID="9",
        SLURM_ARRAY_JOB_ID="8",
        SLURM_ARRAY_TASK_ID="0",
        SLURM_PROCID="1",
        SLURM_LOCALID="0",
        SLURM_NODEID="1",
        SLURM_NTASKS="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_STEP_ID="0",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_STEP_NODELIST="node[1-2]",
    )
    info = detect_launch(dist())
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("submitit", 1, 0, 2)
    assert (info.master_addr, info.master_port, info.local_world_size) == ("node1", 20000 + 9, 1)


def test_forced_launcher_and_what_the_launcher_set_is_kept(clean_env):
    clean_env(RANK="1")
    clean_env(WORLD_SIZE="2")
    clean_env(MASTER_PORT="4242")
    assert detect_launch(dist(launcher="single")).world_size == 1
    info = detect_launch(dist())
    export_launch_env(info)
    assert os.environ["MASTER_PORT"] == "4242" and os.environ["RANK"] == "1"


def test_backend_choice():
    assert choose_backend("auto", "cuda") == "nccl"
    assert choose_backend("auto", "cpu") == "gloo"  # oneCCL's bindings are not installed here
    assert choose_backend("auto", "npu") == "hccl"
    assert choose_backend("mpi", "cpu") == "mpi"


HOSTS = [("node1", ["10.0.0.11"]), ("node1", ["10.0.0.11"]), ("node2", ["10.0.0.12"]), ("node2", ["10.0.0.12"])]


@pytest.mark.parametrize(
    ("error", "own_rank", "world", "named"),
    [
        ("Connection closed by peer [10.0.0.12]:41234", 0, 4, "ranks 2, 3 (node2)"),  # gloo names the peer address
        ("Connection closed by peer [10.0.0.12]:41234", 2, 4, "rank 3 (node2)"),
        ("Connection reset by peer", 0, 4, "another rank"),  # no address, several candidates: not guessed
        ("Connection reset by peer", 1, 2, "rank 0 (node1)"),  # of two ranks, the other one
    ],
)
def test_lost_rank_is_named(error, own_rank, world, named):
    assert lost_ranks(error, HOSTS[:world], own_rank, world) == named


# --- the rendezvous failing: real TCPStores (what torch's env:// rendezvous builds), with a timeout of 0.3 s
def _store(port: int, *, master: bool, world: int = 2):
    import datetime

    import torch.distributed as torch_dist

    return lambda: torch_dist.TCPStore(
        "127.0.0.1", port, world_size=world, is_master=master, timeout=datetime.timedelta(milliseconds=300)
    )


def _launch(rank: int, world: int, port: int):
    from ds_exp.launch.environment import LaunchInfo

    return LaunchInfo("env", rank, rank, world, "127.0.0.1", port)


def test_ranks_that_never_join_are_named_with_the_rendezvous_and_the_timeout():
    from ds_exp.core.errors import RunFailed
    from ds_exp.launch.rendezvous import rendezvous_failure, wait_for_rendezvous

    port = free_port()
    with pytest.raises(RunFailed) as info:  # rank 0 alone: torch's DistStoreError "1/2 clients joined"
        wait_for_rendezvous(_store(port, master=True), _launch(0, 2, port), 7)
    assert str(info.value) == (
        f"only 1 of the 2 ranks reached the rendezvous at 127.0.0.1:{port} within dist.timeout_minutes=7: rank 1 "
        "never joined. Start every rank (the launcher's process count must be WORLD_SIZE=2), check that each can "
        f"reach 127.0.0.1:{port} (MASTER_ADDR, MASTER_PORT, a firewall), or raise dist.timeout_minutes if they "
        "start late"
    )
    some = rendezvous_failure(  # torch's words when some others came: it counts them, it does not name them
        RuntimeError("Timed out after 61 seconds waiting for clients. 2/4 clients joined."), _launch(0, 4, port), 7
    )
    assert some is not None and "only 2 of the 4 ranks reached" in some and "2 of ranks 1 to 3 never joined" in some
    with pytest.raises(RunFailed) as info:  # another rank, and no rank 0 to find
        wait_for_rendezvous(_store(port, master=False), _launch(1, 2, port), 7)
    assert str(info.value).startswith(
        f"rank 1 could not reach rank 0 at 127.0.0.1:{port} within dist.timeout_minutes=7: rank 0 never opened"
    )


def test_a_port_in_use_is_one_message_naming_master_port():
    from ds_exp.core.errors import RunFailed
    from ds_exp.launch.rendezvous import wait_for_rendezvous

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RunFailed) as info:
            wait_for_rendezvous(_store(port, master=True, world=1), _launch(0, 1, port), 30)
    assert str(info.value).startswith(
        f"MASTER_PORT={port}: rank 0 cannot open the rendezvous on port {port} (address already in use"
    )
    assert "torchrun --master_port PORT, or MASTER_PORT=PORT" in str(info.value)


BARRIER_RANK = """
import datetime, os, sys, time
import torch.distributed as dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["RANK"] = str(rank)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
from ds_exp.core import waits
waits.NOTICE_S = 0.3
from ds_exp.runtime.peers import barrier
if rank == 1:
    time.sleep(2.0)  # a slow rank: writing its shard of a checkpoint, say
barrier("the test's point")
print("passed", flush=True)
"""


def test_a_rank_waiting_at_a_barrier_for_a_slow_peer_says_so(tmp_path):
    """Issue 31 §3: a wait for a peer is said within seconds (rank 0 prints) and bounded by the group's timeout."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BARRIER_RANK, str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    (out0, err0), (out1, err1) = (proc.communicate(timeout=120) for proc in procs)
    assert [proc.returncode for proc in procs] == [0, 0], err0[-2000:] + err1[-2000:]
    assert out0.splitlines()[-1] == out1.splitlines()[-1] == "passed"
    assert "ds_exp: waiting for the other ranks to reach the test's point since " in err0
    assert "dist.timeout_minutes bounds it" in err0
    assert "ds_exp: waiting" not in err1  # the slow rank waited for nobody
