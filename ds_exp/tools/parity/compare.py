"""The verdict: each step's loss and gradient norm on both sides, their relative difference, and the tolerance."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ds_exp.tools.parity.runs import SideRun


@dataclass(frozen=True)
class Tolerance:
    """Relative differences allowed per step."""

    loss: float
    grad_norm: float


# fp32: the sides differ only in the order of floating-point sums (ZeRO's partitioned reductions, how the batch is
# split): measured on CPU with the tiny model, <= 2e-7 relative over 5 steps. 16-bit: each side rounds its own way:
# bf16 2 ranks vs 1 rank accumulating <= 2e-4, fp32 vs bf16 <= 5e-4 (loss) and 2e-3 (grad_norm). The defaults leave
# headroom for longer checks and GPU kernels; a 2x learning rate exceeds them within 2-3 steps.
DEFAULT_TOLERANCE = {"fp32": Tolerance(loss=1e-3, grad_norm=1e-2), "16-bit": Tolerance(loss=1e-2, grad_norm=5e-2)}


def default_tolerance(precisions: list[str | None]) -> tuple[Tolerance, str]:
    """The default for the sides' precisions (from their summary.json: `precision=auto` resolves at run time)."""
    if all(p == "fp32" for p in precisions):
        return DEFAULT_TOLERANCE["fp32"], "fp32"
    return DEFAULT_TOLERANCE["16-bit"], "16-bit"


@dataclass
class Row:
    step: int
    loss_a: float | None
    loss_b: float | None
    grad_norm_a: float | None
    grad_norm_b: float | None
    loss_diff: float | None  # relative
    grad_norm_diff: float | None
    ok: bool
    non_finite: list[str] = field(default_factory=list)  # "loss A", "grad_norm B": NaN or inf on that side


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def relative(a: float | None, b: float | None) -> float | None:
    """|a - b| relative to the larger; None when either is missing or not finite (NaN agrees with nothing)."""
    if not (finite(a) and finite(b)):
        return None
    assert a is not None and b is not None
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0


def logged(record: dict[str, Any], key: str) -> float | None:
    """A metric line's value: NaN where the line says it was not finite (ds_exp.core.files writes it as null)."""
    value = record.get(key)
    return math.nan if value is None and key in (record.get("non_finite") or []) else value


def compare(a: SideRun, b: SideRun, steps: int, tol: Tolerance) -> list[Row]:
    """One row per step; a step a side did not log fails, as does a non-finite value on either side."""
    rows = []
    train_a, train_b = a.train, b.train
    for step in range(1, steps + 1):
        ra, rb = train_a.get(step, {}), train_b.get(step, {})
        loss_a, loss_b = logged(ra, "loss"), logged(rb, "loss")
        grad_a, grad_b = logged(ra, "grad_norm"), logged(rb, "grad_norm")
        values = {"loss A": loss_a, "loss B": loss_b, "grad_norm A": grad_a, "grad_norm B": grad_b}
        non_finite = [name for name, value in values.items() if value is not None and not math.isfinite(value)]
        loss_diff, grad_diff = relative(loss_a, loss_b), relative(grad_a, grad_b)
        ok = not non_finite and loss_diff is not None and loss_diff <= tol.loss
        if grad_diff is not None:  # None where a side computes none (ZeRO stage 0 without clipping)
            ok = ok and grad_diff <= tol.grad_norm
        rows.append(Row(step, loss_a, loss_b, grad_a, grad_b, loss_diff, grad_diff, ok, non_finite))
    return rows


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[Row], tol: Tolerance) -> str:
    """A plain-text table; the last column marks the steps out of tolerance."""
    header = ("step", "loss A", "loss B", "rel diff", "grad_norm A", "grad_norm B", "rel diff", "")
    body = [
        (
            str(r.step),
            _num(r.loss_a, ".6f"),
            _num(r.loss_b, ".6f"),
            _num(r.loss_diff, ".1e"),
            _num(r.grad_norm_a, ".6f"),
            _num(r.grad_norm_b, ".6f"),
            _num(r.grad_norm_diff, ".1e"),
            "ok" if r.ok else ("NOT FINITE" if r.non_finite else "DIFFERS"),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths[:-1]))
    lines.append(f"tolerance (relative): loss {tol.loss:.0e}, grad_norm {tol.grad_norm:.0e}")
    return "\n".join(lines)


def verdict(rows: list[Row], tol: Tolerance, diverged: Sequence[str] = ()) -> str:
    """One sentence: within tolerance, or the first step that is not and why; a diverged side fails it."""
    bad = [r for r in rows if not r.ok]
    if not bad and diverged:
        return (
            f"FAIL: {len(rows)} steps within tolerance, but side {' and side '.join(diverged)} diverged after them "
            "(a non-finite final evaluation or weights)"
        )
    if not bad:
        worst_loss = max((r.loss_diff or 0.0) for r in rows)
        worst_grad = max((r.grad_norm_diff or 0.0) for r in rows)
        return (
            f"PASS: {len(rows)} steps within tolerance (largest relative difference: loss {worst_loss:.1e}, "
            f"grad_norm {worst_grad:.1e})"
        )
    first = bad[0]
    if first.non_finite:
        why = [_non_finite_words(first.non_finite)]
    elif first.loss_a is None or first.loss_b is None:
        why = [f"side {'A' if first.loss_a is None else 'B'} logged no loss for it"]
    else:
        why = []
        if first.loss_diff is not None and first.loss_diff > tol.loss:
            why.append(f"the loss differs by {first.loss_diff:.1e} relative (tolerance {tol.loss:.0e})")
        if first.grad_norm_diff is not None and first.grad_norm_diff > tol.grad_norm:
            why.append(f"grad_norm differs by {first.grad_norm_diff:.1e} relative (tolerance {tol.grad_norm:.0e})")
    return f"FAIL: {len(bad)} of {len(rows)} steps out of tolerance; first at step {first.step}: {'; '.join(why)}"


def _non_finite_words(names: list[str]) -> str:
    """["loss A", "loss B"] -> "the loss is not finite (NaN or inf) on both sides: both diverged, ..."."""
    parts = []
    for metric in ("loss", "grad_norm"):
        sides = [name.split()[1] for name in names if name.split()[0] == metric]
        if len(sides) == 2:
            parts.append(f"the {metric} is not finite (NaN or inf) on both sides: both diverged, which is no agreement")
        elif sides:
            parts.append(f"side {sides[0]}'s {metric} is not finite (NaN or inf)")
    return "; ".join(parts)


def notes(rows: list[Row]) -> list[str]:
    for side in ("a", "b"):
        if any(getattr(r, f"grad_norm_{side}") is None for r in rows):
            return [
                f"side {side.upper()} logged no grad_norm (DeepSpeed computes none at ZeRO stage 0 with "
                "train.gradient_clipping=0): only the losses were compared where it is missing"
            ]
    return []


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
