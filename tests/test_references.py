"""cfp against references that share none of its code, where the other tests compare cfp with
cfp: the distributed batch norm, loss and initialisation with numbers worked out by hand here
(closed forms of small integer data), finite differences, and PyTorch where it is installed
(each PyTorch test has a by-hand twin, so a run without PyTorch still checks); and the learning
rate of a training run, from its --log, against the schedule's closed form.

A bug that sits in both the serial and the distributed code (the running variance divided by n
instead of n - 1, a schedule that never steps) passes every comparison of one with the other;
it fails these.
"""
import json
import math

import numpy as np
import pytest
from mpi4py import MPI

from cfp import backend
from cfp.grid import ProcessGrid
from cfp.nn import BatchNorm2d, Conv2d, Linear, SoftmaxCrossEntropy
from cfp.optim import Optimizer
from cfp.tensor import DistTensor, Layout
from cfp.train import TrainConfig, train
from conftest import IMAGE_AXES, assert_all_ranks, assert_close_all_ranks, grid_specs, raises_on_all_ranks, rel_err
from test_kernels_conv import numerical_gradient


def gathered(p, what="grad"):
    """The global array of a parameter's gradient (or data) from every rank's shard."""
    return backend.to_host(p.tensor(getattr(p, what)).gather())


def serial_grid():
    return ProcessGrid("sample=1", comm=MPI.COMM_SELF)


# ------------------------------------------------------------------ batch norm, by hand
#
# Channel c of a batch holds a_c * k + b_c for k = 0, 1, ..., n - 1 in a shuffled order, so its
# statistics have closed forms: mean b_c + a_c (n - 1) / 2, biased variance a_c^2 (n^2 - 1) / 12
# (what training normalises with) and unbiased variance a_c^2 n (n + 1) / 12 (what the running
# variance averages, as PyTorch's BatchNorm2d). With momentum m, running = (1 - m) running + m
# batch, from running_mean 0 and running_var 1.

BN_SHAPE = (4, 4, 4, 3)  # N, C, H, W: n = 48 values per channel
BN_N = BN_SHAPE[0] * BN_SHAPE[2] * BN_SHAPE[3]
MOMENTUM, EPS = 0.3, 1e-5
GAMMA, BETA = np.array([1.5, 0.5, 2.0, 1.0]), np.array([0.1, -0.2, 0.3, 0.0])
BATCHES = [(np.array([1.0, 2.0, 0.5, 3.0]), np.array([0.0, -1.0, 4.0, 2.0])),  # (a_c, b_c) of each
           (np.array([0.5, 1.0, 2.0, 1.5]), np.array([1.0, 0.0, -2.0, 3.0]))]


def integer_batch(seed):
    """k: (N, C, H, W), every channel a shuffled 0, 1, ..., n - 1."""
    rng = np.random.default_rng(seed)
    N, C, H, W = BN_SHAPE
    k = np.stack([rng.permutation(BN_N).reshape(N, H, W) for _ in range(C)], axis=1)
    return k.astype(np.float64)


def per_channel(v):
    return np.asarray(v).reshape(1, -1, 1, 1)


def bn_by_hand():
    """[(x, x_hat, y) of each training batch], the running (mean, var) after each, all by hand."""
    n = BN_N
    running_mean, running_var = np.zeros(4), np.ones(4)
    batches, running = [], []
    for seed, (a, b) in enumerate(BATCHES):
        k = integer_batch(seed)
        x = per_channel(a) * k + per_channel(b)
        mean, biased, unbiased = b + a * (n - 1) / 2, a ** 2 * (n * n - 1) / 12, a ** 2 * n * (n + 1) / 12
        x_hat = per_channel(a) * (k - (n - 1) / 2) / np.sqrt(per_channel(biased) + EPS)
        batches.append((x, x_hat, per_channel(GAMMA) * x_hat + per_channel(BETA)))
        running_mean = (1 - MOMENTUM) * running_mean + MOMENTUM * mean
        running_var = (1 - MOMENTUM) * running_var + MOMENTUM * unbiased
        running.append((running_mean, running_var))
    return batches, running


