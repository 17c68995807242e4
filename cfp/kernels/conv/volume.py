"""3-D convolution on one rank's NCDHW blocks: forward, backward-data, backward-filter, bias,
with PyTorch's nn.Conv3d meanings of stride, padding, dilation, groups and padding_mode.

A volume's convolution is computed as one 2-D convolution, so that every 2-D kernel path (the
path table, kernels/conv/paths.py: Winograd for 3x3 planes, im2col, pointwise, plane columns,
depthwise bands) serves volumes too: im2col along depth only ("depth columns"). Output plane o
of y sums, over kernel planes k, the 2-D convolutions of input plane o*sd + k*dd - pf with
w[:, :, k]. Stacking, for every output plane, its Kd input planes as channels,

    stacked[n * Do + o, (g, k, c)] = x_padded[n, g * C/G + c, o * sd + k * dd]    (N Do, Kd C, H, W)
    w2[f, (k, c)] = w[f, c, k]                                                   (F, Kd C/G, Kh, Kw)

makes y[n, :, o] = conv2d(stacked, w2)[n * Do + o] with the layer's in-plane stride, padding,
dilation and groups (channels stay group-major, (group, kernel plane, channel), so the 2-D
groups are the layer's). Backward-filter is the 2-D backward-filter of the same pair, w2's
gradient unstacked; backward-data the 2-D backward-data, each kernel plane's share of the
stacked gradient added back onto the input planes it was copied from (col2im along depth).
The stacked input is Kd times the input (Do/D of it at a depth stride): the copy im2col makes,
along one axis. Where a pass takes Winograd, the stack is not made: its tiles are cut from the
planes where they lie, and backward-data is the convolution of dy along depth (below).

Padding along depth: zeros are never stored (the planes a window reads outside the input are
zero planes of the stack); another mode pads the depth axis first, by the same index maps as
the 2-D kernels' (kernels/conv/padding.py), then the in-plane padding is the 2-D pass's own.
Both are separable, so this is PyTorch's padding of the whole volume.

Shapes: x (N, C, D, H, W), w (F, C/groups, Kd, Kh, Kw), b (F,), y and dy (N, F, Do, Ho, Wo).
Any of N, C, F may be 0 (empty shards of a distributed layer).
"""
from collections import namedtuple

from cfp.backend import get_array_module, index_array
from cfp.checks import int_pair, int_tuple, positive_int
from cfp.kernels import workspace
from cfp.kernels.conv import passes, paths, winograd
from cfp.kernels.conv.geometry import PADDING_MODES, _shape4, conv_geometry, require_ndim4
from cfp.kernels.conv.paths import full_geometry
from cfp.kernels.conv.padding import fold_index, pad_index

VolumeGeometry = namedtuple("VolumeGeometry", "N C D F Kd sd pf pk dd mode Do plane", module=__name__)
VolumeGeometry.__doc__ = """Sizes of one 3-D convolution along depth: input (N, C, D, ...), kernel
(F, C/G, Kd, ...), depth stride sd, padding front and back (pf, pk), dilation dd, the padding
mode, output depth Do; and `plane`, the ConvGeometry of the stacked 2-D convolution (its N is
N Do, its C is Kd C, its H, W, Ho, Wo and in-plane options the layer's)."""


