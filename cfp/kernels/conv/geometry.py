"""The geometry of one 2-D convolution: its options in PyTorch's nn.Conv2d meanings, checked
and put in one form (ConvGeometry), the output size and flop count, and the checks of the
arrays the passes take. Every kernel path reads its sizes from a ConvGeometry.

Output size, with padding top, bottom, left, right (pt, pb, pl, pr), dilation (dh, dw) and the
kernel's extent eh = dh (Kh - 1) + 1, ew = dw (Kw - 1) + 1:
Ho = (H + pt + pb - eh) // sh + 1 and Wo = (W + pl + pr - ew) // sw + 1.
"""
import operator
from collections import namedtuple

from cfp.checks import float_dtype, int_pair, positive_int

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

ConvGeometry = namedtuple(
    "ConvGeometry", "N C H W F Kh Kw sh sw pt pb pl pr dh dw G mode Ho Wo", module=__name__
)
ConvGeometry.__doc__ = """Sizes of one convolution: input (N, C, H, W), kernel (F, C/G, Kh, Kw),
stride (sh, sw), padding top, bottom, left, right (pt, pb, pl, pr), dilation (dh, dw), groups G,
padding mode, and output (Ho, Wo)."""


def _shape4(shape, name, layout, ndim=4):
    """shape as a tuple of `ndim` non-negative ints (4 for an image, 5 for a volume); else
    ValueError naming `name` and its `layout`."""
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ValueError(f"{name} must be a {ndim}-D shape {layout}, got {shape!r}") from None
    if len(dims) != ndim or min(dims) < 0:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(shape)!r}")
    return dims


