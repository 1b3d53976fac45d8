"""Every wait on something outside the process is announced and ends (issue 31 §3): torch's extension build lock
(a killed builder's leftover, a live builder), the shared mechanism itself (ds_exp.core.waits), tracker servers that
do not answer, FIFOs and devices given as paths, a row that takes long to tokenize, the tokenized-data cache's lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ds_exp.core import waits
from ds_exp.core.waits import WaitGaveUp, announced_wait, run_announced

# ------------------------------------------------------------------------------------------- the mechanism


def test_a_wait_is_announced_with_its_start_and_stops_with_the_fix(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(WaitGaveUp) as err:
        announced_wait("the moon", lambda: False, limit_s=0.6, fix="look elsewhere", notice_s=0.1, poll_s=0.05)
    notices = capsys.readouterr().err
    assert "ds_exp: waiting for the moon since " in notices and "gives up after 0 s" in notices
    assert str(err.value).startswith("gave up waiting for the moon after 0 s (since ")
    assert str(err.value).endswith("; look elsewhere")


def test_only_rank_0_speaks_and_a_wait_that_ends_in_time_returns(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    done = time.monotonic() + 0.4
    assert announced_wait("rank 0", lambda: time.monotonic() > done, limit_s=5, fix="", notice_s=0.1) >= 0.4
    assert capsys.readouterr().err == ""  # other ranks log it (their log file), never print


def test_a_blocking_call_is_announced_and_its_outcome_comes_back(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert run_announced("a slow answer", lambda: time.sleep(0.5) or 42, limit_s=5, fix="", notice_s=0.1) == 42
    assert "waiting for a slow answer" in capsys.readouterr().err
    with pytest.raises(KeyError):
        run_announced("an error", lambda: {}["x"], limit_s=5, fix="")
    with pytest.raises(WaitGaveUp):
        run_announced("no answer", lambda: time.sleep(30), limit_s=0.3, fix="try later")


# ------------------------------------------------------------------------- torch's extension build lock

TINY_SOURCE = 'extern "C" int ds_exp_tiny() { return 7; }\n'
HOLDER = """
import fcntl, os, subprocess, sys, time
build = sys.argv[1]
holder = open(os.path.join(build, "lock.holder"), "a+")
if sys.argv[2] == "ds_exp":  # as ds_exp's HeldBaton holds it: the flock, then torch's file (kept open)
    fcntl.flock(holder, fcntl.LOCK_EX)
    holder.write(f"pid {os.getpid()} on here since now\\n"); holder.flush()
fd = os.open(os.path.join(build, "lock"), os.O_CREAT | os.O_EXCL)
print("holding", flush=True)
time.sleep(float(sys.argv[3]))
if len(sys.argv) > 4:  # what the builder builds: the library torch loads once the lock is gone
    subprocess.run(["c++", "-shared", "-fPIC", sys.argv[4], "-o", sys.argv[5]], check=True)
os.close(fd)
os.remove(os.path.join(build, "lock"))
"""


@pytest.fixture
def extension(tmp_path, monkeypatch):
    """(name, build dir, load) of a tiny C++ extension torch compiles in about a second, in a scratch
    TORCH_EXTENSIONS_DIR; `load()` runs torch's real JIT build (cpp_extension.load) with ds_exp's build lock, and
    fails instead of hanging when it does not end."""
    import torch.utils.cpp_extension as cpp_extension

    from ds_exp.runtime.build_lock import guard_builds

    guard_builds()  # as ds_exp does before it builds an op, and before deepspeed.initialize

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(waits, "NOTICE_S", 0.3)
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    name = f"ds_exp_tiny_{uuid.uuid4().hex[:8]}"
    build = tmp_path / "extensions" / name
    build.mkdir(parents=True)

    def load(within: float = 60.0) -> object:
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                outcome["value"] = cpp_extension.load(name=name, sources=[str(source)], is_python_module=False)
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(within)
        assert not thread.is_alive(), f"the build of {name} still waits after {within} s"
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        return outcome["value"]

    return name, build, load


def _holder(build: Path, how: str, seconds: float, *builds: str) -> subprocess.Popen:
    command = [sys.executable, "-c", HOLDER, str(build), how, str(seconds), *builds]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"holding"
    return proc


def test_a_killed_builders_lock_is_removed_and_the_op_built_again(extension, capsys):
    """What a build SIGKILLed mid-compile leaves: torch's lock file, and ds_exp's holder file that no process
    holds. torch alone would wait for it forever, before the run's first line."""
    name, build, load = extension
    (build / "lock").touch()
    (build / "lock.holder").write_text("pid 999999 on here since yesterday\n")
    load()
    assert (build / f"{name}.so").is_file() and not (build / "lock").exists()
    said = capsys.readouterr().err
    assert f"{build / 'lock'} was left by a build that was killed (no process holds it): removed" in said