def volume_padding(padding, kernel, dilation, stride):
    """(front, back, top, bottom, left, right) from an int, a triple, 'valid', 'same' (PyTorch's
    meaning: the output as large as the input at stride 1, an even kernel's extra plane, row and
    column at the back, bottom and right) or cfp's own 6 sides."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * 6
        if padding != "same":
            raise ValueError(f"padding {padding!r} is not one of 'valid', 'same', an integer or a triple")
        if stride != (1, 1, 1):
            raise ValueError(f"padding 'same' is not supported for strided convolutions (stride={stride})")
        sides = ()
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            sides += (total // 2, total - total // 2)
        return sides
    if isinstance(padding, (tuple, list)) and len(padding) == 6:
        return sum((int_pair(padding[i:i + 2], "padding", 0, "non-negative integers") for i in (0, 2, 4)), ())
    pd, ph, pw = int_tuple(padding, 3, "padding", 0, "a non-negative integer, a triple, 'same' or 'valid'")
    return pd, pd, ph, ph, pw, pw


def volume_options(stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """A 3-D convolution's options checked without shapes and put in one form (what a layer
    checks when it is made, as conv_options in 2-D): stride and dilation triples, padding a
    triple, six sides, 'same' or 'valid', groups, padding_mode."""
    stride = int_tuple(stride, 3, "stride", 1, "a positive integer")
    dilation = int_tuple(dilation, 3, "dilation", 1, "a positive integer")
    groups = positive_int(groups, "groups")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode {padding_mode!r} is not one of {', '.join(PADDING_MODES)}")
    if isinstance(padding, str) or (isinstance(padding, (tuple, list)) and len(padding) == 6):
        volume_padding(padding, (1, 1, 1), dilation, stride)  # the string's (or the sides') own checks
    else:
        padding = int_tuple(padding, 3, "padding", 0, "a non-negative integer, a triple, 'same' or 'valid'")
    return {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups,
            "padding_mode": padding_mode}


def volume_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """The VolumeGeometry of x_shape (N, C, D, H, W) convolved with w_shape (F, C/groups, Kd, Kh,
    Kw), with PyTorch's nn.Conv3d meanings. Raises ValueError, naming the bad value, for what
    PyTorch rejects (as conv_geometry does in 2-D), the depth's as the rows' and columns'."""
    N, C, D, H, W = _shape4(x_shape, "x", "(N, C, D, H, W)", ndim=5)
    F, Cw, Kd, Kh, Kw = _shape4(w_shape, "w", "(F, C / groups, Kd, Kh, Kw)", ndim=5)
    G = positive_int(groups, "groups")
    if C % G or F % G:
        raise ValueError(f"groups={G} must divide the input channels C={C} and the filters F={F}")
    if C // G != Cw:
        grouped = f" ({C} channels in {G} groups)" if G > 1 else ""
        raise ValueError(f"x has C={C} channels but w expects {Cw * G}{grouped} (w.shape={tuple(w_shape)})")
    stride = int_tuple(stride, 3, "stride", 1, "a positive integer")
    dilation = int_tuple(dilation, 3, "dilation", 1, "a positive integer")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode {padding_mode!r} is not one of {', '.join(PADDING_MODES)}")
    sides = volume_padding(padding, (Kd, Kh, Kw), dilation, stride)
    (sd, dd), (pf, pk) = (stride[0], dilation[0]), sides[:2]
    if padding_mode == "reflect" and max(pf, pk) >= D and pf + pk:
        raise ValueError(f"padding {sides[:2]} (front, back) with padding_mode 'reflect' must be smaller than "
                         f"the input depth D={D}")
    if padding_mode == "circular" and max(pf, pk) > D:
        raise ValueError(f"padding {sides[:2]} (front, back) with padding_mode 'circular' wraps around the "
                         f"input depth D={D} more than once")
    if padding_mode == "replicate" and D == 0 and pf + pk:
        raise ValueError(f"padding_mode 'replicate' cannot pad an empty depth D={D}")
    Dp, extent = D + pf + pk, dd * (Kd - 1) + 1
    if Kd < 1 or extent > Dp:
        dilated = f" with dilation {dd} (extent {extent})" if dd != 1 else ""
        raise ValueError(f"kernel depth {Kd}{dilated} does not fit the padded input depth {Dp} (D={D}, "
                         f"padding {(pf, pk)} front and back): it must be between 1 and the padded depth")
    Do = (Dp - extent) // sd + 1
    # the stacked 2-D convolution checks the channels, groups and in-plane sizes, in the 2-D words
    try:
        plane = conv_geometry((N * Do, Kd * C, H, W), (F, Kd * Cw, Kh, Kw), stride[1:], sides[2:],
                              dilation[1:], G, padding_mode)
    except ValueError as e:
        raise ValueError(f"{e} (the rows and columns of the volume {D}x{H}x{W})") from None
    return VolumeGeometry(N, C, D, F, Kd, sd, pf, pk, dd, padding_mode, Do, plane)


