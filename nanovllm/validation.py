"""The validation kit: every setting is checked where it is made (chapters 00 and 01).

``SamplingParams``, ``EngineConfig``, ``ModelConfig`` and the server's ``ServeConfig`` check
their fields with the same small predicates and the same rule table, ``(field, test, what is
allowed)``: a bad value raises ``ValueError`` naming the field, the value and what is allowed,
before it can fail (or quietly produce garbage) deep inside the engine. The predicates are
strict about types: ``True`` is not a token count, NaN is not a number.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

# What torch.Generator.manual_seed accepts: any signed or unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)

Test = Callable[[Any], bool]
Rule = tuple[str, Test, str]  # (field, test, what is allowed)


def is_int(x: object) -> bool:
    """An integer, numpy's included, but not a bool (``True`` is not a token count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_positive_int(x: object) -> bool:
    """An integer >= 1 (a count, a size)."""
    return is_int(x) and x >= 1


def is_number(x: object) -> bool:
    """A real number that is not a bool and not NaN (inf passes; see ``is_finite``)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x


def is_finite(x: object) -> bool:
    """A real number that a float can hold: not NaN, not inf, not an int beyond 1.8e308."""
    try:
        return is_number(x) and math.isfinite(float(x))
    except OverflowError:
        return False


def is_bool(x: object) -> bool:
    return isinstance(x, bool)


def is_optional_str(x: object) -> bool:
    return x is None or isinstance(x, str)


def is_seed(x: object) -> bool:
    """An int that ``torch.Generator.manual_seed`` accepts (``SEED_RANGE``)."""
    return is_int(x) and SEED_RANGE[0] <= x <= SEED_RANGE[1]


def optional(test: Test) -> Test:
    """``test``, or None (the setting is left to its default)."""
    return lambda x: x is None or test(x)


def one_of(choices: tuple[str, ...]) -> tuple[Test, str]:
    """A test and its description for a setting that names one of ``choices``."""
    return (lambda x: isinstance(x, str) and x in choices), f"one of {choices}"


def check_fields(obj: object, rules: Iterable[Rule]) -> None:
    """Raise ``ValueError`` for the first field of ``obj`` that fails its rule; turn the
    numbers that pass into plain ``int``/``float`` (numpy scalars would leak downstream)."""
    for name, test, allowed in rules:
        value = getattr(obj, name)
        if not test(value):
            raise ValueError(f"{type(obj).__name__}.{name} must be {allowed}, got {value!r}")
        if is_int(value):
            setattr(obj, name, int(value))
        elif is_number(value) and not isinstance(value, float):
            setattr(obj, name, float(value))
