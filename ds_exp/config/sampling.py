"""How generation samples (eval.temperature/top_p/top_k and `python -m ds_exp.chat`'s flags), checked alike: each
within its eval.* field's range, and no top_p / top_k with greedy decoding, which would be silently ignored."""

from __future__ import annotations

from collections.abc import Callable

from ds_exp.config.ranges import RANGES


def sampling_problems(temperature: float, top_p: float, top_k: int, key: Callable[[str], str]) -> list[str]:
    """The sampling options of generation, one line each; `key` names an option as the user gave it."""
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    problems = [
        f"{key(name)}={value}: {RANGES[f'eval.{name}'].why(value)}"
        for name, value in given.items()
        if not RANGES[f"eval.{name}"].holds(value)
    ]
    if temperature == 0 and not problems and (top_p != 1 or top_k != 0):
        which = key("top_p") if top_p != 1 else key("top_k")
        problems.append(
            f"{which}={top_p if top_p != 1 else top_k} has no effect with {key('temperature')}=0 (greedy decoding): "
            f"set {key('temperature')} > 0 (e.g. 0.7) to sample, or leave {which} at its default"
        )
    return problems
