"""An optuna study's search space from Hydra's override grammar (interval, tag(log|int, ...), range, choices); anything
else is a fixed override. optuna is imported lazily."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, RangeSweep, Transformer
from hydra.errors import HydraException
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution, distribution_to_json

from ds_exp.core.errors import ConfigError, first_line

if TYPE_CHECKING:
    from hydra.core.config_loader import ConfigLoader
    from optuna.distributions import CategoricalChoiceType

# What distribution() makes of a sweep override
Distribution = FloatDistribution | IntDistribution | CategoricalDistribution

TAGS = {"log", "int"}  # what tag(...) may say around an interval / range


@dataclass
class SearchSpace:
    distributions: dict[str, Distribution] = field(default_factory=dict)  # key -> optuna distribution
    fixed: list[str] = field(default_factory=list)  # overrides every trial gets, as typed

    def as_json(self) -> dict[str, str]:
        """Each distribution as optuna serialises it: what a continued study must search again."""
        return {key: distribution_to_json(dist) for key, dist in self.distributions.items()}

    def overrides(self, params: dict[str, CategoricalChoiceType]) -> list[str]:
        """A trial's overrides: the fixed ones, then its values."""
        return self.fixed + [f"{key}={override_value(params[key])}" for key in self.distributions]


def override_value(value: CategoricalChoiceType) -> str:
    """A suggested value as Hydra's grammar reads it back unchanged (floats exactly: repr round-trips)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def parse_search_space(arguments: list[str], config_loader: ConfigLoader | None = None) -> SearchSpace:
    """Overrides -> a search space; one ConfigError naming each override that cannot be searched, and the fix."""
    try:
        parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(arguments)
    except HydraException as err:
        raise ConfigError(f"hydra/sweeper=optuna: {first_line(err)}") from None
    space, problems = SearchSpace(), []
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            space.fixed.append(override.input_line or f"{key}={override.get_value_element_as_str()}")
            continue
        if key in space.distributions:
            problems.append(f"{override.input_line}: {key} is searched twice; give it one search expression")
            continue
        try:
            space.distributions[key] = distribution(override)
        except (ValueError, TypeError, HydraException) as err:
            problems.append(f"{override.input_line}: {err}")
    if problems:
        raise ConfigError([f"hydra/sweeper=optuna: bad search space: {p}" for p in problems])
    return space


def distribution(override: Any) -> Distribution:
    """One sweep override -> one optuna distribution; ValueError with the fix when it cannot be one."""
    value = override.value()
    tags = set(getattr(value, "tags", set()) or set())
    if tags - TAGS:
        raise ValueError(f"unknown tag {sorted(tags - TAGS)}; tags that shape the search: log, int")
    if isinstance(value, IntervalSweep):
        low, high = value.start, value.end
        if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise ValueError(f"interval({low}, {high}) is empty: give interval(low, high) with low < high")
        if "log" in tags and low <= 0:
            raise ValueError(f"a log interval needs low > 0 (got {low})")
        if "int" in tags:
            if low != int(low) or high != int(high):
                raise ValueError("tag(int, interval(low, high)) needs whole-number bounds")
            return IntDistribution(int(low), int(high), log="log" in tags)
        return FloatDistribution(low, high, log="log" in tags)
    if (
        isinstance(value, RangeSweep)
        and not value.shuffle
        and all(isinstance(v, int) for v in (value.start, value.stop, value.step))
    ):
        values = list(override.sweep_iterator())
        if not values:
            raise ValueError("range() is empty: range(start, stop[, step]) stops before stop")
        if "log" in tags and (value.step != 1 or values[0] <= 0):
            raise ValueError("tag(log, range(...)) needs step 1 and start > 0")
        return IntDistribution(values[0], values[-1], log="log" in tags, step=abs(int(value.step)))
    if tags:
        raise ValueError("tags (log, int) shape an interval() or an integer range() only")
    if override.is_discrete_sweep():  # choice, a comma list, glob, a float or shuffled range
        choices = list(override.sweep_iterator(transformer=Transformer.encode))
        wrong = [c for c in choices if not isinstance(c, str | int | float | bool)]
        if wrong:
            raise ValueError(f"choices must be single values (strings, numbers, booleans); got {wrong[0]!r}")
        if not choices:
            raise ValueError("no choices")
        return CategoricalDistribution(choices)
    raise ValueError("not a search expression; use interval(), tag(log, interval()), range(), choice() or a,b,c")


def probe_overrides(space: SearchSpace) -> list[list[str]]:
    """Trials at the space's corners: if one cannot be composed, no trial can."""
    corners: dict[str, list[CategoricalChoiceType]] = {}
    for key, dist in space.distributions.items():
        corners[key] = list(dist.choices) if isinstance(dist, CategoricalDistribution) else [dist.low, dist.high]
    probes = []
    for key, values in corners.items():
        for value in values:
            params = {k: (value if k == key else v[0]) for k, v in corners.items()}
            probes.append(space.overrides(params))
    return probes
