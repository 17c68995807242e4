"""The kernels' settings: which paths they may take (Winograd on or off and its tile, the plane
forward's form) and what the plane forward measured, as one object read through `current()`.

Every kernel reads its settings here and nowhere else (docs/design.md, section 3c). The
defaults come from the environment when cfp is imported: CFP_WINOGRAD and CFP_PLANE_STACKING,
'1' on, '0' off, unset cfp's choice. `configured(...)` changes them for the calling thread
inside a `with` block, as the workspace is the calling thread's (cfp/kernels/workspace.py);
`winograd(...)` is its short form for the Winograd switch.
"""
import dataclasses
import os
import threading
import typing

WINOGRAD_TILES = (2, 4)  # the output tiles F(m x m, 3 x 3) has points for (kernels/conv/winograd.py)


def _switch(variable):
    """A kernel switch read from the environment: '1' on (True), '0' off (False), unset or empty
    None (cfp chooses); any other value is refused, never taken as one of those."""
    value = os.environ.get(variable, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{variable}={value!r}: expected '1' (on), '0' (off) or unset (cfp chooses)")
    return {"1": True, "0": False}.get(value)


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """winograd: 3x3 stride-1 layers by Winograd in every dtype (True), in none (False), or in
    float32 where it pays (None, the default). winograd_tile: its output tile m, 2 or 4 for
    every layer, or None (the default) for each layer the cheaper by the kernels' measured cost
    (kernels/conv/winograd.py, tile).
    plane_stacking: the plane forward's kernel rows stacked into one GEMM (True), a GEMM a
    kernel row (False), or whichever the process measured faster (None). plane_forms: that
    measurement, {(geometry, dtype name): stacked}, shared by the threads of the process (both
    forms give the same bits, so a form measured once holds everywhere)."""
    winograd: typing.Optional[bool] = None
    winograd_tile: typing.Optional[int] = None
    plane_stacking: typing.Optional[bool] = None
    plane_forms: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name in ("winograd", "plane_stacking"):
            if not any(getattr(self, name) is allowed for allowed in (None, True, False)):  # 1 is not True here
                raise ValueError(f"kernel setting {name}={getattr(self, name)!r}: expected True, False or None")
        if self.winograd_tile is not None and self.winograd_tile not in WINOGRAD_TILES:
            raise ValueError(f"Winograd tile {self.winograd_tile!r} is not one of {list(WINOGRAD_TILES)} "
                             f"(or None: each layer's cheaper)")


_DEFAULT = KernelSettings(winograd=_switch("CFP_WINOGRAD"), plane_stacking=_switch("CFP_PLANE_STACKING"))


class _Current(threading.local):
    settings = _DEFAULT  # every thread starts from the process's defaults


_current = _Current()


def current():
    """The settings the kernels of the calling thread run with."""
    return _current.settings


class configured:
    """with configured(winograd=False, ...): the calling thread's kernels run with these
    settings changed (the others as they are when the block starts), restored when the block
    ends, also by an exception. A value the settings refuse is refused here, before the block."""

    def __init__(self, **changes):
        dataclasses.replace(current(), **changes)  # checked now
        self.changes = changes

    def __enter__(self):
        self._before = _current.settings
        _current.settings = dataclasses.replace(self._before, **self.changes)
        return _current.settings

    def __exit__(self, *exc):
        _current.settings = self._before
        return False


def winograd(enabled=True, tile=None):
    """with winograd(): ... runs 3x3 stride-1 convolutions of every dtype by Winograd F(m x m,
    3 x 3) (tile 2 or 4, default: the current setting, by default each layer's cheaper of the
    two); winograd(False) by im2col + GEMM;
    winograd(None) as by default (float32 by Winograd where it pays, float64 by im2col)."""
    tile = current().winograd_tile if tile is None else tile
    return configured(winograd=None if enabled is None else bool(enabled), winograd_tile=tile)
