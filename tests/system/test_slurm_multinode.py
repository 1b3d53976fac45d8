"""Runs across two SLURM nodes: `launchers/slurm_cluster.sh start --nodes 2` (each node a slurmd in its own network
and UTS namespace, node1 and node2 on a private bridge), so the ranks of one run talk TCP between hosts.

The cluster: the one the environment points at when it has two nodes (.ci/run starts the two-node cluster as the
machine's cluster, and tests/system/test_slurm.py uses it too: its 1-node jobs run on either node). Otherwise a private
two-node cluster is started beside whatever runs already (own slurm.conf, state and controller port, so a one-node
cluster and its jobs are left alone) and stopped again afterwards; the tests hand its SLURM_CONF to every sbatch,
srun and sweep they start."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.training import FAST, REPO, assert_close, launch, logged_steps, multirun, report_rows, user_env

pytestmark = pytest.mark.slow

CLUSTER_SCRIPT = REPO / "launchers" / "slurm_cluster.sh"
PRIVATE_DIR = "/tmp/ds_exp_slurm_2node"
PRIVATE = {"SLURM_DEV_DIR": PRIVATE_DIR, "SLURM_CONF": f"{PRIVATE_DIR}/slurm.conf", "SLURM_DEV_PORT": "6827"}
LAUNCH_LINE = re.compile(r"launch (\w+): rank (\d+) of (\d+) on (\S+), rendezvous (\S+):(\d+),")


def _nodes_up(env: dict[str, str]) -> list[str]:
    """The nodes of the cluster `env` points at that can run jobs now."""
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [line.split() for line in out.stdout.splitlines()] if out.returncode == 0 else []
    return sorted({row[0] for row in rows if len(row) == 2 and row[1].rstrip("*") in ("idle", "mix", "alloc")})


@pytest.fixture(scope="module")
def cluster_env() -> Iterator[dict[str, str]]:
    """The environment (a user's, plus SLURM_CONF where needed) under which SLURM commands reach two nodes."""
    base = {**user_env(), "PYTHON": sys.executable}
    if len(_nodes_up(base)) >= 2:
        yield base
        return
    env = {**base, **PRIVATE}
    if len(_nodes_up(env)) >= 2:  # left running by hand or by an earlier session: use it, leave it
        yield env
        return
    if shutil.which("slurmctld") is None or os.geteuid() != 0:
        pytest.skip("no SLURM here: apt-get install slurm-wlm munge iproute2 and run as root (.ci/run does both)")
    started = subprocess.run(
        [str(CLUSTER_SCRIPT), "start", "--nodes", "2"], env=env, capture_output=True, text=True, timeout=120
    )
    if started.returncode != 0 or len(_nodes_up(env)) < 2:
        reason = (started.stderr.strip().splitlines() or ["no reason given"])[-1]
        subprocess.run([str(CLUSTER_SCRIPT), "stop"], env=env, capture_output=True, timeout=120)
        pytest.skip(f"the two-node SLURM cluster did not start: {reason}")
    try:
        yield env
    finally:
        subprocess.run([str(CLUSTER_SCRIPT), "stop"], env=env, capture_output=True, timeout=120)


def job_output(path: Path) -> str:
    """A job's output file: srun interleaves its tasks' output in chunks, which can split a character in two."""
    return path.read_text(errors="replace") if path.exists() else ""


def launch_lines(run_dir: Path) -> dict[int, tuple[str, int, str]]:
    """rank -> (launcher, world size, host) from each rank's log, after checking that every rank met the others
    at rank 0's host, on a port derived from the SLURM job id (20000 + id % 20000)."""
    found, rendezvous = {}, set()
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        match = LAUNCH_LINE.search(log.read_text())
        assert match, f"no launch line in {log}"
        launcher, rank, world, host, address, port = match.groups()
        found[int(rank)] = (launcher, int(world), host)
        rendezvous.add((address, int(port)))
    assert len(rendezvous) == 1, rendezvous
    ((address, port),) = rendezvous
    assert address == found[0][2] and 20000 <= port < 40000, (address, port, found)
    return found


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["type"] == "train"]


# MASTER_ADDR as a user's script finds it, with SLURM's own tool; every rank all-reduces its rank + 1
GLOO_ALL_REDUCE = """
import json, os, socket, subprocess
import torch, torch.distributed as dist

hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                       capture_output=True, text=True, check=True).stdout.split()
os.environ["MASTER_ADDR"] = hosts[0]
os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", rank=rank, world_size=world)
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(json.dumps({"rank": rank, "node": os.environ["SLURMD_NODENAME"], "hostname": socket.gethostname(),
                  "address": socket.gethostbyname(socket.gethostname()), "master": hosts[0], "sum": value.item()}))
dist.destroy_process_group()
"""


