"""Argument checks shared across cfp, each raising ValueError that names the value and what
was expected. The checks depend only on their arguments, so every rank raises alike (the one
that looks at a single rank's world, alike_on_all_ranks, shares its verdict)."""
import math
import numbers
import operator

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def positive_int(value, what):
    """int(value) for an integer >= 1 (bool excluded); else "{what} must be a positive integer"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def positive_ints(text, what, count=None):
    """The positive integers of a comma-separated option text ('1,2,4'), as a tuple, `count` of
    them where given; else ValueError naming `what` and the text."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or (count is not None and len(values) != count):
        many = f"{count} positive integers" if count is not None else "positive integers"
        raise ValueError(f"{what} {text!r}: expected {many} separated by commas")
    return values


def int_pair(value, name, minimum, expected):
    """(a, b) from an int or a pair of ints, each >= minimum; else ValueError saying that `name`
    must be `expected` (e.g. "a positive integer") or a pair of them."""
    return int_tuple(value, 2, name, minimum, expected)


_TUPLE_WORDS = {1: "one", 2: "pair", 3: "triple"}


def int_tuple(value, n, name, minimum, expected):
    """An n-tuple of ints, each >= minimum, from an int (repeated n times) or n ints: the sizes
    of a window over n spatial axes (a pair for images, a triple for volumes). Else ValueError
    saying that `name` must be `expected` (e.g. "a positive integer") or a pair (triple) of them."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,) * n
    them = f"{expected} or a {_TUPLE_WORDS.get(n, f'{n}-tuple')} of them"
    try:
        if len(items) != n or any(isinstance(v, bool) for v in items):
            raise TypeError
        ints = tuple(operator.index(v) for v in items)
    except TypeError:
        raise ValueError(f"{name} must be {them}, got {value!r}") from None
    if min(ints) < minimum:
        raise ValueError(f"{name} must be {them}, got {value!r}")
    return ints


def finite_number(value, what, minimum=None, above=None):
    """float(value) for a finite number (>= minimum, > above when given); else ValueError.
    NaN passes every comparison test by failing it, hence the explicit check."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum:g}, got {value!r}")
    if above is not None and not value > above:
        raise ValueError(f"{what} must be > {above:g}, got {value!r}")
    return float(value)


def float_dtype(dtype, what):
    """The dtype when it is float32 or float64 (cfp computes in nothing else); else ValueError."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what} has dtype {dtype}; expected float32 or float64")
    return dtype


def alike_on_all_ranks(comm, check, root=0):
    """Run `check()` on `root` alone (say, a look at the file system rank 0 will write to) and
    raise its ValueError on every rank of `comm`, so that all ranks stop together."""
    problem = None
    if comm.Get_rank() == root:
        try:
            check()
        except ValueError as e:
            problem = str(e)
    problem = comm.bcast(problem, root=root)  # text or None: the pickling form fits
    if problem is not None:
        raise ValueError(problem)


def checked_on_every_rank(comm, check):
    """Run `check()` on every rank of `comm` (say, whether this rank's node has a GPU) and return
    its value; where it raises ValueError on any rank, every rank raises the first such rank's
    message, naming the ranks that failed, so that all ranks stop together."""
    try:
        value, problem = check(), None
    except ValueError as e:
        value, problem = None, str(e)
    problems = comm.allgather(problem)  # text or None per rank: the pickling form fits
    bad = [r for r, p in enumerate(problems) if p is not None]
    if bad:
        ranks = "every rank" if len(bad) == comm.Get_size() else f"rank(s) {', '.join(map(str, bad))}"
        raise ValueError(f"{problems[bad[0]]} (on {ranks})")
    return value


def int_at_least(value, what, minimum):
    """The integer `value` (any integer type, bool excluded) when it is >= minimum; else
    "{what} must be an integer >= {minimum}"."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return number


def at_least(value, minimum, what):
    """`value` when it is a number >= minimum (infinity allowed, NaN refused); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return value


def nonnegative_int(value, what):
    """int(value) for an integer >= 0 (bool excluded); else "{what} must be a non-negative integer"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def option_name(field):
    """The command-line spelling of an option's field: max_steps -> --max-steps."""
    return "--" + field.replace("_", "-")


def int_options(holder, positive=(), nonnegative=()):
    """Check the integer options named (by field) on `holder`, parsed arguments or a config:
    each a positive or a non-negative integer, the error naming the option (--max-steps).
    None means the option was not given and passes."""
    for names, check in ((positive, positive_int), (nonnegative, nonnegative_int)):
        for name in names:
            if getattr(holder, name) is not None:
                check(getattr(holder, name), option_name(name))
