"""scheduler.kwargs checked before anything is built, against SCHEDULE_KWARGS (what each schedule takes), not after
minutes in transformers.get_scheduler; tests/unit/test_hostile_inputs.py checks it against transformers."""

from __future__ import annotations

from ds_exp.config.fields import FRACTION, Range, Spec, above, at_least
from ds_exp.config.schema import SchedulerConfig, plain

_STEPS = Spec(whole=True, range=at_least(0))
_CYCLES = Spec(range=above(0, " (0.5 = half a cosine wave)"))
_PLATEAU = {  # torch.optim.lr_scheduler.ReduceLROnPlateau
    "mode": Spec(choices=("min", "max")),
    "factor": Spec(range=Range(0, 1, low_open=True, high_open=True, fix=" (the rate is multiplied by it)")),
    "patience": _STEPS,
    "threshold": Spec(range=at_least(0)),
    "threshold_mode": Spec(choices=("rel", "abs")),
    "cooldown": _STEPS,
    "min_lr": Spec(range=at_least(0)),
    "eps": Spec(range=at_least(0)),
}
_SHAPES = ("linear", "cosine", "1-sqrt")  # warmup_stable_decay's warmup_type and decay_type
_MIN_LR = {
    "num_cycles": _CYCLES,
    "min_lr": Spec(range=at_least(0), null=True),
    "min_lr_rate": Spec(range=Range(0, 1, fix=" (a fraction of optimizer.lr)"), null=True),
}

# What each schedule of get_scheduler takes through scheduler_specific_kwargs (beyond what ds_exp passes itself)
SCHEDULE_KWARGS: dict[str, dict[str, Spec]] = {
    "linear": {},
    "cosine": {"num_cycles": _CYCLES},
    "cosine_with_restarts": {"num_cycles": Spec(whole=True, range=at_least(1, " (hard restarts)"))},
    "polynomial": {"lr_end": Spec(range=at_least(0)), "power": Spec(range=above(0, " (1 = linear)"))},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": Spec(whole=True, range=at_least(1), null=True)},
    "reduce_lr_on_plateau": _PLATEAU,
    "cosine_with_min_lr": _MIN_LR,
    "cosine_warmup_with_min_lr": {**_MIN_LR, "warmup_lr_rate": Spec(range=FRACTION, null=True)},
    "warmup_stable_decay": {
        "num_decay_steps": Spec(whole=True, range=at_least(0), auto=True),
        "num_stable_steps": Spec(whole=True, range=at_least(0), null=True),
        "warmup_type": Spec(choices=_SHAPES),
        "decay_type": Spec(choices=_SHAPES),
        "min_lr_ratio": Spec(range=Range(0, 1)),
        "num_cycles": _CYCLES,
    },
    "greedy": {  # transformers' GreedyLR
        **_PLATEAU,
        "warmup": _STEPS,
        "max_lr": Spec(range=above(0)),
        "verbose": Spec(choices=(True, False)),
        "smooth": Spec(choices=(True, False)),
        "window_size": Spec(whole=True, range=at_least(1)),
        "reset_start": _STEPS,
    },
}
# set by ds_exp from scheduler.warmup_* and the run's length: a kwarg of the same name would be given twice
_PASSED = {
    "num_warmup_steps": "scheduler.warmup_steps or scheduler.warmup_ratio",
    "num_training_steps": "train.max_steps or train.epochs",
    "last_epoch": "resume=auto (a resumed run continues its schedule)",
    "optimizer": "optimizer.*",
}


def scheduler_kwargs_problems(sched: SchedulerConfig) -> list[tuple[str, str]]:
    """(key, line) for each scheduler.kwargs entry its schedule does not take, or not with this type or range."""
    if plain(sched.owner) != "ds_exp" or not sched.kwargs:
        return []
    name = str(plain(sched.name))
    takes = SCHEDULE_KWARGS.get(name, {})
    problems = []
    for key, value in sched.kwargs.items():
        given = f"scheduler.kwargs.{key}={_shown(value)}"
        if key in _PASSED:
            line = f"{given}: ds_exp sets {key} itself from {_PASSED[key]}; remove it from scheduler.kwargs"
        elif key not in takes:
            known = ", ".join(takes) if takes else "none"
            line = (
                f"{given}: scheduler.name={name} takes no {key} (its kwargs: {known}); remove it or pick the "
                "schedule that takes it"
            )
        elif (problem := takes[key].problem(value)) is not None:
            line = f"{given}: {problem}"
        else:
            continue
        problems.append((f"scheduler.kwargs.{key}", line))
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        floors = [k for k in ("min_lr", "min_lr_rate") if sched.kwargs.get(k) is not None]
        if len(floors) != 1:
            problems.append(
                (
                    "scheduler.kwargs",
                    f"scheduler.name={name} needs exactly one of scheduler.kwargs.min_lr and "
                    f"scheduler.kwargs.min_lr_rate (the floor the rate decays to; "
                    f"{'both are' if floors else 'neither is'} set), e.g. scheduler.kwargs.min_lr_rate=0.1",
                )
            )
    return problems


def _shown(value: object) -> str:
    return "null" if value is None else str(value)
