"""`python -m ds_exp.parity [OPTIONS] A_OVERRIDES -- B_OVERRIDES`. Exit 0: every step within tolerance; 1: a step
is not (the table says which), or a side failed; 2: the comparison is refused (one message per reason)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ds_exp.config.fields import at_least
from ds_exp.core.errors import ConfigError
from ds_exp.core.files import write_json_atomic
from ds_exp.launch.console import entry_point
from ds_exp.launch.flags import FlagParser, number, path, whole
from ds_exp.launch.storage import check_writable
from ds_exp.tools.parity import compare
from ds_exp.tools.parity.runs import run_side
from ds_exp.tools.parity.sides import (
    Side,
    comparability_problems,
    compose_side,
    dropout_notes,
    forced_overrides,
    hide_secrets,
    override_problems,
    packing_problems,
)

MAX_STEPS = 10_000  # parity trains both sides this many steps, in full: a few are what it is for
MAX_RANKS = 1024  # processes per side on this machine (torchrun --nproc_per_node)
USAGE = "python -m ds_exp.parity [OPTIONS] [A_OVERRIDES ...] -- [B_OVERRIDES ...]"
EPILOG = """examples:
  python -m ds_exp.parity zero=stage2 -- zero=stage3
  python -m ds_exp.parity --ranks 2,1 train.micro_batch_size=2 -- train.micro_batch_size=2 \\
      train.gradient_accumulation_steps=2
Both sides start from the same weights (train.seed) and train on the same samples at every step; parity refuses
comparisons where they could not (another model, global batch, schedule, seed or data).
exit status: 0 every step within tolerance, 1 a step is not (or a side failed), 2 refused."""


def parser() -> argparse.ArgumentParser:
    p = FlagParser(
        prog="python -m ds_exp.parity",
        usage=USAGE,
        description="Train a few steps of two configurations from the same weights and data order and compare "
        "each step's loss and gradient norm.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=whole(1, MAX_STEPS), default=5, help="optimizer steps per side (default 5)")
    p.add_argument(
        "--ranks", default="1", help="processes per side: N for both, or A,B (e.g. 2,1); default 1 (torchrun for N>1)"
    )
    # a tolerance of nan or inf would pass every step, whatever the two sides did
    tolerance = number(at_least(0, " (0 = exactly equal)"))
    p.add_argument("--loss-rtol", type=tolerance, help="relative loss difference allowed per step (default 1e-3 fp32)")
    p.add_argument("--grad-rtol", type=tolerance, help="relative grad_norm difference allowed (default 1e-2 fp32)")
    p.add_argument("--out", type=path, help="where the two runs go (default outputs/parity/<date_time>); must be new")
    p.add_argument("overrides", nargs="*", help="side A's Hydra overrides")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, Side, Side]:
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_intermixed_args(argv[:cut])  # --help, and an unknown flag is named first
    if cut == len(argv):
        raise ConfigError(f"no side B: give side A's overrides, then `--`, then side B's ({USAGE})")
    ranks = args.ranks.split(",")
    if len(ranks) not in (1, 2) or not all(r.isdigit() and 0 < int(r) <= MAX_RANKS for r in ranks):
        raise ConfigError(
            f"--ranks {args.ranks}: give a number of processes (1 to {MAX_RANKS}) for both sides, or two (A,B), "
            "e.g. 2,1"
        )
    ranks_a, ranks_b = int(ranks[0]), int(ranks[-1])
    return args, Side("A", list(args.overrides), ranks_a), Side("B", argv[cut + 1 :], ranks_b)


def prepare(args: argparse.Namespace, a: Side, b: Side, out: Path) -> None:
    """Both sides composed, validated and compared before anything runs; ConfigError with every reason."""
    for side in (a, b):
        hide_secrets(side)
    problems = override_problems(a) + override_problems(b)
    if problems:
        raise ConfigError(problems)
    for side in (a, b):
        problems += compose_side(side, forced_overrides(args.steps, out / side.name))
    if problems:
        raise ConfigError(problems)
    problems = comparability_problems(a, b) or packing_problems(a, b)  # the latter builds the data: only if needed
    if problems:
        raise ConfigError(["parity refuses to compare these sides: they cannot follow the same trajectory", *problems])


def out_dir(args: argparse.Namespace) -> Path:
    out = args.out or Path("outputs/parity") / time.strftime("%Y-%m-%d_%H-%M-%S")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file; parity writes its two runs into a directory: give a new one")
    try:
        check_writable(out, "--out")  # an ancestor that is a file, a read-only disk, a name too long
    except ConfigError as err:
        raise ConfigError(str(err).replace("--out=", "--out ", 1)) from None
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: already holds files; parity writes only into a new or empty directory")
    return out


def run(args: argparse.Namespace, a: Side, b: Side, out: Path) -> int:
    for note in dropout_notes(a, b):
        print(f"note: {note}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    common = [o for o in a.overrides if o in b.overrides]
    if common:
        print(f"both sides: {' '.join(common)}")
    results = {}
    for side in (a, b):
        print(f"side {side.name}: {side.shown(common)}: {args.steps} steps -> {out / side.name}", flush=True)
        run_dir = out / side.name
        result = run_side(side, forced_overrides(args.steps, run_dir), run_dir, out / f"{side.name}.log")
        if result.diverged:  # its steps up to the divergence are compared: the table shows where
            print(f"side {side.name} diverged after {result.seconds:.0f}s: {result.error()}", file=sys.stderr)
        elif not result.ok:
            print(f"side {side.name} failed after {result.seconds:.0f}s (log: {result.log}):", file=sys.stderr)
            print("  " + result.error().replace("\n", "\n  "), file=sys.stderr)
            return 1
        results[side.name] = result
    ra, rb = results["A"], results["B"]
    tol, kind = compare.default_tolerance([ra.summary.get("precision"), rb.summary.get("precision")])
    tol = compare.Tolerance(
        loss=tol.loss if args.loss_rtol is None else args.loss_rtol,
        grad_norm=tol.grad_norm if args.grad_rtol is None else args.grad_rtol,
    )
    rows = compare.compare(ra, rb, args.steps, tol)
    diverged = [name for name, result in results.items() if result.diverged]
    verdict = compare.verdict(rows, tol, diverged)
    print(compare.table(rows, tol))
    for note in compare.notes(rows):
        print(f"note: {note}")
    print(verdict)
    record = {
        "A": {"overrides": a.overrides, "ranks": a.ranks, "run_dir": str(out / "A")},
        "B": {"overrides": b.overrides, "ranks": b.ranks, "run_dir": str(out / "B")},
        "steps": args.steps,
        "tolerance": {"loss": tol.loss, "grad_norm": tol.grad_norm, "default_for": kind},
        "passed": all(r.ok for r in rows) and not diverged,
        "diverged": diverged,
        "verdict": verdict,
        "rows": compare.as_json(rows),
    }
    write_json_atomic(out / "parity.json", record)
    return 0 if record["passed"] else 1


@entry_point("ds_exp.parity")
def main(argv: list[str]) -> int:
    args, a, b = parse(argv)  # a refusal is a ConfigError: its one message (launch/console.py's boundary)
    out = out_dir(args)
    prepare(args, a, b, out)
    try:
        return run(args, a, b, out)
    except KeyboardInterrupt:  # the side's processes got the same Ctrl-C and stop on their own
        print(f"parity: interrupted; what ran so far is in {out}", file=sys.stderr)
        return 130