BN_SPECS = grid_specs(4, IMAGE_AXES)
BN_LAYOUT = Layout(("sample", "channel", "height", "width"))


@pytest.mark.mpi
def test_batchnorm_refuses_a_layout_that_leaves_copies():
    """An image's batch norm on a grid that splits depth (whose ranks would hold copies of
    each block) is refused, not summed twice."""
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank splits nothing")
    grid = ProcessGrid(f"depth={MPI.COMM_WORLD.Get_size()}")
    raises_on_all_ranks(ValueError, lambda: BatchNorm2d(grid, 4, layout=Layout(("sample", None, None, None))),
                        match=r"leaves the depth axis holding copies of each block")
    grid.free()


@pytest.mark.mpi
@pytest.mark.parametrize("spec", BN_SPECS)
def test_batchnorm_statistics_and_running_averages_by_hand(spec):
    """On every grid of sample x height x width x channel: the output of two training batches,
    the gradients of gamma and beta, the running mean and the unbiased running variance after
    each batch, then the eval-mode output, against the closed forms above."""
    grid = ProcessGrid(spec)
    bn = BatchNorm2d(grid, 4, layout=BN_LAYOUT, eps=EPS, momentum=MOMENTUM, dtype=np.float64)
    bn.weight.data, bn.bias.data = bn.weight.take(GAMMA), bn.bias.take(BETA)
    batches, running = bn_by_hand()
    dy = np.random.default_rng(5).standard_normal(BN_SHAPE)
    dy_local = DistTensor.from_global(dy, BN_LAYOUT, grid).local
    for i, ((x, x_hat, y), (running_mean, running_var)) in enumerate(zip(batches, running)):
        y_local = bn.forward(DistTensor.from_global(x, BN_LAYOUT, grid).local)
        bn.backward(dy_local)
        assert_close_all_ranks(DistTensor(y_local, BN_SHAPE, BN_LAYOUT, grid).gather(), y, 1e-12, f"batch {i} y")
        assert_close_all_ranks(gathered(bn.bias), dy.sum(axis=(0, 2, 3)), 1e-12, f"batch {i} dbeta")
        assert_close_all_ranks(gathered(bn.weight), (dy * x_hat).sum(axis=(0, 2, 3)), 1e-12,
                               f"batch {i} dgamma")
        assert_close_all_ranks(gathered(bn.running_mean, "data"), running_mean, 1e-12,
                               f"running mean after batch {i}")
        assert_close_all_ranks(gathered(bn.running_var, "data"), running_var, 1e-12,
                               f"running variance after batch {i} (unbiased: n / (n - 1) times the batch's)")
    bn.eval()
    x = batches[0][0]
    mean, var = (per_channel(v) for v in running[-1])
    y_local = bn.forward(DistTensor.from_global(x, BN_LAYOUT, grid).local)
    assert_close_all_ranks(DistTensor(y_local, BN_SHAPE, BN_LAYOUT, grid).gather(),
                           per_channel(GAMMA) * (x - mean) / np.sqrt(var + EPS) + per_channel(BETA), 1e-12,
                           "eval y (running statistics)")
    grid.free()


def test_batchnorm_gradients_by_finite_differences():
    """Training-mode gradients of L = sum(y * dy) with respect to x, gamma and beta against
    central differences of the forward pass (step 1e-6, float64)."""
    grid = serial_grid()
    rng = np.random.default_rng(6)
    x, dy = rng.standard_normal((3, 2, 2, 3)) * 2 + 1, rng.standard_normal((3, 2, 2, 3))
    bn = BatchNorm2d(grid, 2, eps=EPS, dtype=np.float64)
    bn.weight.data, bn.bias.data = np.array([1.5, -0.7]), np.array([0.2, 0.4])
    bn.forward(x)
    dx = bn.backward(dy)
    analytic = {"x": dx, "gamma": bn.weight.grad, "beta": bn.bias.grad}

    def loss():
        return float((bn.forward(x) * dy).sum())

    for name, array in (("x", x), ("gamma", bn.weight.data), ("beta", bn.bias.data)):
        assert rel_err(analytic[name], numerical_gradient(array, loss)) < 1e-7, name
    grid.free()


