"""cfp on device arrays (CuPy), against the same runs on NumPy.

run_suite.py runs this file in runs of its own, where `import cupy` finds a real CuPy that sees
a GPU or, on machines without one (CI), tests/standin's strict stand-in: arrays that are not
NumPy arrays, refuse NumPy functions and mixing with host arrays, and count every transfer and
every value read back (its docstring). On the stand-in the numbers are NumPy's, so a device run
must give the NumPy run's results to rounding (1e-12; in practice bit for bit), move nothing
between host and device but what comm.py stages for MPI (the ledger's staged bytes), the batch
and the loss, and read no value back inside a layer.
"""
import os

import cupy
import numpy as np
import pytest
from mpi4py import MPI

from cfp import backend, comm as C
from cfp.grid import ProcessGrid
from cfp.kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward, conv2d_output_shape
from cfp.kernels.pool import avg_pool2d_backward, avg_pool2d_forward, max_pool2d_backward, max_pool2d_forward
from cfp.algorithms import make_conv
from cfp.tensor import DistTensor, Layout
from cfp.train import TrainConfig, train, train_model, train_step
from conftest import SIZE, WORLD, assert_all_ranks, assert_close_all_ranks, grid_specs, raises_on_all_ranks

STANDIN = getattr(cupy, "__standin__", False)
KIND = os.environ.get("CFP_DEVICE_TESTS", "stand-in")
# The stand-in's numbers are NumPy's: equal to rounding (bit for bit in practice). A GPU's BLAS
# and reduction orders differ from the CPU's: float64 then agrees to about 1e-13 per pass.
TOL = 1e-12 if STANDIN else 1e-10
TRAIN_TOL = 1e-12 if STANDIN else 1e-9


def dev(a):
    return cupy.asarray(a)


def host(a):
    return None if a is None else backend.to_host(a)


def assert_same(got, expected, what, tol=TOL):
    got = host(got)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, got.dtype)
    scale = max(float(np.abs(expected).max()), 1.0) if expected.size else 1.0
    err = float(np.abs(got - expected).max()) / scale if expected.size else 0.0
    assert err <= tol, f"{what}: device result differs from NumPy's by {err:.3g} (relative)"


class Transfers:
    """The stand-in's counts over a block: bytes each way and values read back (syncs)."""

    def __enter__(self):
        self.before = cupy.stats.snapshot() if STANDIN else None
        return self

    def __exit__(self, *exc):
        if STANDIN:
            after = cupy.stats.snapshot()
            self.counts = {k: after[k] - self.before[k] for k in after}


def staged(ledger):
    """(bytes to the host, bytes to the device) the ledger says comm.py staged."""
    return (sum(r.staged_to_host for r in ledger.records), sum(r.staged_to_device for r in ledger.records))


# ---- the stand-in itself, and the device switch (serial) ---------------------------------------

@pytest.mark.skipif(not STANDIN, reason="checks the stand-in's own rules")
def test_the_stand_in_is_strict():
    a = dev(np.arange(6.0).reshape(2, 3))
    for bad in (lambda: np.asarray(a), lambda: np.sqrt(a), lambda: np.concatenate([a, a]), lambda: a + np.ones(3),
                lambda: np.ones(3) + a, lambda: np.may_share_memory(a, a)):
        with pytest.raises(TypeError):
            bad()
    total = a.sum()
    assert isinstance(total, cupy.ndarray) and total.ndim == 0  # reductions stay on the device
    with Transfers() as t:
        float(total)
        a.get()
        dev(np.zeros(4))
    assert t.counts["syncs"] == 1 and t.counts["to_host"] == 2 and t.counts["to_device_bytes"] == 32
    assert not hasattr(a, "__cuda_array_interface__") and not hasattr(a, "__dlpack__")
    with pytest.raises(TypeError):
        memoryview(a)  # no buffer: MPI cannot read it, cfp must stage


def test_device_switch():
    xp, where = backend.use_device("gpu", MPI.COMM_SELF)
    assert xp is cupy and where["device"] == "gpu" and 0 <= where["index"] < where["count"]
    assert backend.array_module("cpu") is np
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        backend.array_module("tpu")


@pytest.mark.skipif(not STANDIN, reason="the stand-in's device count is set by CFP_STANDIN_DEVICES")
def test_no_gpu_is_one_clear_message(monkeypatch):
    monkeypatch.setenv("CFP_STANDIN_DEVICES", "0")
    with pytest.raises(ValueError, match="CuPy finds no usable GPU here"):
        backend.array_module("gpu")