def _padding(padding, kernel, dilation, stride):
    """(top, bottom, left, right) from an int, a pair, 'valid' or 'same' (PyTorch's meaning:
    the output as large as the input at stride 1; with an even kernel the extra row and column
    go to the bottom and the right)."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding != "same":
            raise ValueError(f"padding {padding!r} is not one of 'valid', 'same', an integer or a pair")
        if stride != (1, 1):
            raise ValueError(f"padding 'same' is not supported for strided convolutions (stride={stride})")
        out = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            out += [total // 2, total - total // 2]
        return tuple(out)
    if isinstance(padding, (tuple, list)) and len(padding) == 4:  # cfp's own: (top, bottom, left, right)
        sides = tuple(int_pair(padding[i:i + 2], "padding", 0, "non-negative integers") for i in (0, 2))
        return sides[0] + sides[1]
    ph, pw = int_pair(padding, "padding", 0, "a non-negative integer, a pair, 'same' or 'valid'")
    return ph, ph, pw, pw


def conv_options(stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """The convolution's options checked without shapes and put in one form: stride and
    dilation pairs, padding a pair or 'same' / 'valid', groups, padding_mode. What a layer
    checks when it is made, before it sees an input."""
    stride = int_pair(stride, "stride", 1, "a positive integer")
    dilation = int_pair(dilation, "dilation", 1, "a positive integer")
    groups = positive_int(groups, "groups")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode {padding_mode!r} is not one of {', '.join(PADDING_MODES)}")
    if isinstance(padding, (tuple, list)) and len(padding) == 4:
        padding = _padding(padding, (1, 1), dilation, stride)
    elif not isinstance(padding, str):
        padding = int_pair(padding, "padding", 0, "a non-negative integer, a pair, 'same' or 'valid'")
    else:
        _padding(padding, (1, 1), dilation, stride)  # the string's own checks
    return {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups,
            "padding_mode": padding_mode}


def conv_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """The ConvGeometry of x_shape (N, C, H, W) convolved with w_shape (F, C/groups, Kh, Kw),
    with PyTorch's nn.Conv2d meanings of stride, padding, dilation, groups and padding_mode.

    Raises ValueError, naming the bad value, for everything PyTorch rejects: a shape that is not
    4-D, channels that do not match, groups that do not divide C and F, a non-positive stride or
    dilation, a negative or unknown padding, 'same' with a stride, an unknown padding mode, a
    reflection wider than the input or a wrap-around more than once, or a kernel larger than
    the padded input.
    """
    N, C, H, W = _shape4(x_shape, "x", "(N, C, H, W)")
    F, Cw, Kh, Kw = _shape4(w_shape, "w", "(F, C / groups, Kh, Kw)")
    G = positive_int(groups, "groups")
    if C % G or F % G:
        raise ValueError(f"groups={G} must divide the input channels C={C} and the filters F={F}")
    if C // G != Cw:
        grouped = f" ({C} channels in {G} groups)" if G > 1 else ""
        raise ValueError(
            f"x has C={C} channels but w expects {Cw * G}{grouped} (w.shape={tuple(w_shape)})"
        )
    sh, sw = int_pair(stride, "stride", 1, "a positive integer")
    dh, dw = int_pair(dilation, "dilation", 1, "a positive integer")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode {padding_mode!r} is not one of {', '.join(PADDING_MODES)}")
    pt, pb, pl, pr = _padding(padding, (Kh, Kw), (dh, dw), (sh, sw))
    if padding_mode == "reflect" and (max(pt, pb) >= H and pt + pb or max(pl, pr) >= W and pl + pr):
        raise ValueError(f"padding {(pt, pb, pl, pr)} (top, bottom, left, right) with padding_mode 'reflect' "
                         f"must be smaller than the input {H}x{W}")
    if padding_mode == "circular" and (max(pt, pb) > H or max(pl, pr) > W):
        raise ValueError(f"padding {(pt, pb, pl, pr)} (top, bottom, left, right) with padding_mode 'circular' "
                         f"wraps around the input {H}x{W} more than once")
    if padding_mode == "replicate" and (H == 0 and pt + pb or W == 0 and pl + pr):
        raise ValueError(f"padding_mode 'replicate' cannot pad an empty {H}x{W} input")
    Hp, Wp = H + pt + pb, W + pl + pr
    eh, ew = dh * (Kh - 1) + 1, dw * (Kw - 1) + 1  # the kernel's extent
    if Kh < 1 or Kw < 1 or eh > Hp or ew > Wp:
        dilated = f" with dilation {(dh, dw)} (extent {eh}x{ew})" if (dh, dw) != (1, 1) else ""
        raise ValueError(
            f"kernel {Kh}x{Kw}{dilated} does not fit the padded input {Hp}x{Wp} "
            f"(H={H}, W={W}, padding={(pt, pb, pl, pr)}): each kernel side must be between 1 and the "
            f"padded input side"
        )
    Ho = (Hp - eh) // sh + 1
    Wo = (Wp - ew) // sw + 1
    return ConvGeometry(N, C, H, W, F, Kh, Kw, sh, sw, pt, pb, pl, pr, dh, dw, G, padding_mode, Ho, Wo)


def conv2d_output_shape(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """(N, F, Ho, Wo) of conv2d_forward on x_shape (N, C, H, W) and w_shape (F, C/groups, Kh, Kw)."""
    g = conv_geometry(x_shape, w_shape, stride, padding, dilation, groups, padding_mode)
    return (g.N, g.F, g.Ho, g.Wo)


def conv2d_flops(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """2 N (C/G) F Ho Wo Kh Kw: the multiply-adds, counted as 2 flops, of each of the three passes."""
    return geometry_flops(conv_geometry(x_shape, w_shape, stride, padding, dilation, groups, padding_mode))


def geometry_flops(g):
    """2 N (C/G) F Ho Wo Kh Kw of ConvGeometry g: what each of its passes computes."""
    return 2 * g.N * (g.C // g.G) * g.F * g.Ho * g.Wo * g.Kh * g.Kw


def require_ndim4(array, name, layout, ndim=4):
    """A 4-D (a volume's: ndim=5) float32 or float64 array (integers and complex numbers are not
    convolved here)."""
    if getattr(array, "ndim", None) != ndim:
        shape = getattr(array, "shape", None)
        raise ValueError(f"{name} must be a {ndim}-D array {layout}, got shape {shape!r}")
    float_dtype(array.dtype, name)


def require_dy(dy, g):
    expected = (g.N, g.F, g.Ho, g.Wo)
    require_ndim4(dy, "dy", "(N, F, Ho, Wo)")
    if tuple(dy.shape) != expected:
        raise ValueError(
            f"dy has shape {tuple(dy.shape)} but the convolution output is {expected} "
            f"(N, F, Ho, Wo)"
        )



def padded_size(g):
    return g.H + g.pt + g.pb, g.W + g.pl + g.pr


def padded_geometry(g):
    """The geometry of the same convolution over its input padded already (by a padding mode
    other than zeros): Hp x Wp input, no padding, zero mode."""
    Hp, Wp = padded_size(g)
    return g._replace(H=Hp, W=Wp, pt=0, pb=0, pl=0, pr=0, mode="zeros")


def check_bias(b, g):
    if b is not None and tuple(getattr(b, "shape", ())) != (g.F,):
        raise ValueError(
            f"b must have shape ({g.F},) to match the F={g.F} filters of w, got shape "
            f"{getattr(b, 'shape', None)!r}"
        )
