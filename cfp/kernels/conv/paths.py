"""The kernel path table: which way each pass of a convolution is computed, in one place.

PATHS lists the kernel paths in the order they are preferred. A pass of a layer takes the first
path that has that pass and whose `applies(g, dtype)` holds for the layer's geometry (zero
padding: another padding mode is applied before, kernels/conv/padding.py) and dtype: `choose`
says which. Every pass, the workspace count the cost model reads, bench_kernels and the tests
ask `choose`; nothing else decides a path. Adding a path is one entry here (docs/design.md,
section 3c).

Backward-data has fewer paths of its own: at stride 1 it is the forward convolution of dy with
the flipped filters (the "full convolution", `full_geometry`), which takes whichever forward
path that geometry chooses; at a stride im2col's col2im, or for a 1x1 layer pointwise's GEMM
scattered to the pixels the stride kept; depthwise layers with a stride or a
multiplier take their banded backward-data; layers with few pixels and many filters (or
channels) that are not Winograd's take filter-major columns' col2im (_columns_backward_data),
and layers with few channels per-sample columns' col2im.
"""
import typing

from cfp.kernels.conv import columns, depthwise, im2col, plane, winograd
from cfp.kernels.conv.geometry import ConvGeometry
from cfp.kernels.conv.im2col import flipped_filters

PASSES = ("forward", "backward-data", "backward-filter")


class KernelPath(typing.NamedTuple):
    """One way to compute a convolution's passes on one rank's arrays.

    applies(g, dtype): whether a layer of geometry g (zero padding) and dtype takes this path.
    forward(x, w, g, xp, y[, flipped]): writes y (N, F, Ho, Wo).
    backward_data(dy, w, g, xp) -> dx (N, C, H, W); backward_filter(x, dy, g, xp) -> dw.
    A pass left None is not this path's: that pass goes to the next path that has it.
    workspace(pass_name, g, dtype): the kernels' workspace bytes (cfp/kernels/workspace.py)
    the pass asks for, or None where the path does not count them (the cost model then bounds
    them, cfp/perfmodel.py).
    flips: forward reads a layer's filters flipped itself (backward-data's full convolution
    passes flipped=True); any other path's forward is given the flipped copy.
    backward_data_applies: where backward-data's choice differs from `applies` (None: the same).
    rows(g): the rows of the path's GEMMs, the shape feature its rate moves with (None: the
    output pixels N Ho Wo); with the flops, what the cost model keys its rates on (rate_key).
    variant(g): what the path's name in `taken` adds for geometry g ('' for none; Winograd's
    tile where it is not F(4x4): ' F(2x2)'), so that the cost model keys each variant's rates
    apart. None: no variants.
    """
    name: str
    applies: typing.Callable
    forward: typing.Optional[typing.Callable] = None
    backward_data: typing.Optional[typing.Callable] = None
    backward_filter: typing.Optional[typing.Callable] = None
    workspace: typing.Optional[typing.Callable] = None
    flips: bool = False
    backward_data_applies: typing.Optional[typing.Callable] = None
    rows: typing.Optional[typing.Callable] = None
    variant: typing.Optional[typing.Callable] = None

    def named(self, g):
        """The path's name for geometry g, its variant's included (taken's names)."""
        return self.name + (self.variant(g) if self.variant is not None else "")

    def takes(self, pass_name, g, dtype):
        """Whether this path computes `pass_name` for geometry g in dtype."""
        if self.run(pass_name) is None:
            return False
        if pass_name == "backward-data" and self.backward_data_applies is not None:
            return self.backward_data_applies(g, dtype)
        return self.applies(g, dtype)

    def run(self, pass_name):
        """The function of `pass_name` (None where the path does not have it)."""
        return {"forward": self.forward, "backward-data": self.backward_data,
                "backward-filter": self.backward_filter}[pass_name]