def test_batchnorm_matches_torch():
    """Two training batches (output, input and parameter gradients, running mean and variance),
    then eval mode, against torch.nn.BatchNorm2d in float64."""
    torch = pytest.importorskip("torch")
    grid = serial_grid()
    C = 3
    bn = BatchNorm2d(grid, C, eps=EPS, momentum=MOMENTUM, dtype=np.float64)
    reference = torch.nn.BatchNorm2d(C, eps=EPS, momentum=MOMENTUM, dtype=torch.float64)
    gamma, beta = np.array([1.5, 0.5, -2.0]), np.array([0.1, -0.2, 0.3])
    bn.weight.data, bn.bias.data = gamma.copy(), beta.copy()
    with torch.no_grad():
        reference.weight.copy_(torch.tensor(gamma))
        reference.bias.copy_(torch.tensor(beta))
    rng = np.random.default_rng(7)
    for i, mode in enumerate(("train", "train", "eval")):
        x, dy = rng.standard_normal((5, C, 3, 4)) * (i + 1) + i, rng.standard_normal((5, C, 3, 4))
        bn.train(mode == "train")
        reference.train(mode == "train")
        reference.zero_grad()
        tx = torch.tensor(x, requires_grad=True)
        ty = reference(tx)
        (ty * torch.tensor(dy)).sum().backward()
        y = bn.forward(x)
        dx = bn.backward(dy)
        assert rel_err(y, ty.detach().numpy()) < 1e-12, f"{mode} {i} y"
        assert rel_err(dx, tx.grad.numpy()) < 1e-12, f"{mode} {i} dx"
        assert rel_err(bn.weight.grad, reference.weight.grad.numpy()) < 1e-12, f"{mode} {i} dgamma"
        assert rel_err(bn.bias.grad, reference.bias.grad.numpy()) < 1e-12, f"{mode} {i} dbeta"
        assert rel_err(bn.running_mean.data, reference.running_mean.numpy()) < 1e-12, f"{mode} {i} running mean"
        assert rel_err(bn.running_var.data, reference.running_var.numpy()) < 1e-12, f"{mode} {i} running var"
    grid.free()


# ------------------------------------------------------------------ the loss, by hand
#
# Logits log(q) + s for positive q: softmax(logits) = q / sum(q) whatever the shift s, so the
# loss of a sample is log(sum(q) / q[label]) and its gradient (q / sum(q) - onehot) / N. The
# shifts of 800 and 1000 overflow exp unless the largest logit is subtracted first.

Q = np.array([[1.0, 1.0, 2.0], [1.0, 2.0, 1.0], [3.0, 1.0, 4.0], [2.0, 2.0, 4.0], [6.0, 1.0, 1.0]])
SHIFTS = np.array([1000.0, -50.0, 0.0, 3.0, 800.0])
LABELS = np.array([2, 0, 1, 2, 0])
LOSS = (math.log(2) + math.log(4) + math.log(8) + math.log(2) + math.log(8 / 6)) / 5
DLOGITS = np.array([[0.25, 0.25, -0.5], [-0.75, 0.5, 0.25], [0.375, -0.875, 0.5], [0.25, 0.25, -0.5],
                    [-0.25, 0.125, 0.125]]) / 5
CORRECT = 3  # rows 0, 3 and 4: their largest q is at the label


@pytest.mark.mpi
@pytest.mark.parametrize("spec", grid_specs())
def test_loss_is_the_mean_over_the_global_batch_by_hand(spec):
    """Five samples split over the sample axis (uneven at 2, 3 and 4 sample ranks): the loss,
    the number correct and the gradient of the logits are those of the whole batch."""
    grid = ProcessGrid(spec)
    layout = Layout(("sample", None))
    logits = DistTensor.from_global(np.log(Q) + SHIFTS[:, None], layout, grid)
    labels = DistTensor.from_global(LABELS[:, None], layout, grid).local[:, 0]
    loss_fn = SoftmaxCrossEntropy(grid)
    loss, correct = loss_fn.forward(logits.local, labels)
    dlogits = DistTensor(loss_fn.backward(), Q.shape, layout, grid).gather()
    assert_close_all_ranks(np.array([loss]), np.array([LOSS]), 1e-13, "loss")
    assert_all_ranks(correct == CORRECT, f"{correct} correct, expected {CORRECT}")
    assert_close_all_ranks(dlogits, DLOGITS, 1e-12, "dlogits")
    grid.free()