@pytest.mark.parametrize("how", ["ds_exp", "torch"])
def test_a_live_builders_lock_is_waited_on_and_announced(extension, capsys, how):
    """Another process holds the lock: ds_exp's flock (another run compiling), or only torch's file, kept open (a
    program that is not ds_exp). Waited on, said with who holds it, and the wait ends with its build."""
    name, build, load = extension
    holder = _holder(build, how, 1.5, str(build.parent.parent / "tiny.cpp"), str(build / f"{name}.so"))
    load()
    assert holder.wait(timeout=10) == 0
    said = capsys.readouterr().err
    assert f"waiting for the build of {name} in another process (pid {holder.pid}" in said
    assert f"holds {build / 'lock'}) since " in said
    assert (build / f"{name}.so").is_file()


def test_a_builder_killed_while_waited_for_stops_the_wait_with_one_line(extension):
    from ds_exp.runtime.build_lock import BuildLockBroken

    name, build, load = extension
    holder = _holder(build, "ds_exp", seconds=60)
    threading.Timer(1.0, os.kill, (holder.pid, signal.SIGKILL)).start()
    with pytest.raises(BuildLockBroken) as err:
        load()
    holder.wait(timeout=10)
    assert f"the build of {name} this run waited for ended without finishing" in str(err.value)
    assert "run again" in str(err.value) and not (build / "lock").exists()


# ------------------------------------------------------------------------------- paths that never end


def test_a_fifo_a_reader_meets_is_refused_before_it_is_opened(tmp_path):
    """The config checks refuse a FIFO the settings name (tests/bad_inputs.py); the readers refuse one found later
    (inside a directory): opening it would wait for a writer forever."""
    from ds_exp.core.errors import DataError
    from ds_exp.data.textfiles import read_text

    fifo = tmp_path / "train.json"
    os.mkfifo(fifo)
    refused: list[BaseException] = []

    def read() -> None:
        try:
            read_text(fifo, "k", "JSON")
        except DataError as err:
            refused.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the reader opened the FIFO and waits for a writer"
    assert str(refused[0]).startswith(f"k: {fifo} is a FIFO (named pipe)")


def test_dev_stdin_is_what_stdin_is(tmp_path):
    """Told by what the path is, not by its name: /dev/stdin redirected from a file is a file and reads fine."""
    data = tmp_path / "rows.jsonl"
    data.write_text("{}\n")
    code = "from ds_exp.core.user_paths import special_kind; print(special_kind('/dev/stdin'))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with data.open() as stdin:
        from_file = subprocess.run([sys.executable, "-c", code], stdin=stdin, capture_output=True, text=True, env=env)
    from_pipe = subprocess.run([sys.executable, "-c", code], input="", capture_output=True, text=True, env=env)
    assert from_file.stdout.strip() == "None"
    assert from_pipe.stdout.strip().startswith("a FIFO (named pipe)")


# ------------------------------------------------------------------------------- silent work: tokenizing


def test_a_row_too_long_to_tokenize_quickly_is_told_while_it_is(tmp_path, monkeypatch, capsys):
    """The fast tokenizer reads a row whole before truncating it (16M characters: about a minute here) and datasets'
    bar moves only once its batch is done: rank 0 says what it is doing meanwhile."""
    from ds_exp.config.schema import DataConfig, ModelConfig
    from ds_exp.data.encode import Encoder, encode
    from ds_exp.data.sources import Rows
    from ds_exp.model.tokenizer import load_tokenizer

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(waits, "NOTICE_S", 0.2)
    tokenizer = load_tokenizer(ModelConfig(), DataConfig())
    rows = Rows()
    for prompt in ("hi", "hello world " * 50_000, "bye"):
        rows.add(["user", "assistant"], [prompt, "ok"])
    rows.set_template("raw")
    ds, counts = encode(rows, Encoder(tokenizer, "", 64, False), num_proc=None, desc="train", work_dir=tmp_path)
    assert len(ds) == 2 and counts == {"truncated": 1, "dropped": 1}  # its prompt alone fills 64 tokens
    said = capsys.readouterr().err
    assert "ds_exp: tokenizing train (3 rows): no sign of progress for " in said
    assert "its longest row has 600,002 characters" in said
    assert not list(tmp_path.glob(".progress-*"))