def test_gloo_all_reduce_between_ranks_on_two_nodes(cluster_env, tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(GLOO_ALL_REDUCE)
    proc = subprocess.run(
        ["srun", "-N", "2", "--ntasks-per-node=1", "--time=5", f"--chdir={tmp_path}", sys.executable, str(script)],
        env=cluster_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["sum"] == 3.0 for r in ranks)
    assert ranks[0]["node"] != ranks[1]["node"]  # one task per node
    assert ranks[0]["hostname"] != ranks[1]["hostname"] and ranks[0]["address"] != ranks[1]["address"]
    assert ranks[0]["master"] == ranks[0]["node"] == ranks[1]["master"]  # rank 0 runs on the first node


def test_sbatch_script_runs_one_job_over_two_nodes(cluster_env, tmp_path):
    """launchers/sbatch_multinode.sh as its header says: one task per node, ds_exp's slurm launch."""
    proc = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "--time=15",
            f"--chdir={tmp_path}",
            str(REPO / "launchers" / "sbatch_multinode.sh"),
            *FAST,
            "train.max_steps=4",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
        env=cluster_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    job_id = proc.stdout.split()[-1] if proc.stdout.split() else "?"
    output_file = tmp_path / f"ds_exp-{job_id}.out"
    output = job_output(output_file)
    assert proc.returncode == 0, proc.stderr + output[-3000:]
    run_dir = tmp_path / "outputs" / "sbatch" / job_id
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["launcher"], summary["world_size"]) == ("completed", "slurm", 2)
    ranks = launch_lines(run_dir)
    assert sorted(ranks) == [0, 1] and all(launcher == "slurm" and world == 2 for launcher, world, _ in ranks.values())
    assert ranks[0][2] != ranks[1][2], ranks  # the two ranks ran on different hosts


SWEPT_RUN = [*FAST, "train.max_steps=4"]


def test_sweep_jobs_span_two_nodes_and_match_one_node_runs(cluster_env, tmp_path):
    """Each job of a sweep is one run over both nodes, and trains as the same run's 2 ranks on one host do (those
    forked here: a one-node SLURM job adds nothing that test_slurm.py does not prove)."""
    two_nodes = tmp_path / "two_nodes"
    proc = multirun(
        tmp_path,
        two_nodes,
        "zero=stage2,stage3",
        "hydra/launcher=slurm",
        "hydra.launcher.nodes=2",
        "hydra.launcher.tasks_per_node=1",
        "hydra.launcher.timeout_min=15",
        *SWEPT_RUN,
        f"data.cache_dir={tmp_path / 'cache'}",
        env=cluster_env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = report_rows(two_nodes)
    assert [(r["zero_stage"], r["status"], r["world_size"]) for r in rows] == [
        ("2", "completed", "2"),
        ("3", "completed", "2"),
    ]
    for job, stage in (("0", "stage2"), ("1", "stage3")):
        spread = launch_lines(two_nodes / job)
        assert sorted(spread) == [0, 1] and {launcher for launcher, _, _ in spread.values()} == {"submitit"}
        assert spread[0][2] != spread[1][2], spread  # each job is one run whose ranks are on different nodes
        run_dir, cache = tmp_path / f"one_node_{stage}", tmp_path / "cache"
        one_node = launch(run_dir, *SWEPT_RUN, f"zero={stage}", launcher="ranks", nproc=2, cache_dir=cache)
        assert one_node.ok, one_node.explain()
        a = losses(two_nodes / job)
        assert len(a) == len(one_node.losses) == 4
        assert_close(a, one_node.losses, rel=1e-5)


# Checkpoints every 20 steps, a metric line every 5: killed after step 45, a resume starts from step40. The run is
# long enough (100 steps; the kill follows the first poll that sees step 45) that the kill lands well before its end.
RESUMABLE = [
    *FAST,
    "train.max_steps=100",
    "train.log_every=5",
    "train.save_every=20",
    "train.keep_last=2",
    "data.synthetic.num_train=512",
]


def sbatch_multinode(cwd: Path, env: dict[str, str], *overrides: str, wait: bool) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "sbatch",
            "--parsable",
            *(["--wait"] if wait else []),
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "--time=15",
            f"--chdir={cwd}",
            str(REPO / "launchers" / "sbatch_multinode.sh"),
            *overrides,
            f"data.cache_dir={cwd / 'cache'}",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def job_state(env: dict[str, str], job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30)
    match = re.search(r"JobState=(\w+)", out.stdout)
    return match.group(1) if match else "GONE"


def job_processes(job_id: str, rank: int) -> list[int]:
    """The processes of rank `rank` of SLURM job `job_id` (its Python process), wherever they run."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and f"SLURM_PROCID={rank}".encode() in environ:
            found.append(int(entry.name))
    return found


def in_node(pid: int, node: str) -> bool:
    """Whether process `pid` runs in the network namespace of `node` (slurm_cluster.sh's dsx-<node>)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/dsx-{node}").st_ino
    except OSError:
        return False


def test_lost_node_fails_fast_naming_its_rank_and_resume_continues(cluster_env, tmp_path):
    if not Path("/run/netns/dsx-node2").exists():
        pytest.skip("the two nodes are not network namespaces of this machine: cannot kill one node's processes")
    submitted = sbatch_multinode(tmp_path, cluster_env, *RESUMABLE, wait=False)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    run_dir = tmp_path / "outputs" / "sbatch" / job_id
    output_file = tmp_path / f"ds_exp-{job_id}.out"
    deadline = time.monotonic() + 600
    while logged_steps(run_dir) < 45:  # checkpoints at steps 20 and 40 are complete by then
        state = job_state(cluster_env, job_id)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"{state}: {job_output(output_file)[-3000:]}"
        assert time.monotonic() < deadline, "no progress within 600 s"
        time.sleep(0.2)
    victims = job_processes(job_id, rank=1)
    assert victims and all(in_node(pid, "node2") for pid in victims), victims  # rank 1 is node2's task
    for pid in victims:  # node2 loses the job's processes, as when a machine goes down under a job
        os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while job_state(cluster_env, job_id) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
        assert time.monotonic() - killed < 120, "the job still runs 120 s after node2 lost its rank"
        time.sleep(0.2)
    took = time.monotonic() - killed
    print(f"the job ended {took:.1f} s after node2 lost its rank")
    assert took < 60, f"the job took {took:.0f} s to end after node2 lost its rank"
    assert logged_steps(run_dir) < 100, "the run ended before the kill"
    assert "node2: task 1: Killed" in job_output(output_file)  # srun's own word for it
    assert job_state(cluster_env, job_id) in ("FAILED", "GONE")
    assert not job_processes(job_id, rank=0), "rank 0 outlived the job"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert "lost contact with rank 1 (node2)" in summary["error"], summary["error"]
    assert f"hydra.run.dir={run_dir} resume=auto" in summary["error"], summary["error"]
    before = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    # what the message says to do, as a new job on the same two nodes
    resumed = sbatch_multinode(tmp_path, cluster_env, *RESUMABLE, f"hydra.run.dir={run_dir}", "resume=auto", wait=True)
    resumed_id = resumed.stdout.strip().split(";")[0]
    resumed_output = tmp_path / f"ds_exp-{resumed_id}.out"
    tail = job_output(resumed_output)[-3000:]
    assert resumed.returncode == 0, resumed.stderr + tail
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["world_size"]) == ("completed", 2), summary
    assert summary["resumed_from"].endswith("step40"), summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in rows if r["type"] == "train" and r["step"] == 45]
    # step 45 trained twice, from the same checkpoint on the same layout: the same loss
    assert len(after) >= 1 and after[-1]["loss"] == pytest.approx(before[45], rel=1e-6)
    assert logged_steps(run_dir) == 100