def test_loss_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    logits, labels = rng.standard_normal((7, 5)) * 3, rng.integers(0, 5, 7)
    grid = serial_grid()
    loss_fn = SoftmaxCrossEntropy(grid)
    loss, correct = loss_fn.forward(logits, labels)
    t = torch.tensor(logits, requires_grad=True)
    reference = torch.nn.functional.cross_entropy(t, torch.tensor(labels))
    reference.backward()
    assert loss == pytest.approx(reference.item(), rel=1e-14)
    assert correct == int((t.argmax(dim=1) == torch.tensor(labels)).sum())
    assert rel_err(loss_fn.backward(), t.grad.numpy()) < 1e-12
    grid.free()


# ------------------------------------------------------------------ initialisation
#
# Conv2d and Linear draw He (Kaiming) normal weights, standard deviation sqrt(2 / fan_in) with
# fan_in = C / groups * Kh * Kw, and zero biases; batch norm starts at gamma 1, beta 0, running
# mean 0 and running variance 1. The bounds are 5 standard errors of the statistic.

INIT_LAYERS = {
    "conv": (lambda g: Conv2d(g, 64, 128, 3, name="c", dtype=np.float64), 64 * 3 * 3),
    "grouped conv": (lambda g: Conv2d(g, 64, 128, 3, groups=4, name="g", dtype=np.float64), 16 * 3 * 3),
    "conv 5x3": (lambda g: Conv2d(g, 48, 40, (5, 3), name="r", dtype=np.float64), 48 * 5 * 3),
    "linear": (lambda g: Linear(g, 500, 200, name="fc", dtype=np.float64), 500),
}


