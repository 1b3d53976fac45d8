"""A diverged run is a failed run. Non-finite losses may pass (train.max_bad_steps); non-finite weights never recover,
so they are never saved nor exported: the run stops as `diverged` (exit 3), decided alike on every rank."""

from __future__ import annotations

import math

import torch
from deepspeed import DeepSpeedEngine

from ds_exp.core import compat
from ds_exp.core.errors import Diverged
from ds_exp.runtime.process_group import all_reduce_sum


def local_weights_finite(engine: DeepSpeedEngine) -> bool:
    """Whether this rank's part of the weights is finite (one device sync)."""
    bad: torch.Tensor | None = None
    for shard in compat.local_weight_shards(engine):
        if shard.numel():
            flag = ~torch.isfinite(shard).all()
            bad = flag if bad is None else bad | flag
    return bad is None or not bool(bad)


def non_finite_end(
    engine: DeepSpeedEngine,
    last_loss: torch.Tensor | float | None,
    final_eval: dict[str, float] | None,
    *,
    last_step_overflowed: bool = False,
) -> list[str]:
    """Collective: what of the run's end state is not finite (last loss, its gradients, final evaluation, weights)."""
    loss_bad = last_loss is not None and not bool(torch.isfinite(torch.as_tensor(last_loss)).all())
    flags = [float(loss_bad), float(last_step_overflowed), float(not local_weights_finite(engine))]
    loss_votes, grad_votes, weight_votes = all_reduce_sum(flags, engine.device)
    found = []
    if loss_votes:
        found.append("the last step's loss")
    if grad_votes:
        found.append("the last step's gradients (its update was skipped)")
    if final_eval and not all(not isinstance(v, float) or math.isfinite(v) for v in final_eval.values()):
        found.append("the final evaluation")
    if weight_votes:
        found.append("the weights")
    return found


def check_weights_finite(engine: DeepSpeedEngine, step: int, consequence: str, last_good: str | None) -> None:
    """Collective: Diverged on every rank when any rank's weights are not finite, before they are written."""
    (votes,) = all_reduce_sum([float(not local_weights_finite(engine))], engine.device)
    if votes:
        raise Diverged(diverged_message(["the weights"], step, consequence, last_good))


def diverged_message(found: list[str], step: int, consequence: str, last_good: str | None) -> str:
    """`found`: what is not finite; `consequence`: what the run therefore did not write."""
    where = (
        f"the newest checkpoint with finite weights is {last_good}"
        if last_good
        else "this run saved no checkpoint with finite weights"
    )
    what = ", ".join(found[:-1]) + (" and " if len(found) > 1 else "") + found[-1]
    return (
        f"NaN or inf in {what} at step {step}: the run diverged and {consequence}; {where}. Lower optimizer.lr, set "
        "train.gradient_clipping, or use precision=bf16/fp32"
    )
