"""The explanation drawn for a slide (matplotlib, imported only to draw): who holds what and
each step's groups and bytes (plot_layer); a model's bytes and memory per layer (plot_model).
"""
import math

import numpy as np

from ..grid import ProcessGrid
from ..perfmodel import PHASES
from ..report import format_bytes
from .tables import Step, _busiest, coords_text


DIM_NAMES = {"x": ("samples", "channels", "rows", "columns"), "y": ("samples", "filters", "rows", "columns"),
             "w": ("filters", "channels")}
MAX_CELLS = 32  # a longer dimension is drawn in bins of equal length


def _drawn_dims(e, family):
    """The two dimensions of an x- or y-like tensor a picture shows: those the grid splits
    (samples, then channels or filters, then rows and columns), filled up in that order."""
    if family == "w":
        return (0, 1)
    layout = e.layouts[family]
    split = [d for d, s in enumerate(layout.dims) if s is not None and e.grid[s.axis] > 1]
    return tuple(sorted((split + [d for d in (0, 1, 2, 3) if d not in split])[:2]))


def _family(tensor):
    """Which of x, y, w a step's result is drawn like."""
    if tensor == "dwdb":
        return "w"
    return "y" if tensor in ("y0", "dy") else "x"


def _draw(ax, e, family, ixs, title, colours):
    """A tensor as a matrix of cells over two of its dimensions, each cell striped with the
    colours of the ranks holding some of it (ixs[r]: rank r's global indices)."""
    from matplotlib.patches import Rectangle
    shape = e.shapes[family]
    a, b = _drawn_dims(e, family)
    bins = [max(1, math.ceil(shape[d] / MAX_CELLS)) for d in (a, b)]
    rows, cols = math.ceil(shape[a] / bins[0]), math.ceil(shape[b] / bins[1])
    sets = [(set(ix[a]), set(ix[b])) for ix in ixs]
    for i in range(rows):
        for j in range(cols):
            holders = [r for r, (sa, sb) in enumerate(sets)
                       if sa & set(range(i * bins[0], (i + 1) * bins[0])) and sb & set(range(j * bins[1], (j + 1) * bins[1]))]
            for k, r in enumerate(holders):
                ax.add_patch(Rectangle((j + k / len(holders), rows - 1 - i), 1 / len(holders), 1,
                                       facecolor=colours[r], edgecolor="none"))
            ax.add_patch(Rectangle((j, rows - 1 - i), 1, 1, facecolor="none" if holders else "#eeeeee",
                                   edgecolor="white", linewidth=0.8))
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    names = DIM_NAMES[family]
    ax.set_xlabel(f"{names[b]} ({shape[b]})" + (f", bins of {bins[1]}" if bins[1] > 1 else ""), fontsize=8)
    ax.set_ylabel(f"{names[a]} ({shape[a]})" + (f", bins of {bins[0]}" if bins[0] > 1 else ""), fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)


def _brackets(ax, step, colours):
    """The step's groups under the matrix: each group's ranks as coloured squares over a bracket,
    with the bytes each rank sends and receives beside."""
    from matplotlib.patches import Rectangle
    x = 0.0
    size = 0.07
    for group in step.group_sets():
        for r in group:
            ax.add_patch(Rectangle((x, -0.30), size, size, transform=ax.transAxes, clip_on=False,
                                   facecolor=colours[r]))
            ax.text(x + size / 2, -0.30 + size / 2, str(r), transform=ax.transAxes, fontsize=7,
                    ha="center", va="center", color="white", weight="bold")
            x += size + 0.01
        ax.plot([x - len(group) * (size + 0.01), x - 0.01], [-0.33, -0.33], transform=ax.transAxes,
                clip_on=False, color="black", linewidth=1.2)
        x += 0.05
    moved = sorted({(step.sent[r], step.received[r]) for r in range(len(step.sent))})
    text = ("each rank sends {} and receives {}".format(*map(format_bytes, moved[0])) if len(moved) == 1 else
            "; ".join(f"r{r}: {format_bytes(step.sent[r])}/{format_bytes(step.received[r])}"
                      for r in range(len(step.sent))))
    ax.text(0, -0.37, text, transform=ax.transAxes, fontsize=7, va="top", wrap=True)


def plot_layer(e, path):
    """A PNG of the explanation: who holds what, then one panel per step with the tensor it
    leaves each rank, its groups and their bytes. Written atomically."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from ..io import save_figure
    colours = [plt.get_cmap("tab10")(r % 10) for r in range(e.ranks)]
    panels = [("x", "x", [h["x"] for h in e.holds], "x: who holds what"),
              ("w", "w", [h["w"] for h in e.holds], "w (and b): who holds what"),
              ("y", "y", [h["y"] for h in e.holds], "y: who holds what")]
    for k, step in enumerate(e.steps, 1):
        what, tensor, _ = step.result[0]
        ixs = [s[2][0] if s[1] == "dwdb" else s[2] for s in step.result]
        family = _family(tensor)
        panels.append((family, step, ixs, f"{k}. {step.title()}\nthen: {what}"))
    columns = 3
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 4.4 * rows), squeeze=False)
    for ax, (family, step, ixs, title) in zip(axes.flat, panels):
        _draw(ax, e, family, ixs, "\n".join(textwrap.fill(t, 46) for t in title.split("\n")), colours)
        if isinstance(step, Step):
            _brackets(ax, step, colours)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    legend = [Patch(color=colours[r], label=f"rank {r} ({coords_text(e.coords[r], e.grid)})")
              for r in range(e.ranks)]
    fig.legend(handles=legend, loc="upper right", fontsize=8, ncol=min(4, e.ranks))
    fig.suptitle(textwrap.fill(e.header(), 110), fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93), h_pad=6.0)
    save_figure(path, fig, dpi=110)
    plt.close(fig)


def plot_model(explained, path):
    """A PNG strip: per layer, the busiest rank's bytes by phase and its memory, labelled with
    the layer's grid and algorithm. Written atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ..io import save_figure
    names = [f"{layer.name}\n{c['algorithm']} on {ProcessGrid.describe_shape(e.grid)}" for layer, c, e in explained]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 1.25 * len(names)), 6.5), sharex=True)
    base = np.zeros(len(names))
    for phase in PHASES:
        values = []
        for _, _, e in explained:
            moved = [e.bytes(r)[phase] for r in range(e.ranks)]
            values.append(max(a + b for a, b in moved) / 2 ** 10)
        if any(values):
            top.bar(range(len(names)), values, bottom=base, label=phase)
            base += values
    top.set_ylabel("KiB sent + received\n(busiest rank)")
    top.legend(fontsize=8)
    top.set_title("What each layer moves and holds per rank (one forward and backward pass)")
    bottom.bar(range(len(names)), [_busiest(e)[1] / 2 ** 10 for _, _, e in explained], color="grey")
    bottom.set_ylabel("KiB held\n(busiest rank)")
    bottom.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    save_figure(path, fig, dpi=100)
    plt.close(fig)