def full_geometry(g):
    """The stride-1 backward-data's forward convolution: ((top, bottom, left, right) cropped off
    dy, its geometry). dy is padded by d(K-1) - p on each side, or cropped where that is
    negative: a padding larger than the kernel's extent made output pixels that see only
    zeros, whose dy reaches no input."""
    sides = (g.dh * (g.Kh - 1) - g.pt, g.dh * (g.Kh - 1) - g.pb,
             g.dw * (g.Kw - 1) - g.pl, g.dw * (g.Kw - 1) - g.pr)
    top, bottom, left, right = crop = tuple(max(0, -p) for p in sides)
    pt, pb, pl, pr = (max(0, p) for p in sides)
    return crop, ConvGeometry(g.N, g.F, g.Ho - top - bottom, g.Wo - left - right, g.C, g.Kh, g.Kw, 1, 1,
                              pt, pb, pl, pr, g.dh, g.dw, g.G, "zeros", g.H, g.W)


def _full_convolution(dy, w, g, xp):
    """Stride-1 dx as a forward convolution (full_geometry): dy correlated with w flipped in
    space, C and F swapped within each group, at the same dilation. This reuses the forward's
    cheap copies instead of col2im's overlapping adds."""
    (top, bottom, left, right), full = full_geometry(g)
    dy = xp.ascontiguousarray(dy[:, :, top:g.Ho - bottom, left:g.Wo - right])
    return forward(dy, w, None, full, xp, flipped=True)


def _full_convolution_bytes(pass_name, g, dtype):
    """The full convolution's workspace: that of the forward path its geometry takes."""
    return pass_bytes("forward", full_geometry(g)[1], dtype)


def _stride_one(g, dtype):
    return (g.sh, g.sw) == (1, 1)


def _always(g, dtype):
    return True


def _columns_backward_data(g, dtype):
    """Backward-data by filter-major columns where the layer takes them, or where its full
    convolution would (few input pixels, many channels: a classifier's dx), which reads the
    filters where they lie instead of flipping a copy; but a Winograd layer's backward-data
    stays Winograd's full convolution (what winograd = True asks for, and on the layers both
    take, 32 tiles and more, the faster)."""
    if _winograd_layer(g, dtype):
        return False
    return columns.applies(g, dtype) or _stride_one(g, dtype) and columns.applies(full_geometry(g)[1], dtype)


def _columns_per_sample_backward_data(g, dtype):
    """Backward-data by per-sample columns where the layer takes them, but not where its forward
    is Winograd's (forced on a layer of few channels): its full convolution is Winograd's too."""
    return not _winograd_layer(g, dtype) and columns.per_sample_applies(g, dtype)


def _winograd_layer(g, dtype):
    return winograd.applies(g, dtype) or winograd.subgrids_apply(g, dtype)


PATHS = (
    KernelPath("winograd-subgrids", winograd.subgrids_apply, forward=winograd.subgrids_forward,
               backward_filter=winograd.subgrids_backward_filter, workspace=winograd.subgrids_workspace_bytes,
               flips=True, rows=winograd.subgrids_tile_rows, variant=winograd.subgrids_tile_name),
    KernelPath("winograd", winograd.applies, forward=winograd.forward, backward_filter=winograd.backward_filter,
               workspace=winograd.workspace_bytes, flips=True, rows=winograd.tile_rows, variant=winograd.tile_name),
    KernelPath("columns", columns.applies, forward=columns.forward, backward_data=columns.backward_data,
               backward_filter=columns.backward_filter, backward_data_applies=_columns_backward_data),
    KernelPath("columns-per-sample", columns.per_sample_applies, forward=columns.per_sample_forward,
               backward_data=columns.per_sample_backward_data, backward_filter=columns.per_sample_backward_filter,
               backward_data_applies=_columns_per_sample_backward_data),
    KernelPath("depthwise", depthwise.applies, forward=depthwise.forward, backward_data=depthwise.backward_data,
               backward_filter=depthwise.backward_filter, backward_data_applies=depthwise.backward_data_applies),
    KernelPath("full-convolution", _stride_one, backward_data=_full_convolution, workspace=_full_convolution_bytes),
    KernelPath("pointwise", im2col.pointwise_applies, forward=im2col.pointwise_forward,
               backward_data=im2col.pointwise_backward_data, backward_filter=im2col.pointwise_backward_filter),
    KernelPath("plane-columns", plane.applies, forward=plane.forward, backward_filter=plane.backward_filter),
    KernelPath("im2col", _always, forward=im2col.forward, backward_data=im2col.col2im_backward_data,
               backward_filter=im2col.backward_filter),
)