def test_a_one_node_checkpoint_continues_on_two_nodes(cluster_env, tmp_path):
    """Resume anywhere across nodes: 1 rank (global batch 8 by accumulation) -> 2 ranks on two nodes (8 by 2 ranks),
    converted to DeepSpeed's universal format once; the losses go on as the uninterrupted 1-rank run's."""
    common = [*FAST, "zero=stage2", "train.micro_batch_size=4", "train.save_every=4"]
    one_node = tmp_path / "one_node"
    alone = launch(one_node, *common, "train.gradient_accumulation_steps=2", cache_dir=tmp_path / "cache")
    assert alone.ok, alone.explain()
    two_nodes = tmp_path / "two_nodes"
    resumed = sbatch_multinode(
        tmp_path, cluster_env, *common, f"resume={one_node}/checkpoints/step4", f"hydra.run.dir={two_nodes}", wait=True
    )
    job_id = resumed.stdout.strip().split(";")[0]
    assert resumed.returncode == 0, resumed.stderr + job_output(tmp_path / f"ds_exp-{job_id}.out")[-3000:]
    ranks = launch_lines(two_nodes)
    assert sorted(ranks) == [0, 1] and ranks[0][2] != ranks[1][2], ranks  # the resumed run spans both nodes
    summary = json.loads((two_nodes / "summary.json").read_text())
    assert (summary["status"], summary["world_size"]) == ("completed", 2), summary
    assert (one_node / "checkpoints" / "step4.universal").is_dir()  # converted once, beside the checkpoint
    uninterrupted = {r["step"]: r["loss"] for r in alone.records("train")}
    continued = {
        r["step"]: r["loss"]
        for r in map(json.loads, (two_nodes / "metrics.jsonl").read_text().splitlines())
        if r["type"] == "train"
    }
    assert sorted(continued) == [5, 6, 7, 8]
    assert_close([continued[s] for s in (5, 6, 7, 8)], [uninterrupted[s] for s in (5, 6, 7, 8)], rel=1e-5)