# ---- kernels (serial): every path of the kernel table on device arrays --------------------------

KERNEL_CASES = {  # N, C, F, H, W, K, options: the Winograd, im2col, pointwise, depthwise, dilated paths
    "winograd-3x3": (2, 8, 6, 12, 10, 3, {"padding": 1}),
    "im2col-5x5-s2": (2, 3, 4, 11, 9, 5, {"stride": 2, "padding": 2}),
    "pointwise": (3, 6, 5, 5, 4, 1, {}),
    "pointwise-s2": (2, 4, 3, 6, 6, 1, {"stride": 2}),
    "depthwise": (2, 6, 6, 9, 8, 3, {"padding": 1, "groups": 6}),
    "grouped": (2, 4, 6, 7, 6, 3, {"padding": 1, "groups": 2}),
    "dilated": (2, 3, 4, 10, 9, 3, {"padding": 2, "dilation": 2}),
    "reflect": (2, 3, 4, 7, 6, 3, {"padding": 1, "padding_mode": "reflect"}),
    "circular-same": (1, 2, 3, 7, 7, 4, {"padding": "same", "padding_mode": "circular"}),
    "one-sample-large": (1, 2, 4, 40, 36, 3, {"padding": 1}),
}


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_kernels_on_device_equal_numpy(name):
    N, Cin, F, H, W, K, opts = KERNEL_CASES[name]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, Cin, H, W))
    w = rng.standard_normal((F, Cin // opts.get("groups", 1), K, K))
    b = rng.standard_normal(F)
    y = conv2d_forward(x, w, b, **opts)
    dy = rng.standard_normal(y.shape)
    expected = (y, conv2d_backward_data(dy, w, x.shape, **opts), conv2d_backward_filter(x, dy, w.shape, **opts))
    for _ in range(2):  # the second call: the transforms and index arrays are cached per device
        with Transfers() as t:
            got = (conv2d_forward(dev(x), dev(w), dev(b), **opts), conv2d_backward_data(dev(dy), dev(w), x.shape, **opts),
                   conv2d_backward_filter(dev(x), dev(dy), w.shape, **opts))
    for what, g, e in zip(("y", "dx", "dw"), got, expected):
        assert isinstance(g, cupy.ndarray), what
        assert_same(g, e, f"{name} {what}")
    if STANDIN:  # the inputs only, then nothing: no value read back, no index array copied again
        inputs = sum(a.nbytes for a in (x, w, b, dy, w, x, dy))
        assert t.counts["syncs"] == 0 and t.counts["to_host"] == 0, t.counts
        assert t.counts["to_device_bytes"] == inputs, (t.counts, inputs)


@pytest.mark.parametrize("winograd", [False, True])
def test_a_volume_on_device_equals_numpy(winograd, monkeypatch):
    """conv3d's passes on device arrays: stacked planes, and (Winograd taken) the planes read
    where they lie, each plane's tiles transformed once (kernels/conv/volume.py)."""
    from cfp.kernels import settings
    from cfp.kernels.conv import conv3d_backward_data, conv3d_backward_filter, conv3d_forward, volume
    monkeypatch.setattr(volume, "RING_PIXELS", 0)  # the ring on these small planes too
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((2, 3, 6, 7, 6)), rng.standard_normal((3, 3, 3, 3, 3)), rng.standard_normal(3)
    opts = {"padding": 1}
    with settings.winograd(winograd, tile=4 if winograd else None):
        v = volume.volume_geometry(x.shape, w.shape, **opts)
        assert all(volume._in_place(v, p, "float64") == winograd for p in ("forward", "backward-data", "backward-filter"))
        y = conv3d_forward(x, w, b, **opts)
        dy = rng.standard_normal(y.shape)
        expected = (y, conv3d_backward_data(dy, w, x.shape, **opts), conv3d_backward_filter(x, dy, w.shape, **opts))
        got = (conv3d_forward(dev(x), dev(w), dev(b), **opts), conv3d_backward_data(dev(dy), dev(w), x.shape, **opts),
               conv3d_backward_filter(dev(x), dev(dy), w.shape, **opts))
    for what, g, e in zip(("y", "dx", "dw"), got, expected):
        assert isinstance(g, cupy.ndarray), what
        assert_same(g, e, f"volume {what}")


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_on_device_equals_numpy(kind):
    x = np.random.default_rng(2).standard_normal((2, 3, 9, 8))
    if kind == "max":
        y, arg = max_pool2d_forward(x, 3, 2, 1)
        dy = np.random.default_rng(3).standard_normal(y.shape)
        dx = max_pool2d_backward(dy, arg, x.shape, 3, 2, 1)
        y_d, arg_d = max_pool2d_forward(dev(x), 3, 2, 1)
        dx_d = max_pool2d_backward(dev(dy), arg_d, x.shape, 3, 2, 1)
    else:
        y = avg_pool2d_forward(x, 3, 2, 1)
        dy = np.random.default_rng(3).standard_normal(y.shape)
        dx = avg_pool2d_backward(dy, x.shape, 3, 2, 1)
        y_d, dx_d = avg_pool2d_forward(dev(x), 3, 2, 1), avg_pool2d_backward(dev(dy), x.shape, 3, 2, 1)
    assert_same(y_d, y, f"{kind} pool y")
    assert_same(dx_d, dx, f"{kind} pool dx")


def test_augment_batch_on_the_device():
    from cfp.data import augment_batch
    x = np.random.default_rng(1).standard_normal((4, 2, 5, 5)).astype(np.float32)
    offsets, flips = np.array([[0, 8], [4, 4], [2, 7], [8, 1]]), np.array([True, False, True, False])
    out = augment_batch(dev(x), offsets, flips)
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float32
    np.testing.assert_array_equal(host(out), augment_batch(x, offsets, flips))


# ---- the algorithms on every grid kind (MPI) ----------------------------------------------------

SPLIT = Layout(("sample", "channel", None, None))
WHOLE = Layout(("sample", None, None, None))


def _specs():
    specs = list(grid_specs())
    if SIZE > 1:
        specs.append(f"sample=1,height={SIZE},width=1,channel=1")
    if SIZE == 4:
        specs += ["sample=1,height=2,width=2,channel=1", "sample=1,height=2,width=1,channel=2"]
    return specs


def _configs():
    out = []
    for spec in _specs():
        P_c = int(spec.split("channel=")[1])
        out += [(spec, alg, None) for alg in ("sample", "x", "y")]
        out += [(spec, "w", p_f) for p_f in range(1, P_c + 1) if P_c % p_f == 0]
    return out


LAYER_CASES = {  # N, C, F, H, W, K, options, first layer (input whole over the channel axis)
    "k3": (4, 5, 6, 8, 7, 3, {"padding": 1}, False),
    "k5-s2-reflect": (2, 3, 7, 9, 8, 5, {"padding": 2, "stride": 2, "padding_mode": "reflect"}, False),
    "first": (4, 3, 6, 8, 8, 3, {"padding": 1}, True),
}


@pytest.fixture(scope="module")
def grids():
    made = {spec: ProcessGrid(spec) for spec in _specs()}
    yield made
    for g in made.values():
        g.free()


def _run_layer(grid, alg, p_f, case, xp, chunks=1):
    N, Cin, F, H, W, K, opts, first = case
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((N, Cin, H, W)), rng.standard_normal((F, Cin, K, K)), rng.standard_normal(F)
    conv = make_conv(alg, grid, Cin, F, K, filter_groups=p_f, input_whole=first, need_dx=not first, layer="conv",
                     chunks=chunks, **opts)
    dy = rng.standard_normal(conv2d_output_shape(x.shape, w.shape, **opts))
    in_layout, out_layout = conv.input_layout, conv.output_layout
    x_local = backend.from_host(DistTensor.from_global(x, in_layout, grid).local, xp)
    dy_local = backend.from_host(DistTensor.from_global(dy, out_layout, grid).local, xp)
    w_shard = backend.from_host(conv.shard_weight(w), xp)
    b_shard = backend.from_host(conv.shard_bias(b), xp)
    results = None
    for _ in range(2):  # the second run is counted: what is cached per device is made by then
        ledger = C.CommLedger()
        with Transfers() as t, C.use_ledger(ledger):
            y = conv.forward(x_local, w_shard, b_shard, input_shape=x.shape)
            dx, dw, db = conv.backward(dy_local)
        results = [host(a) for a in (y, dx, dw, db)]
    return results, ledger, t


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(LAYER_CASES))
@pytest.mark.parametrize("config", _configs(), ids=lambda c: f"{c[0]}-{c[1]}" + (f"-pf{c[2]}" if c[2] else ""))
def test_algorithms_on_device_equal_numpy(grids, config, name):
    spec, alg, p_f = config
    grid = grids[spec]
    case = LAYER_CASES[name]
    expected, numpy_ledger, _ = _run_layer(grid, alg, p_f, case, np)
    got, ledger, t = _run_layer(grid, alg, p_f, case, cupy)
    for what, g, e in zip(("y", "dx", "dw", "db"), got, expected):
        if e is None:
            assert_all_ranks(g is None, f"{spec} {alg} {name}: {what} is None on NumPy only")
            continue
        ok = g.shape == e.shape and float(np.abs(g - e).max(initial=0)) <= TOL * max(1.0, float(np.abs(e).max(initial=0)))
        assert_all_ranks(ok, f"{spec} {alg} {name}: {what} on the device differs from NumPy's")
    same_bytes = [(r.phase, r.collective, r.bytes_sent, r.bytes_received) for r in ledger.records] == \
        [(r.phase, r.collective, r.bytes_sent, r.bytes_received) for r in numpy_ledger.records]
    assert_all_ranks(same_bytes, f"{spec} {alg} {name}: the device run's messages differ from NumPy's")
    assert_all_ranks(staged(numpy_ledger) == (0, 0), "NumPy arrays are never staged")
    if STANDIN:
        moved = (t.counts["to_host_bytes"], t.counts["to_device_bytes"])
        assert_all_ranks(t.counts["syncs"] == 0, f"{spec} {alg} {name}: {t.counts['syncs']} value(s) read back "
                                                 f"inside the layer")
        assert_all_ranks(moved == staged(ledger), f"{spec} {alg} {name}: the stand-in saw {moved} bytes (to host, "
                                                  f"to device), the ledger staged {staged(ledger)}")


@pytest.mark.mpi
@pytest.mark.skipif(SIZE < 2, reason="a halo needs two ranks along height")
def test_a_halo_stages_only_its_rows():
    """A 5x5 convolution (a 2-row halo) of a block of 64 rows per rank: the halo phase stages
    the 2 rows each neighbour needs, not the block."""
    grid = ProcessGrid(f"sample=1,height={SIZE},width=1,channel=1")
    N, Cin, F, H, W = 1, 4, 3, 64 * SIZE, 32
    conv = make_conv("sample", grid, Cin, F, 5, padding=2, bias=False, layer="conv")
    x = np.random.default_rng(5).standard_normal((N, Cin, H, W))
    w = np.random.default_rng(6).standard_normal((F, Cin, 5, 5))
    x_local = dev(DistTensor.from_global(x, conv.input_layout, grid).local)
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        y = conv.forward(x_local, dev(conv.shard_weight(w)), None, input_shape=x.shape)
    halo = [r for r in ledger.records if r.phase == "halo"]
    c = grid.coord("height")
    neighbours = (c > 0) + (c < SIZE - 1)
    row = N * Cin * W * 8
    ok = sum(r.staged_to_host for r in halo) == 2 * row * neighbours and \
        sum(r.staged_to_device for r in halo) == 2 * row * neighbours
    assert_all_ranks(ok, f"halo staged {[(r.staged_to_host, r.staged_to_device) for r in halo]}, expected "
                         f"{2 * neighbours} rows of {row} bytes each way (the block is {x_local.nbytes} bytes)")
    assert_same(y, conv2d_forward(x, w, None, padding=2)[:, :, c * 64:(c + 1) * 64], "halo conv y")
    grid.free()


# ---- training (MPI) -----------------------------------------------------------------------------

STEPS, BATCH = 20, 16


def config(**overrides):
    base = dict(model="resnet", width=1, epochs=1, batch_size=BATCH, lr=0.05, dtype="float64",
                train_samples=STEPS * BATCH, max_steps=STEPS, progress=False, seed=3)
    base.update(overrides)
    return TrainConfig(**base)


def _trained(cfg, world=None):
    result, model = train_model(cfg, world)
    out = {p.name: host(p.tensor().gather()) for p in model.parameters()}
    model.free()
    return [h["loss"] for h in result["history"]], out


def assert_trains_alike(cfg, what, tol=TRAIN_TOL):
    losses0, weights0 = _trained(cfg)
    cfg.device = "gpu"
    losses, weights = _trained(cfg)
    assert_close_all_ranks(np.array(losses), np.array(losses0), tol, f"{what}: losses")
    for key in weights0:
        assert_close_all_ranks(weights[key], weights0[key], tol, f"{what}: {key}")


# every algorithm on the grid where it communicates most (sample on sample=P, x, y, w on
# channel=P), and w on a 2-D grid where there is one; the layers on every grid are above
TRAIN_CASES = [(grid_specs()[0], "sample")] + [(grid_specs()[-1], alg) for alg in ("x", "y", "w")] + \
    [(spec, "w") for spec in grid_specs()[1:-1]]


@pytest.mark.mpi
@pytest.mark.parametrize("spec,algorithm", TRAIN_CASES)
def test_training_on_device_equals_numpy(spec, algorithm):
    assert_trains_alike(config(grid=spec, algorithm=algorithm), f"{spec} {algorithm}")


@pytest.mark.mpi
def test_mobile_model_and_a_mixed_plan_on_device_equal_numpy():
    """The depthwise, dilated and grouped stack on the squarest grid, and the planner's
    per-layer plan (grids and algorithms mixed, redistributions between them)."""
    spec = grid_specs()[len(grid_specs()) // 2]
    assert_trains_alike(config(model="mobile", grid=spec, algorithm="w", max_steps=8), f"mobile {spec}")
    assert_trains_alike(config(algorithm="auto", profile="cpu-dev", max_steps=8), "auto plan")


@pytest.mark.mpi
@pytest.mark.skipif(SIZE < 2, reason="a spatial grid needs two ranks")
def test_training_on_a_spatial_grid_on_device_equals_numpy():
    spec = f"sample=1,height={SIZE}" if SIZE < 4 else "sample=1,height=2,channel=2"
    assert_trains_alike(config(grid=spec, algorithm="y", upsample=2, max_steps=6), f"spatial {spec}")


@pytest.mark.mpi
def test_checkpoints_move_between_device_and_numpy(mpi_tmp_path):
    """Saved on device ranks, resumed on NumPy ranks of another grid (and the other way): the
    losses after the resumption equal an uninterrupted NumPy run's."""
    specs = (grid_specs()[-1], grid_specs()[0])  # channel=P and sample=P (the same at one rank)
    per_epoch, stop = 6, 4
    common = dict(train_samples=per_epoch * BATCH, algorithm="w", epochs=2, max_steps=None)
    full = [h["loss"] for h in train(config(grid=specs[0], **common))["history"]]
    for first, second in (("gpu", "cpu"), ("cpu", "gpu")):
        directory = str(mpi_tmp_path / f"ckpt-{first}")
        train(config(grid=specs[0], checkpoint_dir=directory, device=first, **dict(common, max_steps=stop)))
        WORLD.Barrier()
        resumed = train(config(grid=specs[1], checkpoint_dir=directory, resume=True, device=second, **common))
        assert_close_all_ranks(np.array([h["loss"] for h in resumed["history"]]), np.array(full), TRAIN_TOL,
                               f"saved on {first}, resumed on {second}")


@pytest.mark.mpi
@pytest.mark.skipif(not STANDIN, reason="counts the stand-in's transfers")
def test_a_training_step_moves_what_the_staging_policy_says():
    """Inside a training step (the batch already on the device): the bytes to the host are the
    ledger's staged bytes plus the loss read (3 float64), the bytes to the device the ledger's
    staged bytes; no value is read back anywhere else."""
    from cfp.nn import SoftmaxCrossEntropy
    from cfp.optim import SGD
    from cfp.grid import Grids
    from cfp.models import build_model
    for spec, alg in ((grid_specs()[-1], "y"), (grid_specs()[0], "w")):
        base = ProcessGrid(spec)
        model = build_model("resnet", base, grids=Grids(base, owns_base=True), width=1, algorithm=alg,
                            in_channels=1, classes=10, seed=0, dtype=np.float64, image=8).to(cupy)
        optimizer, loss_fn = SGD(model.parameters(), lr=0.1, momentum=0.9), SoftmaxCrossEntropy(model.grid)
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((8, 1, 8, 8)), rng.integers(0, 10, 8)
        grid, layout = model.input_spec
        rows = layout.indices((8, 1, 1, 1), grid, grid.coords)[0]
        x_local, y_local = dev(x[rows.start:rows.stop]), dev(y[rows.start:rows.stop])
        for step in range(2):  # the second step is counted (the momentum buffers exist by then)
            ledger = C.CommLedger()
            with Transfers() as t, C.use_ledger(ledger):
                train_step(model, loss_fn, optimizer, x_local, y_local)
        to_host, to_device = staged(ledger)
        got = (t.counts["to_host_bytes"], t.counts["to_device_bytes"], t.counts["syncs"])
        assert_all_ranks(got == (to_host + 3 * 8, to_device, 0),
                         f"{spec} {alg}: the step moved {got[:2]} bytes and read {got[2]} value(s); the ledger "
                         f"staged {(to_host, to_device)}, plus the loss read of 24 bytes")
        model.free()


@pytest.mark.mpi
def test_device_gpu_without_a_gpu_is_refused_on_every_rank(monkeypatch):
    if not STANDIN:
        pytest.skip("needs the stand-in's device count")
    monkeypatch.setenv("CFP_STANDIN_DEVICES", "0")
    raises_on_all_ranks(ValueError, lambda: train(config(device="gpu", max_steps=1)), match="no usable GPU")


@pytest.mark.mpi
@pytest.mark.skipif(not STANDIN, reason="the stand-in's arrays expose no __cuda_array_interface__")
def test_cuda_aware_forced_where_mpi_cannot_read_device_buffers_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("CFP_CUDA_AWARE", "1")
    raises_on_all_ranks(ValueError, lambda: train(config(device="gpu", max_steps=1)),
                        match="CFP_CUDA_AWARE=1, but this CuPy's arrays expose no __cuda_array_interface__")
    monkeypatch.setenv("CFP_CUDA_AWARE", "0")
    aware, why = backend.device_buffers_to_mpi(cupy)
    assert not aware and why == "CFP_CUDA_AWARE=0"


@pytest.mark.mpi
def test_a_traced_layer_on_the_device_runs_as_explained():
    """explain.py --trace --device gpu: every collective as the explanation says, every block
    equal to the serial tensors there."""
    from cfp.explain import trace_layer
    for spec, algorithm in ((grid_specs()[-1], "w"), (grid_specs()[0], "x")):
        trace = trace_layer(WORLD, x_shape=(4, 6, 6, 6), out_channels=4, kernel_size=3, algorithm=algorithm,
                            grid=spec, padding=1, xp=cupy)
        problems = WORLD.bcast(list(trace.mismatches) if trace is not None else None, root=0)
        assert_all_ranks(not problems, f"{spec} {algorithm}: the traced run differs from its explanation: {problems}")


@pytest.mark.mpi
@pytest.mark.parametrize("pool", ["max", "avg"])
def test_pooling_and_flatten_on_split_images_on_the_device(grids, pool):
    """Max and average pooling with their halos on every spatial grid above (layers no model
    here uses on a split image), then Flatten where the image is whole: the device run equals
    the NumPy run, forward and backward, and reads nothing back."""
    from cfp.nn import AvgPool2d, Flatten, MaxPool2d, Sequential
    rng = np.random.default_rng(8)
    x, dy = rng.standard_normal((2, 3, 8, 9)), rng.standard_normal((2, 3, 8, 9))
    for spec in _specs():
        grid = grids[spec]
        layout = Layout(tuple(a if grid.axis_size(a) > 1 or a == "sample" else None
                              for a in ("sample", "channel", "height", "width")))
        results = []
        for xp in (np, cupy):
            model = Sequential((MaxPool2d if pool == "max" else AvgPool2d)(3, 1, 1))
            model.place((grid, layout))
            x_in = DistTensor(backend.from_host(DistTensor.from_global(x, layout, grid).local, xp), x.shape, layout, grid)
            dy_in = DistTensor(backend.from_host(DistTensor.from_global(dy, layout, grid).local, xp), x.shape, layout,
                               grid)
            with Transfers() as t:
                out, back = model.forward(x_in), model.backward(dy_in)
            results.append((host(out.local), host(back.local)))
            if xp is cupy and STANDIN:
                assert_all_ranks(t.counts["syncs"] == 0, f"{pool} {spec}: a value read back")
        (y0, dx0), (y1, dx1) = results
        assert_all_ranks(np.array_equal(y0, y1) and np.array_equal(dx0, dx1), f"{pool} {spec}: device != NumPy")
    flat = Flatten()
    a = dev(x)
    assert_same(flat.backward(flat.forward(a)), x, "flatten round trip")
