"""Every layer on every grid against the same layer on one rank (float64, forward and backward):
the distributed output, input gradient and parameter gradients equal the serial ones."""
import numpy as np
import pytest
from mpi4py import MPI

from cfp import backend
from cfp import comm as C
from cfp.grid import ProcessGrid
from cfp.nn import (AvgPool2d, BatchNorm2d, Conv2d, Flatten, GlobalAvgPool2d, Linear, MaxPool2d, ReLU,
                    Redistribute, Residual, Sequential, SoftmaxCrossEntropy)
from cfp.perfmodel import ledger_bytes
from cfp.tensor import DistTensor, Layout
from conftest import assert_all_ranks, assert_close_all_ranks, grid_specs

pytestmark = pytest.mark.mpi

ALGORITHMS = [("sample", None), ("x", None), ("y", None), ("w", 1), ("w", 2), ("w", None)]


def usable(spec, algorithm, p_f):
    P_c = int(spec.split("channel=")[1])
    return p_f is None or P_c % p_f == 0


CASES = [(s, a, p) for s in grid_specs() for a, p in ALGORITHMS if usable(s, a, p)]


def case_id(case):
    spec, alg, p_f = case
    return f"{spec}-{alg}" + (f"{p_f}" if p_f else "")


@pytest.fixture(scope="module")
def grids():
    made = {spec: ProcessGrid(spec) for spec in grid_specs()}
    made["serial"] = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
    yield made
    for g in made.values():
        g.free()


def layout(ndim, split):
    return Layout(("sample", "channel" if split else None) + (None,) * (ndim - 2))


def gather_parameter(p, what="grad"):
    """The global array of a parameter's gradient (or data), gathered from the ranks' shards."""
    return backend.to_host(p.tensor(getattr(p, what)).gather())


def compare(make, grids, spec, x, dy, in_split, out_split, what, train_passes=1):
    """Run make(grid) on one rank and on `spec`, forward and backward, and compare."""
    results = {}
    for which in ("serial", spec):
        grid = grids[which]
        module = make(grid)
        for _ in range(train_passes - 1):  # earlier passes move batch-norm running statistics
            module.forward(DistTensor.from_global(x, layout(x.ndim, in_split and which != "serial"), grid).local)
        split_in, split_out = in_split and which != "serial", out_split and which != "serial"
        x_local = DistTensor.from_global(x, layout(x.ndim, split_in), grid).local
        dy_local = DistTensor.from_global(dy, layout(dy.ndim, split_out), grid).local
        y_local = module.forward(x_local)
        dx_local = module.backward(dy_local)
        results[which] = {
            "y": DistTensor(y_local, dy.shape, layout(dy.ndim, split_out), grid).gather(),
            "dx": None if dx_local is None else DistTensor(dx_local, x.shape, layout(x.ndim, split_in), grid).gather(),
            "grads": {p.name: gather_parameter(p) for p in module.parameters()},
            "buffers": {n: gather_parameter(b, "data") for n, b in module.buffers().items()},
        }
    serial, dist = results["serial"], results[spec]
    assert_close_all_ranks(dist["y"], serial["y"], 1e-10, f"{what} y")
    assert_all_ranks((serial["dx"] is None) == (dist["dx"] is None),
                     f"{what}: dx is {'missing' if dist['dx'] is None else 'computed'} on {spec} but "
                     f"{'missing' if serial['dx'] is None else 'computed'} on one rank")
    if serial["dx"] is not None:
        assert_close_all_ranks(dist["dx"], serial["dx"], 1e-10, f"{what} dx")
    assert serial["grads"].keys() == dist["grads"].keys()
    for name in serial["grads"]:
        assert_close_all_ranks(dist["grads"][name], serial["grads"][name], 1e-10, f"{what} {name}")
    for name in serial["buffers"]:
        assert_close_all_ranks(dist["buffers"][name], serial["buffers"][name], 1e-10, f"{what} {name}")
    return serial, dist


def fit(p_f, grid):
    """p_f on the distributed grid; the serial reference (P_c = 1) takes the default."""
    return p_f if p_f is not None and grid.axis_size("channel") % p_f == 0 else None