def conv3d_output_shape(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """(N, F, Do, Ho, Wo) of conv3d_forward on x_shape (N, C, D, H, W) and w_shape (F, C/groups, Kd, Kh, Kw)."""
    v = volume_geometry(x_shape, w_shape, stride, padding, dilation, groups, padding_mode)
    return (v.N, v.F, v.Do, v.plane.Ho, v.plane.Wo)


def conv3d_flops(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """2 N (C/G) F Do Ho Wo Kd Kh Kw: the multiply-adds, counted as 2 flops, of each pass."""
    v = volume_geometry(x_shape, w_shape, stride, padding, dilation, groups, padding_mode)
    g = v.plane
    return 2 * v.N * (v.C // g.G) * v.F * v.Do * g.Ho * g.Wo * v.Kd * g.Kh * g.Kw


def _require_dy(dy, v):
    require_ndim4(dy, "dy", "(N, F, Do, Ho, Wo)", ndim=5)
    expected = (v.N, v.F, v.Do, v.plane.Ho, v.plane.Wo)
    if tuple(dy.shape) != expected:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but the convolution output is {expected} (N, F, Do, Ho, Wo)")


def _plane_options(v):
    g = v.plane
    return {"stride": (g.sh, g.sw), "padding": (g.pt, g.pb, g.pl, g.pr), "dilation": (g.dh, g.dw),
            "groups": g.G, "padding_mode": g.mode}


def _pad_depth(x, v, xp):
    """x padded along depth in v's (non-zero) mode, and v without depth padding."""
    at = index_array(pad_index(v.D, v.pf, v.pk, v.mode), xp)
    return xp.ascontiguousarray(x[:, :, at]), v._replace(D=v.D + v.pf + v.pk, pf=0, pk=0)


def _kernel_planes(v):
    """(k, first, count, start) for each kernel plane k: the output planes start..start+count-1
    whose window plane k reads inside the input, from input plane `first` on, every sd-th."""
    for k in range(v.Kd):
        offset = k * v.dd - v.pf  # the input plane output plane 0 reads with kernel plane k
        start = -(offset // v.sd) if offset < 0 else 0  # ceil(-offset / sd)
        stop = min(v.Do, (v.D - 1 - offset) // v.sd + 1) if v.D - 1 >= offset else 0
        count = max(0, stop - start)
        yield k, offset + start * v.sd, count, start


def _stack(x, v, xp, outs=None):
    """stacked (N n, G Kd C/G, H, W): each output plane's Kd input planes as channels, for the n
    output planes `outs` (a range; all of them by default)."""
    N, C, D, H, W = x.shape
    G = v.plane.G
    Cg = C // G
    outs = range(v.Do) if outs is None else outs
    lo, hi = outs.start, outs.stop
    stacked = xp.empty((N, hi - lo, G, v.Kd, Cg, H, W), x.dtype)
    grouped = x.reshape(N, G, Cg, D, H, W)
    for k, first, count, start in _kernel_planes(v):
        a, b = max(start, lo), min(start + count, hi)  # of outs, the planes whose window plane k reads
        if b <= a:
            stacked[:, :, :, k] = 0
            continue
        stacked[:, :a - lo, :, k] = 0
        stacked[:, b - lo:, :, k] = 0
        read = first + (a - start) * v.sd
        stacked[:, a - lo:b - lo, :, k] = grouped[:, :, :, read:read + (b - a - 1) * v.sd + 1:v.sd].transpose(0, 3, 1, 2, 4, 5)
    return stacked.reshape(N * (hi - lo), G * v.Kd * Cg, H, W)


# -- Winograd on the planes where they lie ------------------------------------------------------
# Where the stacked convolution takes Winograd (a volume's 3x3 planes, stride 1 in the plane),
# its tiles are cut from the input's planes where they lie, and y (or dx) is written straight
# into its planes. At depth stride and dilation 1, winograd.planes_forward and
# planes_backward_filter transform each plane's tiles once, into a ring of Kd slots that the
# output planes' GEMMs read in turn (the depth padding's planes zero slots). Otherwise the
# stacked input of a sample's output planes whose windows stay inside the volume is a strided
# view of x (_planes_view), which Winograd's tiles read in place (winograd._copy_sample_rows),
# and only the few output planes whose windows reach into the depth padding (pf at the front,
# pk at the back) are stacked as above. The stack is memory traffic, which two ranks
# on one machine share: half of the 64^3 volume of 32 channels stacked in 7 ms on one rank alone
# and in 14 ms with both ranks running (docs/design.md, "Volumes and transposed convolutions").

def _interior(v):
    """range of the output planes whose windows read input planes only (no depth padding)."""
    lo = -(-v.pf // v.sd)
    hi = min(v.Do, (v.D - 1 + v.pf - (v.Kd - 1) * v.dd) // v.sd + 1)
    return range(lo, max(lo, hi))


def _planes_view(x, v, n, outs, xp):
    """Sample n's stacked input for the output planes `outs` (inside _interior), read where it
    lies: (len(outs), Kd, C, H, W) with [o, k, c] = x[n, c, (outs[0] + o) sd + k dd - pf], a
    strided view of x (no copy)."""
    C, H, W = x.shape[1], x.shape[3], x.shape[4]
    strides = x.strides
    base = x[n, :, outs.start * v.sd - v.pf:]
    return xp.lib.stride_tricks.as_strided(base, (len(outs), v.Kd, C, H, W),
                                           (v.sd * strides[2], v.dd * strides[2], strides[1], strides[3], strides[4]))


# At a depth stride or dilation other than 1 (the strided view, _planes_view), a plane read in
# place has at least this many Winograd tiles. Measured at one thread (AMD EPYC guest, float32,
# padding 1, C = F), the view against the stacked planes: 64^3 volumes of 32 channels (256 tiles
# a plane) 12% faster over the three passes, 32^3 (64 tiles) 2-6% faster, 16^3 of 64 channels
# (16 tiles) 8-10% slower, a sample's few planes then filling Winograd's blocks of tiles less
# well than the stack of every sample's.
IN_PLACE_TILES = 64
# At depth stride and dilation 1 (the ring), a plane read in place has at least RING_PIXELS
# outputs, or at least SMALL_RING_PIXELS with at least SMALL_RING_CHANNELS input channels and no
# more filters than those. The ring runs a GEMM, an output transform and a placement for every
# output plane of every sample, of one plane's tiles each, which on small planes cost more than
# what it saves (Kd - 1 of every Kd input transforms, and the stack's copies). Measured on the
# Zen 5 guest, the three passes, one thread, ring against stack with OpenBLAS's Haswell and
# SkylakeX kernels alike (BENCHMARKS.md, "Volumes: the ring on small planes"): 24^3 and larger
# 0.66-0.84; 16^3 with C >= F >= 16 and C >= 32 0.71-1.01 (2x32x32 level), with C < F 1.00-1.26,
# 1x16x16 1.26-1.33; 12^3 and 8^3 1.27-2.18.
RING_PIXELS, SMALL_RING_PIXELS, SMALL_RING_CHANNELS = 512, 256, 32


def ring_pays(plane, Kd):
    """Whether the ring reads a volume's planes in place (RING_PIXELS), for its stacked
    convolution `plane` of Kd kernel planes (plane.C // Kd input channels a plane)."""
    pixels, C = plane.Ho * plane.Wo, plane.C // Kd
    return pixels >= RING_PIXELS or pixels >= SMALL_RING_PIXELS and C >= max(plane.F, SMALL_RING_CHANNELS)


def reads_in_place(plane, Kd, pass_name, dtype="float32", ring=True):
    """Whether a volume's pass, on its stacked convolution `plane` of Kd kernel planes, reads
    the planes where they lie instead of stacking them: where that pass takes Winograd (not
    its sub-grids; backward-data by its full convolution, cropping nothing in the plane). ring:
    the volume's depth stride and dilation are 1, so that each plane's tiles are transformed
    once (winograd.planes_forward), on planes large enough for it (ring_pays: 24x24 and up, or
    16x16 of at least 32 channels to no more filters). Otherwise (the strided view, each plane
    transformed in every window that reads it) only on planes of at least IN_PLACE_TILES
    tiles, and backward-data, whose convolution of dy along
    depth (_full_depth) then transforms Kd F channels where the stacked one transforms F and
    writes Kd C, only where F <= C (measured: 16 channels to 32 on 32^3, 24 against 19-20 ms)."""
    if plane.mode != "zeros" or ring and not ring_pays(plane, Kd):
        return False
    if not ring and (winograd.plane_tiles(plane) < IN_PLACE_TILES
                     or pass_name == "backward-data" and plane.F * Kd > plane.C):
        return False
    if pass_name == "backward-data":
        crop, full = full_geometry(plane)
        return crop == (0, 0, 0, 0) and paths.choose(pass_name, plane, dtype).name == "full-convolution" \
            and paths.choose("forward", full, dtype).name == "winograd"
    return paths.choose(pass_name, plane, dtype).name == "winograd"


def _in_place(v, pass_name, dtype):
    """Whether `pass_name` of the volume v reads its planes in place (reads_in_place) and has
    output planes whose windows stay inside the volume; backward-data only at depth stride 1
    with the padding within the kernel's extent, where it is the convolution of dy along depth
    (_full_depth)."""
    if not reads_in_place(v.plane, v.Kd, pass_name, dtype, ring=(v.sd, v.dd) == (1, 1)):
        return False
    if pass_name == "backward-data":
        full = _full_depth(v)
        return v.sd == 1 and full.pf >= 0 and full.pk >= 0 and len(_interior(full)) > 0
    return len(_interior(v)) > 0


def _full_depth(v):
    """A stride-1 volume's backward-data as a convolution of dy along depth (the volume's
    VolumeGeometry with x and y swapped): dx plane p = sum over kernel planes j of dy plane
    p + j dd - pf', with j = Kd - 1 - k and pf' = dd (Kd - 1) - pf (pk' likewise)."""
    extent = v.dd * (v.Kd - 1)
    return v._replace(C=v.F, F=v.C, D=v.Do, Do=v.D, pf=extent - v.pf, pk=extent - v.pk)


@workspace.call
def _winograd_forward(x, w, g, xp, y, flipped=False):
    winograd.forward(x, w, g, xp, y, flipped)


@workspace.call
def _winograd_planes_forward(x, w, g, Kd, front, xp, y, flipped=False):
    winograd.planes_forward(x, w, g, Kd, front, xp, y, flipped)


@workspace.call
def _winograd_planes_backward_filter(x, dy, g, Kd, front, xp):
    return winograd.planes_backward_filter(x, dy, g, Kd, front, xp)


@workspace.call
def _winograd_backward_filter(x, dy, g, xp):
    return winograd.backward_filter(x, dy, g, xp)


def _forward_in_place(x, w2, v, g2, xp, y, flipped=False):
    """y's planes (N, F, Do, Ho, Wo) of the volume convolution v of x with the stacked filters
    w2 by Winograd on x's planes where they lie: at depth stride and dilation 1 every plane by
    winograd.planes_forward; otherwise the interior planes (_interior), one sample at a time,
    and the planes before and after them stacked (_stack) and convolved by the 2-D pass. g2:
    the 2-D geometry of a stacked sample's convolution (its N is replaced). flipped: this is a
    backward-data's full convolution (_full_depth; winograd.forward's meaning), g2 its 2-D
    layer's full geometry, y that layer's dx."""
    if (v.sd, v.dd) == (1, 1):  # every plane's tiles transformed once, the padding's as zeros
        _winograd_planes_forward(x, w2, g2, v.Kd, v.pf, xp, y, flipped)
        return y
    inner = _interior(v)
    for n in range(v.N):
        _winograd_forward(_planes_view(x, v, n, inner, xp), w2, g2._replace(N=len(inner)), xp,
                          y[n, :, inner.start:inner.stop].transpose(1, 0, 2, 3), flipped)
    for outs in (range(0, inner.start), range(inner.stop, v.Do)):
        if len(outs):
            stacked = _stack(x, v, xp, outs)
            if flipped:
                part = passes.conv2d_backward_data(stacked, w2, (stacked.shape[0], v.F, g2.Ho, g2.Wo),
                                                   **_plane_options(v))
            else:
                part = passes.conv2d_forward(stacked, w2, None, **_plane_options(v))
            y[:, :, outs.start:outs.stop] = part.reshape((v.N, len(outs)) + part.shape[1:]).transpose(0, 2, 1, 3, 4)
    return y


def _unstack_add(d_stacked, v, xp, dtype, H, W):
    """The adjoint of _stack: dx (N, C, D, H, W) with each kernel plane's share of the stacked
    gradient added onto the input planes it was copied from."""
    G = v.plane.G
    Cg = v.C // G
    d = d_stacked.reshape(v.N, v.Do, G, v.Kd, Cg, H, W)
    dx = xp.zeros((v.N, G, Cg, v.D, H, W), dtype)
    for k, first, count, start in _kernel_planes(v):
        if count:
            dx[:, :, :, first:first + (count - 1) * v.sd + 1:v.sd] += \
                d[:, start:start + count, :, k].transpose(0, 2, 3, 1, 4, 5)
    return dx.reshape(v.N, v.C, v.D, H, W)


def stacked_copies(plane):
    """{pass: the elements it copies around its 2-D pass} where the volume's passes stack its
    planes, counted on the stacked convolution `plane` (its ConvGeometry): forward and
    backward-filter stack the input and turn y's planes (dy's) into samples, backward-data
    unstacks the stacked gradient and turns dy's planes into samples."""
    stack, planes = plane.N * plane.C * plane.H * plane.W, plane.N * plane.F * plane.Ho * plane.Wo
    return {"forward": stack + planes, "backward-data": stack + planes, "backward-filter": stack + planes}


def copied_elements(plane, Kd, dtype="float32", ring=True):
    """{pass: the elements a volume's pass copies around its 2-D pass} on the stacked
    convolution `plane` of Kd kernel planes (ring: at depth stride and dilation 1):
    stacked_copies, but none for a pass that reads its planes where they lie (reads_in_place;
    not counted: the few planes the strided view stacks at the depth padding, and that a
    backward-data of depth stride 2 or more stays stacked). The cost model adds their time to a
    volume's passes (perfmodel.layer_cost), at the rate calibration times on copy_passes."""
    return {p: 0 if reads_in_place(plane, Kd, p, dtype, ring) else n for p, n in stacked_copies(plane).items()}


def copy_passes(x, w_shape, **options):
    """The copies stacked_copies counts, made on x (N, C, D, H, W) for a kernel of w_shape
    with these options (zero padding): what calibration times for the rate of a volume's
    copies (calibrate_layers' 'volume')."""
    v = volume_geometry(x.shape, w_shape, **options)
    xp = get_array_module(x)
    stacked = _stack(x, v, xp)
    _stack(x, v, xp)
    _unstack_add(stacked, v, xp, x.dtype, v.plane.H, v.plane.W)
    y = xp.zeros((v.N, v.F, v.Do, v.plane.Ho, v.plane.Wo), x.dtype)
    for _ in range(3):
        _planes_as_samples(y, xp)


def _filters2(w, v):
    """w (F, C/G, Kd, Kh, Kw) as the stacked convolution's (F, Kd C/G, Kh, Kw), (plane, channel)."""
    F, Cg, Kd, Kh, Kw = w.shape
    return w.transpose(0, 2, 1, 3, 4).reshape(F, Kd * Cg, Kh, Kw)


def _planes_as_samples(a, xp):
    """a (N, F, Do, Ho, Wo) as (N Do, F, Ho, Wo): each output plane a sample of the 2-D pass."""
    N, F, Do, Ho, Wo = a.shape
    return xp.ascontiguousarray(a.transpose(0, 2, 1, 3, 4)).reshape(N * Do, F, Ho, Wo)


def conv3d_forward(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """y (N, F, Do, Ho, Wo) = x (N, C, D, H, W) cross-correlated with w (F, C/groups, Kd, Kh,
    Kw), plus b (F,), as PyTorch's nn.Conv3d: stride and dilation an int or a triple (depth,
    rows, columns); padding an int, a triple, 'valid', 'same' or (front, back, top, bottom,
    left, right); groups; padding_mode 'zeros', 'reflect', 'replicate' or 'circular'."""
    require_ndim4(x, "x", "(N, C, D, H, W)", ndim=5)
    require_ndim4(w, "w", "(F, C / groups, Kd, Kh, Kw)", ndim=5)
    v = volume_geometry(x.shape, w.shape, stride, padding, dilation, groups, padding_mode)
    xp = get_array_module(x, w)
    dtype = xp.result_type(x.dtype, w.dtype)
    x = xp.ascontiguousarray(x, dtype=dtype)
    if v.mode != "zeros" and v.pf + v.pk:
        x, v = _pad_depth(x, v, xp)
    g = v.plane
    w2 = _filters2(w.astype(dtype, copy=False), v)
    if _in_place(v, "forward", dtype):
        y = _forward_in_place(x, w2, v, g, xp, xp.empty((v.N, v.F, v.Do, g.Ho, g.Wo), dtype))
        if b is not None:
            y += xp.asarray(b, dtype=dtype).reshape(v.F, 1, 1, 1)
        return y
    y2 = passes.conv2d_forward(_stack(x, v, xp), w2, b, **_plane_options(v))
    return xp.ascontiguousarray(y2.reshape(v.N, v.Do, v.F, g.Ho, g.Wo).transpose(0, 2, 1, 3, 4))


def conv3d_backward_data(dy, w, x_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dx (N, C, D, H, W) from dy (N, F, Do, Ho, Wo); x_shape is needed because with a stride
    several input sizes give one output size. Positions no window reads get zero gradient;
    under a padding mode other than zeros the border's gradient goes back to the positions it
    copied."""
    require_ndim4(w, "w", "(F, C / groups, Kd, Kh, Kw)", ndim=5)
    v = volume_geometry(x_shape, w.shape, stride, padding, dilation, groups, padding_mode)
    _require_dy(dy, v)
    xp = get_array_module(dy, w)
    dtype = xp.result_type(dy.dtype, w.dtype)
    H, W = v.plane.H, v.plane.W
    if v.N * v.C * v.D * H * W == 0:
        return xp.zeros((v.N, v.C, v.D, H, W), dtype)
    padded = v.mode != "zeros" and v.pf + v.pk
    u = v._replace(D=v.D + v.pf + v.pk, pf=0, pk=0) if padded else v
    g = v.plane
    if not padded and _in_place(v, "backward-data", dtype):
        # dx = dy convolved along depth with the kernel planes reversed (_full_depth), each plane
        # pair by the 2-D full convolution (flipped filters, C and F swapped)
        full = _full_depth(v)
        w_full = xp.ascontiguousarray(w.astype(dtype, copy=False)[:, :, ::-1].transpose(2, 0, 1, 3, 4)).reshape(
            v.Kd * v.F, v.C, g.Kh, g.Kw)  # [(j, f), c] = w[f, c, Kd - 1 - j]
        layer = conv_geometry((v.N * v.D, v.C, H, W), w_full.shape, **_plane_options(v))
        return _forward_in_place(dy.astype(dtype, copy=False), w_full, full, full_geometry(layer)[1], xp,
                                 xp.empty((v.N, v.C, v.D, H, W), dtype), flipped=True)  # dy read with any strides
    d_stacked = passes.conv2d_backward_data(_planes_as_samples(dy.astype(dtype, copy=False), xp),
                                            _filters2(w.astype(dtype, copy=False), v),
                                            (g.N, g.C, H, W), **_plane_options(v))
    dx = _unstack_add(d_stacked, u, xp, dtype, H, W)
    if padded:
        dx = fold_index(dx, pad_index(v.D, v.pf, v.pk, v.mode), v.D, 2)
    return dx


def conv3d_backward_filter(x, dy, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dw (F, C/groups, Kd, Kh, Kw) from x (N, C, D, H, W) and dy (N, F, Do, Ho, Wo)."""
    require_ndim4(x, "x", "(N, C, D, H, W)", ndim=5)
    v = volume_geometry(x.shape, w_shape, stride, padding, dilation, groups, padding_mode)
    _require_dy(dy, v)
    xp = get_array_module(x, dy)
    dtype = xp.result_type(x.dtype, dy.dtype)
    x = xp.ascontiguousarray(x, dtype=dtype)
    if v.mode != "zeros" and v.pf + v.pk:
        x, v = _pad_depth(x, v, xp)
    F, Cg, Kd, Kh, Kw = (int(s) for s in w_shape)
    dy = dy.astype(dtype, copy=False)
    if _in_place(v, "backward-filter", dtype):
        dw2 = _backward_filter_in_place(x, dy, v, xp)
    else:
        dw2 = passes.conv2d_backward_filter(_stack(x, v, xp), _planes_as_samples(dy, xp), (F, Kd * Cg, Kh, Kw),
                                            **_plane_options(v))
    return xp.ascontiguousarray(dw2.reshape(F, Kd, Cg, Kh, Kw).transpose(0, 2, 1, 3, 4))


def _backward_filter_in_place(x, dy, v, xp):
    """The stacked filters' gradient (F, Kd C, Kh, Kw) by Winograd on x's planes where they lie:
    at depth stride and dilation 1 by winograd.planes_backward_filter; otherwise on the interior
    planes with dy's planes read through a strided view, a sample at a time, then the planes
    before and after them stacked."""
    if (v.sd, v.dd) == (1, 1):  # every plane's tiles transformed once, the padding's as zeros
        return _winograd_planes_backward_filter(x, dy, v.plane, v.Kd, v.pf, xp)
    inner = _interior(v)
    geometry = v.plane._replace(N=len(inner))
    dw2 = None
    for n in range(v.N):
        part = _winograd_backward_filter(_planes_view(x, v, n, inner, xp),
                                         dy[n, :, inner.start:inner.stop].transpose(1, 0, 2, 3), geometry, xp)
        if dw2 is None:
            dw2 = part
        else:
            dw2 += part
    for outs in (range(0, inner.start), range(inner.stop, v.Do)):
        if len(outs):
            dw2 += passes.conv2d_backward_filter(_stack(x, v, xp, outs), _planes_as_samples(dy[:, :, outs.start:outs.stop], xp),
                                                 dw2.shape, **_plane_options(v))
    return dw2


def conv3d_backward_bias(dy):
    """db (F,) = dy (N, F, Do, Ho, Wo) summed over samples and output positions."""
    require_ndim4(dy, "dy", "(N, F, Do, Ho, Wo)", ndim=5)
    return passes.sum_over_positions(dy)
