"""Argument checks shared across cfp, each raising ValueError that names the value and what
was expected. The checks depend only on their arguments, so every rank raises alike."""
import numbers
import operator


def positive_int(value, what):
    """int(value) for an integer >= 1 (bool excluded); else "{what} must be a positive integer"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def int_pair(value, name, minimum, expected):
    """(a, b) from an int or a pair of ints, each >= minimum; else ValueError saying that `name`
    must be `expected` (e.g. "a positive integer") or a pair of them."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    try:
        if len(items) != 2 or any(isinstance(v, bool) for v in items):
            raise TypeError
        pair = tuple(operator.index(v) for v in items)
    except TypeError:
        raise ValueError(f"{name} must be {expected} or a pair of them, got {value!r}") from None
    if min(pair) < minimum:
        raise ValueError(f"{name} must be {expected} or a pair of them, got {value!r}")
    return pair