def measured_bytes(ledger):
    """{(layer, phase): (bytes sent, bytes received)} from a ledger: what Network.predicted_bytes
    and the layers' predicted_bytes are held to."""
    return {k: (t["bytes_sent"], t["bytes_received"]) for k, t in ledger.totals(by=("layer", "phase")).items()}


def ranks_at_least_two(why):
    """The world's size; the test skips (saying why) on one rank."""
    size = MPI.COMM_WORLD.Get_size()
    if size == 1:
        pytest.skip(why)
    return size


def data(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_conv_block_with_pooling(grids, case):
    """Conv (first layer: input whole, no dx) -> ReLU -> MaxPool -> Conv -> AvgPool, end to end."""
    spec, alg, p_f = case
    split = alg != "sample"

    def make(grid):
        kw = dict(algorithm=alg, filter_groups=fit(p_f, grid), dtype=np.float64)
        return Sequential(Conv2d(grid, 3, 6, 3, padding=1, input_whole=True, need_dx=False, name="c1", **kw), ReLU(),
                          MaxPool2d(2), Conv2d(grid, 6, 5, 3, padding=1, name="c2", **kw), AvgPool2d(2, 1))
    x, dy = data((3, 3, 8, 7), 1), data((3, 5, 3, 2), 2)
    compare(make, grids, spec, x, dy, in_split=False, out_split=split, what=case_id(case))


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_batchnorm(grids, case, mode):
    spec, alg, _ = case
    split = alg != "sample"

    def make(grid):
        bn = BatchNorm2d(grid, 5, layout=layout(4, split), dtype=np.float64)
        bn.weight.data = bn.weight.take(1.0 + data(5, 3))  # non-trivial gamma and beta
        bn.bias.data = bn.bias.take(data(5, 4))
        return bn if mode == "train" else _EvalAfterTraining(bn)
    x, dy = data((5, 5, 3, 4), 5) * 2 + 1, data((5, 5, 3, 4), 6)
    compare(make, grids, spec, x, dy, in_split=split, out_split=split, what=f"bn {mode} {case_id(case)}")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_blocks_of_no_samples_pass_through_every_layer(grids, mode):
    """One sample over every rank of the sample axis: the ranks after the first hold blocks of
    no samples (as 5 samples over 6 or 8 sample ranks do), which convolution, batch norm (its
    sums), pooling, flatten and the classifier pass through like any other block: the serial
    y, dx and gradients."""
    size = ranks_at_least_two("a block of no samples needs a second sample rank")
    spec = f"sample={size},channel=1"
    if spec not in grids:
        grids[spec] = ProcessGrid(spec)

    def make(grid):
        bn = BatchNorm2d(grid, 4, layout=layout(4, False), dtype=np.float64)
        bn.weight.data = bn.weight.take(1.0 + data(4, 3))
        bn.bias.data = bn.bias.take(data(4, 4))
        return Sequential(Conv2d(grid, 3, 4, 3, padding=1, algorithm="sample", name="c1", dtype=np.float64),
                          bn if mode == "train" else _EvalAfterTraining(bn), ReLU(), MaxPool2d(2),
                          Conv2d(grid, 4, 6, 3, padding=1, algorithm="sample", name="c2", dtype=np.float64),
                          GlobalAvgPool2d(), Flatten(), Linear(grid, 6, 5, algorithm="sample", name="fc",
                                                                dtype=np.float64))
    x, dy = data((1, 3, 4, 6), 5) * 2 + 1, data((1, 5), 6)
    compare(make, grids, spec, x, dy, in_split=False, out_split=False, what=f"{mode}, blocks of no samples")


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("x_dtype,p_dtype", [(np.float32, np.float32), (np.float64, np.float64),
                                             (np.float32, np.float64), (np.float64, np.float32)])
def test_batchnorm_against_its_formula_in_every_dtype_pairing(x_dtype, p_dtype, mode):
    """Batch norm (its in-place passes, and the promoted ones where x and the parameters differ
    in dtype) against the textbook formula in float64, with NumPy's dtype promotion for y, dx
    and the parameters' gradients."""
    grid = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
    bn = BatchNorm2d(grid, 5, dtype=p_dtype)
    gamma, beta = (1.0 + data(5, 3)).astype(p_dtype), data(5, 4).astype(p_dtype)
    bn.weight.data, bn.bias.data = gamma.copy(), beta.copy()
    mean, var = data(5, 7).astype(p_dtype), (1.5 + data(5, 8) ** 2).astype(p_dtype)
    if mode == "eval":
        bn.running_mean.data, bn.running_var.data = mean.copy(), var.copy()
        bn.eval()
    x, dy = (data((4, 5, 3, 2), 5) * 2 + 1).astype(x_dtype), data((4, 5, 3, 2), 6).astype(x_dtype)
    y, dx = bn.forward(x), bn.backward(dy)
    promoted = np.result_type(x_dtype, p_dtype)
    assert y.dtype == promoted and dx.dtype == promoted, (y.dtype, dx.dtype)
    x64, dy64, g, b = (a.astype(np.float64).reshape((1, -1, 1, 1)) if a.ndim == 1 else a.astype(np.float64)
                       for a in (x, dy, gamma, beta))
    if mode == "train":
        mu, sigma2 = x64.mean(axis=(0, 2, 3), keepdims=True), x64.var(axis=(0, 2, 3), keepdims=True)
    else:
        mu, sigma2 = (a.astype(np.float64).reshape((1, -1, 1, 1)) for a in (mean, var))
    x_hat = (x64 - mu) / np.sqrt(sigma2 + bn.eps)
    expected_dx = g / np.sqrt(sigma2 + bn.eps) * (
        dy64 - dy64.mean(axis=(0, 2, 3), keepdims=True) - x_hat * (dy64 * x_hat).mean(axis=(0, 2, 3), keepdims=True)
        if mode == "train" else dy64)
    tolerance = 1e-12 if x_dtype == p_dtype == np.float64 else 2e-5
    for got, want in ((y, x_hat * g + b), (dx, expected_dx), (bn.bias.grad, dy64.sum(axis=(0, 2, 3))),
                      (bn.weight.grad, (dy64 * x_hat).sum(axis=(0, 2, 3)))):
        assert np.abs(got - want).max() <= tolerance * np.abs(want).max()


class _EvalAfterTraining(Sequential):
    """A batch norm that saw one training batch (moving its running statistics), then runs in
    eval mode."""

    def __init__(self, bn):
        super().__init__(bn)
        self.trained = False

    def forward(self, x):
        if not self.trained:
            self.modules[0].train().forward(x)
            self.modules[0].eval()
            self.trained = True
        return super().forward(x)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_residual_with_projection(grids, case):
    spec, alg, p_f = case
    split = alg != "sample"

    def make(grid):
        kw = dict(algorithm=alg, filter_groups=fit(p_f, grid), dtype=np.float64, bias=False)
        body = Sequential(Conv2d(grid, 4, 6, 3, stride=2, padding=1, name="b1", **kw),
                          BatchNorm2d(grid, 6, layout(4, split), name="bn1", dtype=np.float64), ReLU(),
                          Conv2d(grid, 6, 6, 3, padding=1, name="b2", **kw))
        shortcut = Sequential(Conv2d(grid, 4, 6, 1, stride=2, name="proj", **kw),
                              BatchNorm2d(grid, 6, layout(4, split), name="proj_bn", dtype=np.float64))
        return Sequential(Residual(body, shortcut), ReLU(), Residual(Sequential(ReLU())))
    x, dy = data((4, 4, 6, 6), 7), data((4, 6, 3, 3), 8)
    compare(make, grids, spec, x, dy, in_split=split, out_split=split, what=f"residual {case_id(case)}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_head_linear_gather_and_loss(grids, case):
    """GlobalAvgPool -> Linear -> Redistribute (logits whole over the channel axis) ->
    SoftmaxCrossEntropy: loss, accuracy and the gradient that flows back into the network."""
    spec, alg, p_f = case
    split = alg != "sample"
    x = data((5, 6, 3, 3), 9)
    labels = np.random.default_rng(10).integers(0, 7, 5)
    out = {}
    for which in ("serial", spec):
        grid = grids[which]
        s = split and which != "serial"
        head = Sequential(GlobalAvgPool2d(), Linear(grid, 6, 7, algorithm=alg, filter_groups=fit(p_f, grid),
                                                    dtype=np.float64, name="fc"))
        logits_spec = (grid, Layout(("sample", None)))
        end = head.place((grid, layout(4, s)))
        if end[1].on(grid) != logits_spec[1].on(grid):
            head.modules.append(Redistribute(end, logits_spec, name="loss"))
        loss_fn = SoftmaxCrossEntropy(grid)
        x_dist = DistTensor.from_global(x, layout(4, s), grid)
        sample_box = DistTensor.from_global(labels[:, None], Layout(("sample", None)), grid).local[:, 0]
        ledger = C.CommLedger()
        with C.use_ledger(ledger):
            logits = head.forward(x_dist)
            loss, correct = loss_fn.forward(logits.local, sample_box)
            dx = head.backward(DistTensor(loss_fn.backward(), logits.global_shape, logits.layout, grid))
        out[which] = (loss, correct, dx.gather(), gather_parameter(head.modules[1].weight))
        # the ledger holds the Linear's phases and the redistribution of the logits to their
        # prediction, forward and back (what Network.predicted_bytes reads)
        fc, moves = head.modules[1], [m for m in head.modules if isinstance(m, Redistribute)]
        predicted = {("fc", phase): v for phase, v in fc.predicted_bytes(8).items()}
        predicted.update({("loss", "redistribute"): m.predicted_bytes(8) for m in moves})
        measured = measured_bytes(ledger)
        assert_all_ranks(all(measured.get(k, (0, 0)) == v for k, v in predicted.items()),
                         f"{which}: measured {measured}, predicted {predicted}")
        if s and grid.shape["channel"] > 1:  # the check has something to see, where a rank has samples
            holds_samples = x_dist.local.shape[0] > 0  # (5 samples over sample=6: one group holds none)
            assert_all_ranks(not holds_samples or bool(moves) and predicted[("loss", "redistribute")] != (0, 0)
                             and predicted[("fc", "forward")] != (0, 0), f"nothing moves: {predicted}")
    (l0, c0, dx0, dw0), (l1, c1, dx1, dw1) = out["serial"], out[spec]
    assert_close_all_ranks(np.array([l1]), np.array([l0]), 1e-12, "loss")
    assert c0 == c1
    assert_close_all_ranks(dx1, dx0, 1e-10, "dx through the head")
    assert_close_all_ranks(dw1, dw0, 1e-10, "fc weight gradient")


def test_local_layers_against_numpy(grids):
    """ReLU, Flatten and GlobalAvgPool2d on one rank, checked directly."""
    x = data((2, 3, 4, 5), 11)
    relu = ReLU()
    assert np.array_equal(relu.forward(x), np.maximum(x, 0))
    assert np.array_equal(relu.backward(np.ones_like(x)), (x > 0).astype(float))
    flat = Flatten()
    assert flat.forward(x).shape == (2, 60) and flat.backward(flat.forward(x)).shape == x.shape
    gap = GlobalAvgPool2d()
    assert np.allclose(gap.forward(x), x.mean(axis=(2, 3)))
    assert np.allclose(gap.backward(np.ones((2, 3))), np.full(x.shape, 1 / 20))


def test_network_predicts_each_convolutions_bytes():
    """Network.predicted_bytes holds each convolution's phases, equal to what the ledger
    measures: for the data-parallel c1 (w 2x1x3x3 and b 2: 20 float64), the gradient allreduce
    at 2 ranks moves each rank's 20 - 10 values out in the reduce-scatter and 10 in the
    allgather, 160 bytes each way; at 1 rank nothing."""
    from cfp.nn import Network
    from cfp.partition import block_range
    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    grid = ProcessGrid(f"sample={size}")
    net = Network([Conv2d(grid, 1, 2, 3, padding=1, algorithm="sample", input_whole=True, need_dx=False,
                          name="c1", dtype=np.float64),
                   GlobalAvgPool2d(), Linear(grid, 2, 3, algorithm="sample", name="fc", dtype=np.float64)],
                  grids=None, layers={})
    lo, hi = block_range(4, size, rank)
    x = np.random.default_rng(0).standard_normal((4, 1, 5, 5))[lo:hi]
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        logits = net.forward(x, 4)
        net.backward(np.ones_like(logits))
    predicted = net.predicted_bytes(itemsize=8)
    measured = measured_bytes(ledger)
    assert_all_ranks(("c1", "gradient-sync") in predicted and ("fc", "gradient-sync") in predicted,
                     f"the convolutions' phases are predicted: {sorted(predicted)}")
    if size <= 2:
        assert_all_ranks(predicted[("c1", "gradient-sync")] == ((160, 160) if size == 2 else (0, 0)),
                         f"c1's gradient allreduce by hand: {predicted[('c1', 'gradient-sync')]}")
    assert_all_ranks(all(measured.get(k, (0, 0)) == v for k, v in predicted.items())
                     and all(k in predicted for k, v in measured.items() if v != (0, 0)),
                     f"measured {measured}, predicted {predicted}")
    grid.free()


def test_flatten_refuses_a_split_image():
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("needs 2 ranks to split the image")
    grid = ProcessGrid(f"sample=1,height={MPI.COMM_WORLD.Get_size()}")
    spec = (grid, Layout(("sample", None, "height", None)))
    with pytest.raises(ValueError, match=r"splits the image over height; this layer needs whole images"):
        Flatten().output_spec(spec)
    grid.free()


def test_redistribute_predicts_what_it_moves_both_ways():
    """A (3, 6, 2, 2) float64 activation from samples over the ranks to channels over them, and
    its gradient back: the ledger holds both exchanges, as Redistribute.predicted_bytes says.
    At 2 ranks by hand: rank 0 keeps samples 0-1 of channels 0-2 and sends samples 0-1 of
    channels 3-5 (2 * 3 * 4 values, 192 bytes), receives sample 2 of channels 0-2 (96); the
    gradient goes the other way: 288 bytes each way in all."""
    size = MPI.COMM_WORLD.Get_size()
    grid = ProcessGrid(f"sample={size}")
    by_sample, by_channel = Layout(("sample", None, None, None)), Layout((None, "sample", None, None))
    step = Redistribute((grid, by_sample), (grid, by_channel), name="move")
    x = data((3, 6, 2, 2), 3)
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        y = step.forward(DistTensor.from_global(x, by_sample, grid))
    forward_only = step.predicted_bytes(8)
    forward_measured = ledger_bytes(ledger, "move")["redistribute"]
    assert_all_ranks(forward_only == forward_measured,
                     f"after forward only: predicted {forward_only}, measured {forward_measured}")
    if size == 2:
        assert_all_ranks(forward_only == ((192, 96) if grid.rank == 0 else (96, 192)),
                         f"forward only by hand, predicted {forward_only}")
    with C.use_ledger(ledger):
        dx = step.backward(y)
    measured = ledger_bytes(ledger, "move")["redistribute"]
    predicted = step.predicted_bytes(8)
    assert_all_ranks(measured == predicted, f"measured {measured}, predicted {predicted}")
    if size == 2:
        expected = (288, 288) if grid.rank == 0 else (192 + 96, 96 + 192)
        assert_all_ranks(predicted == expected, f"by hand {expected}, predicted {predicted}")
    assert_close_all_ranks(dx.gather(), x, 1e-15, "the gradient moved back")
    grid.free()


def test_place_names_both_specs_when_the_input_comes_elsewhere():
    """A layer on channel=P placed after one on sample=P: the refusal names the grid and layout
    the input comes on and those the layer expects."""
    size = ranks_at_least_two("needs 2 ranks for two different grids")
    by_channel, by_sample = ProcessGrid(f"channel={size}"), ProcessGrid(f"sample={size}")
    conv = Conv2d(by_channel, 4, 4, 3, padding=1, algorithm="y", name="c2", dtype=np.float64)
    with pytest.raises(ValueError, match=rf"c2: input on grid sample={size} with layout Layout\(sample, -, -, -\), "
                                         rf"expected grid channel={size} with layout Layout\(sample, channel, -, -\)$"):
        conv.place((by_sample, Layout(("sample", None, None, None))))
    by_channel.free()
    by_sample.free()


@pytest.mark.parametrize("padding_mode", ["zeros", "circular"])
@pytest.mark.parametrize("split_image", [True, False], ids=["split", "copies"])
def test_a_layer_on_a_height_split_grid_predicts_its_bytes(split_image, padding_mode):
    """On height=P, a layer that splits the image exchanges halos and allreduces its gradient
    over the P image ranks; one that does not (split_image=False) holds copies of the image and
    moves what it would on one rank. Either way Conv2d.predicted_bytes is what the ledger holds,
    and y is the serial convolution (wrapped around: the halo brings rows from the far rank)."""
    from cfp.kernels import conv2d_forward
    from cfp.nn import Sequential
    size = MPI.COMM_WORLD.Get_size()
    grid = ProcessGrid(f"height={size}")
    conv = Conv2d(grid, 2, 3, 3, padding=1, algorithm="sample", name="c", dtype=np.float64,
                  split_image=split_image, padding_mode=padding_mode)
    net = Sequential(conv)
    x_global = data((2, 2, max(8, size), 5), 4)  # a row of output for each of up to 16 ranks
    x = DistTensor.from_global(x_global, conv.input_spec[1], grid)
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        y = net.forward(x)
        net.backward(DistTensor(np.ones_like(y.local), y.global_shape, y.layout, grid))
    expected = conv2d_forward(x_global, conv.weight.data, conv.bias.data, padding=1, padding_mode=padding_mode)
    assert_close_all_ranks(y.gather(), expected, 1e-12, f"y with {padding_mode} padding")
    predicted = {("c", phase): v for phase, v in conv.predicted_bytes(8).items()}
    measured = measured_bytes(ledger)
    assert_all_ranks(all(measured.get(k, (0, 0)) == v for k, v in predicted.items()),
                     f"measured {measured}, predicted {predicted}")
    if size > 1:
        moved = predicted[("c", "halo")] != (0, 0)
        assert_all_ranks(moved == split_image, f"halo {predicted[('c', 'halo')]} with split_image={split_image}")
    grid.free()


def test_zero_grad_clears_every_gradient():
    grid = ProcessGrid(f"sample={MPI.COMM_WORLD.Get_size()}")
    conv = Conv2d(grid, 2, 3, 3, name="c", dtype=np.float64)
    for p in conv.parameters():
        p.grad = np.ones_like(p.data)
    conv.zero_grad()
    assert_all_ranks(all(p.grad is None for p in conv.parameters()) and len(conv.parameters()) == 2,
                     "zero_grad leaves a gradient")
    grid.free()


def test_residual_adds_its_body_to_the_input_by_hand():
    """Residual(ReLU) on a (4, 3, 2, 2) tensor split by sample: y = relu(x) + x, and the
    gradient of sum(y * dy) is dy * (x > 0) + dy."""
    size = MPI.COMM_WORLD.Get_size()
    grid = ProcessGrid(f"sample={size}")
    layout = Layout(("sample", None, None, None))
    x, dy = data((4, 3, 2, 2), 5), data((4, 3, 2, 2), 6)
    block = Residual(Sequential(ReLU()))
    y = block.forward(DistTensor.from_global(x, layout, grid))
    dx = block.backward(DistTensor.from_global(dy, layout, grid))
    assert_close_all_ranks(y.gather(), np.maximum(x, 0) + x, 1e-15, "y = relu(x) + x")
    assert_close_all_ranks(dx.gather(), dy * (x > 0) + dy, 1e-15, "dx = dy (x > 0) + dy")
    grid.free()


def test_a_container_holds_its_childrens_buffers_and_parameters():
    grid = ProcessGrid(f"sample={MPI.COMM_WORLD.Get_size()}")
    net = Sequential(Conv2d(grid, 2, 3, 3, name="c", dtype=np.float64),
                     Sequential(BatchNorm2d(grid, 3, name="bn", dtype=np.float64)))
    names = sorted(net.buffers())
    assert_all_ranks(len(names) == 2 and all(n.startswith("bn") for n in names), f"buffers {names}")
    params = [p.name for p in net.parameters()]
    assert_all_ranks(len(params) == 4 and params[:2] == ["c.weight", "c.bias"], f"parameters {params}")
    everything = (net, net.modules[0], net.modules[1], net.modules[1].modules[0])
    net.eval()
    assert_all_ranks(not any(m.training for m in everything), "eval() reaches every child")
    net.train()
    assert_all_ranks(all(m.training for m in everything), "train() reaches every child")
    grid.free()


def test_a_non_square_kernels_weight_gathers_whole(grids):
    """A 3x1 kernel under stationary-y and stationary-w on channel=P: the weight gathered from
    the channel ranks' shards (ConvAlgorithm.weight_tensor(...).gather()) is the whole weight
    that the same seed gives on one rank."""
    size = MPI.COMM_WORLD.Get_size()
    grid = ProcessGrid(f"channel={size}")
    for algorithm in ("y", "w"):
        kw = dict(padding=(1, 0), algorithm=algorithm, name="c", dtype=np.float64)
        conv = Conv2d(grid, 4, 5, (3, 1), **kw)
        whole = conv.conv.weight_tensor(conv.weight.data).gather()
        one_rank = Conv2d(grids["serial"], 4, 5, (3, 1), **kw).weight.data
        assert_close_all_ranks(whole, one_rank, 1e-15, f"the gathered weight of {algorithm}")
        assert_close_all_ranks(gather_parameter(conv.weight, "data"), one_rank, 1e-15,
                               f"{algorithm}'s weight parameter")
    grid.free()


def test_a_sequential_refuses_an_input_on_another_grid():
    size = ranks_at_least_two("needs 2 ranks for two different grids")
    by_channel, by_sample = ProcessGrid(f"channel={size}"), ProcessGrid(f"sample={size}")
    from cfp.nn import Sequential
    net = Sequential(Conv2d(by_channel, 4, 4, 3, padding=1, algorithm="y", name="c2", dtype=np.float64))
    x = DistTensor.from_global(data((size, 4, 3, 3), 7), Layout(("sample", None, None, None)), by_sample)
    with pytest.raises(ValueError, match=rf"input arrives on grid sample={size} with layout Layout\(sample, -, -, -\), "
                                         rf"expected grid channel={size} with layout Layout\(sample, channel, -, -\) "
                                         rf"\(call place\(\) on the model to insert the Redistribute\)$"):
        net.forward(x)
    by_channel.free()
    by_sample.free()


def test_a_residual_merge_is_walked_and_its_bytes_predicted():
    """On channel=P a residual body of one data-parallel convolution (whole channels) ends in
    another layout than its input (split channels): place() adds the merge Redistribute, which
    walk() visits, and Network.predicted_bytes holds its bytes and the body's, as the ledger."""
    from cfp.nn import Network
    from cfp.nn.containers import walk
    size = ranks_at_least_two("needs 2 ranks: on one every layout is the same placement")
    grid = ProcessGrid(f"channel={size}")
    first = Conv2d(grid, 1, 4, 3, padding=1, algorithm="y", input_whole=True, need_dx=False, name="c1",
                   dtype=np.float64)
    res = Residual(Sequential(Conv2d(grid, 4, 4, 3, padding=1, algorithm="sample", name="c2", dtype=np.float64)),
                   name="res")
    net = Network([first, res, GlobalAvgPool2d(), Linear(grid, 4, 3, algorithm="sample", name="fc", dtype=np.float64)],
                  grids=None, layers={})
    assert_all_ranks(res.merge is not None and any(m is res.merge for m in walk(net)), "the merge is walked")
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        logits = net.forward(data((3, 1, 4, 4), 8), 3)
        net.backward(np.ones_like(logits))
    predicted = net.predicted_bytes(itemsize=8)
    measured = measured_bytes(ledger)
    assert_all_ranks(predicted.get(("res.add", "redistribute"), (0, 0)) != (0, 0), f"the merge moves: {predicted}")
    assert_all_ranks(all(measured.get(k, (0, 0)) == v for k, v in predicted.items())
                     and all(k in predicted for k, v in measured.items() if v != (0, 0)),
                     f"measured {measured}, predicted {predicted}")
    grid.free()


def test_pooling_an_unsplit_image_exchanges_nothing():
    grid = ProcessGrid(f"sample={MPI.COMM_WORLD.Get_size()}")
    pool = Sequential(MaxPool2d(2))
    pool.place((grid, Layout(("sample", None, None, None))))
    x = DistTensor.from_global(data((4, 2, 4, 4), 9), Layout(("sample", None, None, None)), grid)
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        y = pool.forward(x)
        pool.backward(DistTensor(np.ones_like(y.local), y.global_shape, y.layout, grid))
    assert_all_ranks(ledger.records == [], f"pooling moved {ledger.records}")
    grid.free()


def test_placing_a_sequential_again_gives_the_same_steps():
    """A data-parallel convolution (whole channels) then a stationary-y one (split channels) on
    channel=P: place() inserts one Redistribute between them, and placing again starts afresh
    (the old one dropped, the same steps again, the last layer kept)."""
    size = ranks_at_least_two("needs 2 ranks for a Redistribute between the layers")
    grid = ProcessGrid(f"channel={size}")
    net = Sequential(Conv2d(grid, 2, 4, 3, padding=1, algorithm="sample", name="c1", dtype=np.float64),
                     Conv2d(grid, 4, 4, 3, padding=1, algorithm="y", name="c2", dtype=np.float64))
    spec = (grid, Layout(("sample", None, None, None)))
    net.place(spec)
    first = [type(m).__name__ for m in net.modules]
    net.place(spec)
    again = [type(m).__name__ for m in net.modules]
    assert_all_ranks(first == again == ["Conv2d", "Redistribute", "Conv2d"], f"{first} then {again}")
    grid.free()


def test_a_redistribute_refuses_an_input_from_elsewhere():
    size = ranks_at_least_two("needs 2 ranks for two different placements")
    from cfp.nn import Redistribute
    grid = ProcessGrid(f"sample={size}")
    by_sample, by_channel = Layout(("sample", None, None, None)), Layout((None, "sample", None, None))
    step = Redistribute((grid, by_sample), (grid, Layout.replicated(4)), name="move")
    x = DistTensor.from_global(data((size, size, 2, 2), 3), by_channel, grid)
    with pytest.raises(ValueError, match=rf"move: input on grid sample={size} with layout Layout\(-, sample, -, -\), "
                                         rf"this step moves grid sample={size} layout Layout\(sample, -, -, -\)$"):
        step.forward(x)
    grid.free()


def test_flatten_refuses_split_channels():
    size = ranks_at_least_two("needs 2 ranks to split the channels")
    grid = ProcessGrid(f"channel={size}")
    with pytest.raises(ValueError, match=r"splits the image over channel; this layer needs whole images"):
        Flatten().place((grid, Layout(("sample", "channel", None, None))))
    grid.free()


def test_loss_and_accuracy_of_one_sample_on_many_ranks_by_hand():
    """One sample, logits (0, ln 3) for 2 classes and label 1, on sample=P: the other ranks hold
    no sample. The loss is ln(1 + 3) - ln 3 and the one prediction is right."""
    import math
    size = MPI.COMM_WORLD.Get_size()
    grid = ProcessGrid(f"sample={size}")
    logits = DistTensor.from_global(np.array([[0.0, math.log(3.0)]]), Layout(("sample", None)), grid).local
    labels = np.array([1])[:len(logits)]
    loss, correct = SoftmaxCrossEntropy(grid).forward(logits, labels)
    assert_all_ranks(abs(loss - (math.log(4.0) - math.log(3.0))) < 1e-15 and correct == 1,
                     f"loss {loss}, correct {correct}")
    grid.free()