def choose(pass_name, g, dtype):
    """The KernelPath that computes `pass_name` ('forward', 'backward-data', 'backward-filter')
    for geometry g (zero padding) in dtype: the first of PATHS that takes it."""
    if pass_name not in PASSES:
        raise ValueError(f"pass {pass_name!r} is not one of {', '.join(PASSES)}")
    return next(path for path in PATHS if path.takes(pass_name, g, dtype))  # im2col takes every layer


def taken(g, dtype):
    """{pass: the name of the path it takes} for geometry g (zero padding) in dtype, with its
    variant (KernelPath.named: 'winograd F(2x2)'); a backward-data by the full convolution
    names the forward path that computes it too ('full-convolution/winograd'). What
    bench_kernels and the tests report."""
    out = {}
    for pass_name in PASSES:
        path = choose(pass_name, g, dtype)
        name = path.named(g)
        if pass_name == "backward-data" and path.name == "full-convolution":
            full = full_geometry(g)[1]
            name = path.name + "/" + choose("forward", full, dtype).named(full)
        out[pass_name] = name
    return out


def rate_key(pass_name, g, dtype):
    """(path, rows) of `pass_name` on geometry g (zero padding) in dtype: the name `taken` gives
    it and the rows of the GEMMs of the path that computes it (KernelPath.rows; a full
    convolution's, those of the forward path of its geometry). The cost model's kernel rates
    are measured and looked up by these (cfp/perfmodel.py), so that its path is the kernels' own."""
    name = taken(g, dtype)[pass_name]
    path = choose(pass_name, g, dtype)
    if path.name == "full-convolution":
        g = full_geometry(g)[1]
        path = choose("forward", g, dtype)
    rows = path.rows(g) if path.rows is not None else g.N * g.Ho * g.Wo
    return name, rows


def geometry_key(g):
    """The text that names geometry g in a machine profile's measured points ('8x512x16x16
    512x512x3x3 s1,1 p1,1,1,1 d1,1 g1 zeros'): a point measured on the very shape a layer has
    is its rate, whatever its neighbours in flops and rows say (two shapes of one path can
    share both and differ in rate, e.g. a 1x1 layer's 128 -> 64 and 256 -> 32 channels)."""
    return (f"{g.N}x{g.C}x{g.H}x{g.W} {g.F}x{g.C // max(g.G, 1)}x{g.Kh}x{g.Kw} s{g.sh},{g.sw} "
            f"p{g.pt},{g.pb},{g.pl},{g.pr} d{g.dh},{g.dw} g{g.G} {g.mode}")


def pass_bytes(pass_name, g, dtype):
    """The workspace bytes `pass_name` asks for on geometry g (zero padding) in dtype, by the
    path it takes; None where that path does not count them."""
    path = choose(pass_name, g, dtype)
    return None if path.workspace is None else path.workspace(pass_name, g, dtype)


# -- the passes on a checked geometry with zero padding, by the path each takes -----------------

def forward(x, w, b, g, xp, flipped=False):
    """y (N, F, Ho, Wo) of x and w (checked, one dtype, zero padding), plus b. flipped: w are a
    layer's filters and this is its backward-data's full convolution, which takes them flipped
    in space with C and F swapped in each group: a path that `flips` transforms them so itself,
    every other one is given the flipped copy."""
    path = choose("forward", g, x.dtype)
    y = xp.empty((g.N, g.F, g.Ho, g.Wo), x.dtype)
    if flipped and path.flips:
        path.forward(x, w, g, xp, y, flipped)
    else:
        path.forward(x, flipped_filters(w, g, xp) if flipped else w, g, xp, y)
    if b is not None:
        y += xp.asarray(b, dtype=x.dtype).reshape(g.F, 1, 1)
    return y


def backward_data(dy, w, g, xp):
    """dx (N, C, H, W) of dy and w (checked, one dtype, zero padding)."""
    return choose("backward-data", g, dy.dtype).backward_data(dy, w, g, xp)


def backward_filter(x, dy, g, xp):
    """dw (F, C/G, Kh, Kw) of x and dy (checked, one dtype, zero padding)."""
    return choose("backward-filter", g, x.dtype).backward_filter(x, dy, g, xp)
