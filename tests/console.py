"""What a person sees of a run, for the tests that look at it: a run on a pseudo-terminal (`on_terminal`), the lines
a terminal shows for its output (`rendered`), and the console of the default run as the README shows it, compared
line by line (`readme_console`, `shape`: what stays the same from run to run and machine to machine)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

from tests.training import REPO

BAR = re.compile(r"^(train|Tokenizing \w+): +\d+%\|")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_terminal(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run `cmd` with stdout and stderr on one pseudo-terminal of 120 columns, as a person's shell does: what it
    wrote, in order (the terminal's CR LF back to LF)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
        code = proc.wait(timeout=30)
    finally:
        os.close(master)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    return code, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def rendered(text: str) -> list[str]:
    """The lines a terminal shows for `text`: a carriage return goes back to the start of the line, and what
    follows overwrites it character by character (a bar cleared with spaces leaves only spaces)."""
    lines = []
    for raw in ANSI.sub("", text).split("\n"):
        cells: list[str] = []
        column = 0
        for char in raw:
            if char == "\r":
                column = 0
                continue
            if column < len(cells):
                cells[column] = char
            else:
                cells.append(char)
            column += 1
        lines.append("".join(cells).rstrip())
    return lines


# What a run says about what this machine had ready, not about the run: a DeepSpeed op compiled on its first use, by
# this run or by another process it waits for (the test session builds them before its workers start: conftest.py).
MACHINE_STATE = ("ds_exp: compiling ", "ds_exp: waiting for the build of ")
PROGRESS = re.compile(r"^ds_exp: step \d+/\d+ \(\d+%\): ")  # a piped run's plain progress line


def readme_console() -> list[str]:
    """The console of the default run as the README shows it: the block that starts with `$ python -m ds_exp`,
    without that command line."""
    text = (REPO / "README.md").read_text()
    for block in re.findall(r"^```text\n(.*?)^```", text, flags=re.S | re.M):
        lines = block.splitlines()
        if lines and lines[0] == "$ python -m ds_exp":
            return lines[1:]
    raise AssertionError("README.md shows no console of `python -m ds_exp` (a ```text block starting with it)")


def shape(line: str) -> str:
    """What a console line says, without what changes from run to run: numbers, times, paths, the host, whether
    the data was built or found in the cache, a first run's compiling time, and a bar's frames."""
    if BAR.match(line):
        return f"{line.split(':')[0]}: BAR"
    line = re.sub(r"(\d+h \d+m|\d+m \d+s|\d+(\.\d+)? s)\b", "TIME", line)
    line = line.replace("compile TIME, ", "")
    line = re.sub(r"run directory \S+$", "run directory PATH", line)
    line = re.sub(r"(?<![\w.])(~|\.{1,2})?/?[\w.~-]+(/[\w.~<>-]+)+/?", "PATH", line)
    line = re.sub(r" on [\w.-]+, rendezvous", " on HOST, rendezvous", line)
    line = line.replace("(cache hit PATH)", "(built PATH)")
    return re.sub(r"\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "N", line)
