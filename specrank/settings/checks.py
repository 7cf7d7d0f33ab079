"""Setting checks with scikit-learn style messages: the setting, what is allowed, what was found.

Every stage validates all of its settings with these before it loads a model or
fits anything, so a bad value costs seconds, not the minutes an 8B load takes. A bad
value raises `Refusal`: the entry points print its message, with no stack trace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from numbers import Integral, Real

from specrank.settings.errors import Refusal


def check_choice(setting: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise Refusal(f"The '{setting}' must be one of {list(allowed)}. Got {value!r} instead.")


def check_subset(setting: str, values: Iterable[object], allowed: Sequence[object]) -> None:
    values = list(values)
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise Refusal(
            f"The '{setting}' must be a list of values from {list(allowed)}. "
            f"Got {values!r} instead (unknown: {unknown})."
        )


def _bounds(low: float | None, high: float | None) -> str:
    lo = "-inf" if low is None else f"{low:g}"
    hi = "inf" if high is None else f"{high:g}"
    return f"[{lo}, {hi}]" if high is not None else f"[{lo}, {hi})"


def check_int(setting: str, value: object, low: int | None = None, high: int | None = None) -> None:
    """An int (not a bool) in [low, high]; None means unbounded."""
    ok = isinstance(value, Integral) and not isinstance(value, bool)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        raise Refusal(
            f"The '{setting}' must be an int in the range {_bounds(low, high)}. Got {value!r} instead."
        )


def check_ints(setting: str, values: Sequence[object], low: int | None = None,
               high: int | None = None) -> None:  # fmt: skip
    """A non-empty list of ints, each in [low, high]."""
    values = list(values)
    bad = [
        v for v in values
        if not (isinstance(v, Integral) and not isinstance(v, bool))
        or (low is not None and v < low) or (high is not None and v > high)
    ]  # fmt: skip
    if not values or bad:
        raise Refusal(
            f"The '{setting}' must be a non-empty list of ints in the range {_bounds(low, high)}. "
            f"Got {values!r} instead."
        )


def check_real(setting: str, value: object, low: float | None = None, high: float | None = None,
               low_open: bool = False) -> None:  # fmt: skip
    """A finite number in [low, high] (or (low, high] with `low_open`)."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or value <= high)
    if not ok:
        bounds = _bounds(low, high)
        if low_open:
            bounds = "(" + bounds[1:]
        raise Refusal(
            f"The '{setting}' must be a number in the range {bounds}. Got {value!r} instead."
        )