@pytest.mark.parametrize("name", list(INIT_LAYERS))
def test_initialisation_by_hand(name):
    make, fan_in = INIT_LAYERS[name]
    grid = serial_grid()
    layer = make(grid)
    w = layer.weight.data.ravel()
    n, std = w.size, math.sqrt(2.0 / fan_in)
    assert abs(w.mean()) < 5 * std / math.sqrt(n)
    assert abs(w.std() / std - 1) < 5 / math.sqrt(2 * n)
    # normal, not uniform: 68.27% within one standard deviation (a uniform law has 57.7%)
    inside, p = np.mean(np.abs(w) < std), math.erf(1 / math.sqrt(2))
    assert abs(inside - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert np.array_equal(layer.bias.data, np.zeros(layer.bias.global_shape))
    bn = BatchNorm2d(grid, 6, dtype=np.float64)
    for param, value in ((bn.weight, 1), (bn.bias, 0), (bn.running_mean, 0), (bn.running_var, 1)):
        assert np.array_equal(param.data, np.full(6, float(value))), param.name
    grid.free()


@pytest.mark.parametrize("name", list(INIT_LAYERS))
def test_initialisation_matches_torch(name):
    """The standard deviation against that of torch.nn.init.kaiming_normal_ (fan_in, relu) on a
    weight of the same shape, which finds fan_in from the shape as PyTorch's layers do."""
    torch = pytest.importorskip("torch")
    make, _ = INIT_LAYERS[name]
    grid = serial_grid()
    w = make(grid).weight.data
    torch.manual_seed(0)
    reference = torch.nn.init.kaiming_normal_(torch.empty(w.shape, dtype=torch.float64), mode="fan_in",
                                              nonlinearity="relu").numpy()
    assert abs(w.std() / reference.std() - 1) < 5 / math.sqrt(w.size)
    grid.free()


# ------------------------------------------------------------------ the learning rate of a run
#
# 80 samples in batches of 8: one epoch of 10 steps, 3 of them warm-up. Warm-up ramps to the
# peak rate 0.1 as 0.1 (t + 1) / 3; after it, over the remaining 7 steps, cosine goes down half
# a cosine, step divides by 10 every 7 // 3 = 2 steps, constant stays.

PEAK, WARMUP, STEPS = 0.1, 3, 10
EXPECTED_LR = {
    "cosine": [PEAK * (t + 1) / WARMUP for t in range(WARMUP)]
              + [PEAK * (1 + math.cos(math.pi * s / 7)) / 2 for s in range(7)],
    "step": [PEAK / 3, PEAK * 2 / 3, 0.1, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001, 0.0001],
    "constant": [PEAK / 3, PEAK * 2 / 3] + [PEAK] * 8,
}


def run_config(schedule, tmp_path, **overrides):
    base = dict(model="resnet", width=1, epochs=1, batch_size=8, lr=PEAK, dtype="float64",
                train_samples=STEPS * 8, progress=False, seed=0, schedule=schedule, warmup_steps=WARMUP,
                log=str(tmp_path / "run.json"))
    base.update(overrides)
    return TrainConfig(**base)


@pytest.fixture
def applied_lr(monkeypatch):
    """The optimizer's lr at each of its steps: the rate the update used."""
    seen = []
    step = Optimizer.step

    def recording(self):
        seen.append(self.lr)
        step(self)
    monkeypatch.setattr(Optimizer, "step", recording)
    return seen


def logged_lr(tmp_path):
    with open(tmp_path / "run.json") as f:
        steps = json.load(f)["steps"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    return [s["lr"] for s in steps]


@pytest.mark.parametrize("schedule", list(EXPECTED_LR))
def test_the_logged_learning_rate_follows_the_schedule(schedule, tmp_path, applied_lr):
    """--schedule with --warmup-steps 3: the lr in the --log JSON at every step, and the lr each
    update used, are the closed form's."""
    train(run_config(schedule, tmp_path), world=MPI.COMM_SELF)
    assert logged_lr(tmp_path) == pytest.approx(EXPECTED_LR[schedule], rel=1e-13, abs=0)
    assert applied_lr == pytest.approx(EXPECTED_LR[schedule], rel=1e-13, abs=0)


def test_the_learning_rate_goes_on_across_a_resume(tmp_path, applied_lr):
    """Stopped after 5 steps and resumed from the checkpoint: the rate of steps 6 to 10 goes on
    down the cosine, and the log holds all 10."""
    directory = str(tmp_path / "ckpt")
    train(run_config("cosine", tmp_path, checkpoint_dir=directory, max_steps=5), world=MPI.COMM_SELF)
    del applied_lr[:]
    train(run_config("cosine", tmp_path, checkpoint_dir=directory, resume=True), world=MPI.COMM_SELF)
    assert applied_lr == pytest.approx(EXPECTED_LR["cosine"][5:], rel=1e-13, abs=0)
    assert logged_lr(tmp_path) == pytest.approx(EXPECTED_LR["cosine"], rel=1e-13, abs=0)


TORCH_SCHEDULES = {  # (torch schedulers after LinearLR's warm-up, or None: constant)
    "cosine": lambda lr_scheduler, o: lr_scheduler.CosineAnnealingLR(o, T_max=STEPS - WARMUP),
    "step": lambda lr_scheduler, o: lr_scheduler.StepLR(o, step_size=(STEPS - WARMUP) // 3, gamma=0.1),
    "constant": None,
}


@pytest.mark.parametrize("schedule", list(TORCH_SCHEDULES))
def test_the_logged_learning_rate_matches_torch(schedule, tmp_path):
    """The same run's logged lr against torch's LinearLR warm-up (start 1/3, reaching the peak
    at step 3) followed by CosineAnnealingLR or StepLR in a SequentialLR."""
    torch = pytest.importorskip("torch")
    lr_scheduler = torch.optim.lr_scheduler
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=1 / WARMUP, total_iters=WARMUP - 1)
    after = TORCH_SCHEDULES[schedule]
    reference = warmup if after is None else lr_scheduler.SequentialLR(
        optimizer, [warmup, after(lr_scheduler, optimizer)], milestones=[WARMUP])
    expected = []
    for _ in range(STEPS):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    train(run_config(schedule, tmp_path), world=MPI.COMM_SELF)
    assert logged_lr(tmp_path) == pytest.approx(expected, rel=1e-12, abs=0)