# ------------------------------------------------------------------------- the tokenized-data cache's lock

CACHE_HOLDER = """
import fcntl, os, sys, time
cache, key, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
lock = open(os.path.join(cache, key + ".lock"), "a+")
fcntl.flock(lock, fcntl.LOCK_EX)
lock.write(f"pid {os.getpid()} on here since now\\n"); lock.flush()
os.makedirs(os.path.join(cache, f".{key}.tmp-{os.getpid()}-0"))
print("holding", flush=True)
time.sleep(seconds)
"""


def _cache_holder(cache: Path, key: str, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CACHE_HOLDER, str(cache), key, str(seconds)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"holding"
    return proc


def _build(directory: Path) -> dict:
    (directory / "data").write_text("tokens")
    return {"rows": 1}


def test_waiting_for_another_processs_cache_build_is_announced(tmp_path, monkeypatch, capsys):
    """Another rank (or a sweep's other job) builds the same tokenized data: who, and how recently it wrote. Here it
    dies without finishing: the wait ends (the OS lets go of its lock) and this process builds."""
    from ds_exp.data.cache import cached_build

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(waits, "NOTICE_S", 0.3)
    holder = _cache_holder(tmp_path, "sft-abc", seconds=1.5)
    loaded, _, hit, _ = cached_build(tmp_path, "sft-abc", _build, lambda d: (d / "data").read_text(), {})
    assert (loaded, hit, holder.wait(timeout=10)) == ("tokens", False, 0)
    said = capsys.readouterr().err
    assert "ds_exp: waiting for the tokenized data sft-abc, which another process is building" in said
    assert f"(pid {holder.pid} on here since now; its build last wrote " in said


def test_a_cache_build_that_wrote_nothing_for_too_long_stops_the_wait(tmp_path, monkeypatch):
    from ds_exp.data import cache

    monkeypatch.setattr(cache, "STALLED_BUILD_S", 0.5)
    holder = _cache_holder(tmp_path, "sft-abc", seconds=30)
    try:
        with pytest.raises(WaitGaveUp) as err:
            cache.cached_build(tmp_path, "sft-abc", _build, lambda d: None, {})
    finally:
        holder.kill()
    message = str(err.value)
    assert message.startswith(f"data.cache_dir={tmp_path}: the process building the tokenized data sft-abc (pid ")
    assert "seems stuck; stop it, or point data.cache_dir at another directory, and run again" in message


# ------------------------------------------------------------------------------------------ peer ranks


def test_a_rank_waiting_for_rank_0_at_the_rendezvous_says_so_and_stops_with_one_line(monkeypatch, capsys):
    """Every rank says it (no rank has a log file yet, and the missing one may be rank 0); torch's own timeout
    (dist.timeout_minutes; here a real TCPStore's 1 s) ends it in one line."""
    import datetime
    import socket

    import torch.distributed as torch_dist

    from ds_exp.core.errors import RunFailed
    from ds_exp.launch.environment import LaunchInfo
    from ds_exp.launch.rendezvous import wait_for_rendezvous

    monkeypatch.setattr(waits, "NOTICE_S", 0.2)
    monkeypatch.setenv("RANK", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there: no rank 0

    def meet() -> object:
        return torch_dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=1))

    with pytest.raises(RunFailed) as err:
        wait_for_rendezvous(meet, LaunchInfo("env", 1, 1, 2, "127.0.0.1", port), 7)
    said = capsys.readouterr().err
    assert f"ds_exp: waiting for the 2 ranks to meet at 127.0.0.1:{port} (this is rank 1) since " in said
    assert "torch gives up after dist.timeout_minutes=7" in said
    assert str(err.value).startswith(f"rank 1 could not reach rank 0 at 127.0.0.1:{port} within dist.timeout_minutes")
