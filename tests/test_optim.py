"""Optimizers and learning-rate schedules against hand-computed values and against torch.optim.

Serial tests: the optimizers do local math on shards, so one process checks all of it.
"""
import json
import math

import numpy as np
import pytest

from cfp.nn.module import Parameter
from cfp.optim import SGD, Adam, AdamW, CosineLR, LinearWarmup, StepLR

SHAPES = {"conv.weight": (4, 3, 3, 3), "conv.bias": (4,), "fc.weight": (5, 4)}
STEPS = 10


def make_params(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [Parameter(name, rng.standard_normal(shape).astype(dtype), shape)
            for name, shape in SHAPES.items()]


def gradient_sequence(steps=STEPS, seed=1):
    """steps x {name: gradient}; "conv.bias" has no gradient at steps 0 and 4 (grad None), so
    skipped parameters and per-parameter update counts are exercised too."""
    rng = np.random.default_rng(seed)
    sequence = []
    for t in range(steps):
        grads = {name: rng.standard_normal(shape) for name, shape in SHAPES.items()}
        if t in (0, 4):
            grads["conv.bias"] = None
        sequence.append(grads)
    return sequence


def run(optimizer, params, grads_sequence):
    by_name = {p.name: p for p in params}
    for grads in grads_sequence:
        optimizer.zero_grad()
        for name, g in grads.items():
            by_name[name].grad = None if g is None else g.copy()
        optimizer.step()
    return {p.name: p.data for p in params}


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ------------------------------------------------------------------ hand-computed, no torch


def one_param(value, dtype=np.float64):
    return Parameter("w", np.array([value], dtype=dtype), (1,))


def steps_with_constant_gradient(optimizer, param, gradient, steps):
    values = []
    for _ in range(steps):
        param.grad = np.array([gradient], dtype=param.data.dtype)
        optimizer.step()
        values.append(float(param.data[0]))
    return values


def test_sgd_by_hand():
    # p = 1, g = 1, lr = 0.1.
    p = one_param(1.0)
    assert steps_with_constant_gradient(SGD([p], lr=0.1), p, 1.0, 2) == pytest.approx([0.9, 0.8])
    # Momentum 0.9: buffer 1 then 1.9.
    p = one_param(1.0)
    assert steps_with_constant_gradient(SGD([p], lr=0.1, momentum=0.9), p, 1.0, 2) == \
        pytest.approx([0.9, 0.71])
    # Nesterov: steps of g + 0.9 * buffer = 1.9, then 1 + 0.9 * 1.9 = 2.71.
    p = one_param(1.0)
    assert steps_with_constant_gradient(SGD([p], lr=0.1, momentum=0.9, nesterov=True), p, 1.0, 2) \
        == pytest.approx([0.81, 0.539])
    # Weight decay 0.5 with zero gradient: p = p - 0.1 * 0.5 * p.
    p = one_param(1.0)
    assert steps_with_constant_gradient(SGD([p], lr=0.1, weight_decay=0.5), p, 0.0, 2) == \
        pytest.approx([0.95, 0.9025])
    # Dampening 0.5 leaves the first buffer at g, then b = 0.9 * 1 + 0.5 * 1 = 1.4.
    p = one_param(1.0)
    assert steps_with_constant_gradient(SGD([p], lr=0.1, momentum=0.9, dampening=0.5), p, 1.0, 2) \
        == pytest.approx([0.9, 0.76])


def test_adam_by_hand():
    # With a constant gradient the bias-corrected moments are exactly g and g^2, so with eps = 0
    # every Adam step moves the parameter by lr against the sign of the gradient.
    p = one_param(1.0)
    values = steps_with_constant_gradient(Adam([p], lr=0.01, eps=0.0), p, 3.0, 3)
    assert values == pytest.approx([0.99, 0.98, 0.97], rel=1e-14)
    # AdamW first shrinks p by (1 - lr * wd), then takes the same step.
    p = one_param(1.0)
    values = steps_with_constant_gradient(AdamW([p], lr=0.01, eps=0.0, weight_decay=0.5), p, -3.0, 2)
    first = 1.0 * (1 - 0.005) + 0.01
    assert values == pytest.approx([first, first * (1 - 0.005) + 0.01], rel=1e-14)


def test_sgd_momentum_with_weight_decay_by_hand():
    # The decay joins the gradient before the momentum buffer: p = 1, g = 1, lr 0.1, momentum 0.9,
    # weight decay 0.5. Step 1: g = 1 + 0.5 = 1.5, b = 1.5, p = 1 - 0.15 = 0.85. Step 2:
    # g = 1 + 0.5 * 0.85 = 1.425, b = 0.9 * 1.5 + 1.425 = 2.775, p = 0.85 - 0.2775 = 0.5725.
    # (Decay added after the momentum would give 0.85, then 0.6175.)
    p = one_param(1.0)
    values = steps_with_constant_gradient(SGD([p], lr=0.1, momentum=0.9, weight_decay=0.5), p, 1.0, 2)
    assert values == pytest.approx([0.85, 0.5725], rel=1e-14)
    # Nesterov with decay: step 1 g = 1.5, b = 1.5, step 1.5 + 0.9 * 1.5 = 2.85, p = 0.715;
    # step 2 g = 1 + 0.3575 = 1.3575, b = 1.35 + 1.3575 = 2.7075, step 1.3575 + 2.43675.
    p = one_param(1.0)
    values = steps_with_constant_gradient(SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.5),
                                          p, 1.0, 2)
    assert values == pytest.approx([0.715, 0.715 - 0.1 * (1.3575 + 0.9 * 2.7075)], rel=1e-14)


def test_adam_bias_correction_with_changing_gradients_by_hand():
    # Gradients 1 then -2, lr 0.1, betas (0.9, 0.999), eps 0. Step 1: m = 0.1, v = 0.001, corrected
    # 1 and 1: p = 1 - 0.1. Step 2: m = 0.09 - 0.2 = -0.11, v = 0.000999 + 0.004 = 0.004999,
    # corrected m / (1 - 0.81) and v / (1 - 0.998001).
    p = one_param(1.0)
    optimizer = Adam([p], lr=0.1, eps=0.0)
    values = []
    for g in (1.0, -2.0):
        p.grad = np.array([g])
        optimizer.step()
        values.append(float(p.data[0]))
    m_hat, v_hat = -0.11 / 0.19, 0.004999 / 0.001999
    assert values == pytest.approx([0.9, 0.9 - 0.1 * m_hat / math.sqrt(v_hat)], rel=1e-13)
    # Adam's L2 decay joins the gradient (0.5 p with g = 0); AdamW's shrinks p first. p = 1, lr 0.01.
    p = one_param(1.0)
    values = steps_with_constant_gradient(Adam([p], lr=0.01, eps=0.0, weight_decay=0.5), p, 0.0, 2)
    g2 = 0.5 * 0.99
    m, v = 0.9 * 0.05 + 0.1 * g2, 0.999 * 0.00025 + 0.001 * g2 ** 2
    assert values == pytest.approx([0.99, 0.99 - 0.01 * (m / 0.19) / math.sqrt(v / 0.001999)], rel=1e-13)


def test_update_keeps_dtype_and_array():
    for optimizer_class in (SGD, Adam):
        params = make_params(dtype=np.float32)
        arrays = [p.data for p in params]
        optimizer = optimizer_class(params, lr=0.1)
        run(optimizer, params, gradient_sequence(steps=2))
        for p, array in zip(params, arrays):
            assert p.data is array  # updated in place: layers may hold the array
            assert p.data.dtype == np.float32


def test_zero_grad_and_skipped_parameters():
    params = make_params()
    before = [p.data.copy() for p in params]
    optimizer = SGD(params, lr=0.1, momentum=0.9)
    params[0].grad = np.ones(SHAPES["conv.weight"])
    optimizer.step()
    assert not np.array_equal(params[0].data, before[0])
    assert all(np.array_equal(p.data, b) for p, b in zip(params[1:], before[1:]))
    assert set(k for k, s in optimizer.state.items() if s) == {"conv.weight"}
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)


def test_state_bytes():
    def bytes_after_one_step(optimizer, params):
        run(optimizer, params, gradient_sequence(steps=2)[1:])  # all gradients present
        return optimizer.state_bytes()

    params = make_params()
    shard_bytes = sum(p.data.nbytes for p in params)
    assert bytes_after_one_step(SGD(params, lr=0.1), params) == 0
    params = make_params()
    assert bytes_after_one_step(SGD(params, lr=0.1, momentum=0.9), params) == shard_bytes
    params = make_params()
    assert bytes_after_one_step(Adam(params), params) == 2 * shard_bytes


# ------------------------------------------------------------------ against torch.optim

CONFIGS = {
    "sgd": (lambda p: SGD(p, lr=0.1), "SGD", dict(lr=0.1)),
    "sgd-momentum": (lambda p: SGD(p, lr=0.1, momentum=0.9), "SGD", dict(lr=0.1, momentum=0.9)),
    "sgd-nesterov-wd": (lambda p: SGD(p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-2),
                        "SGD", dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-2)),
    "sgd-dampening-wd": (lambda p: SGD(p, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
                         "SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1)),
    "adam": (lambda p: Adam(p, lr=1e-2), "Adam", dict(lr=1e-2)),
    "adam-l2": (lambda p: Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
                "Adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adamw": (lambda p: AdamW(p, lr=1e-2), "AdamW", dict(lr=1e-2)),
    "adamw-wd": (lambda p: AdamW(p, lr=1e-2, weight_decay=0.3), "AdamW",
                 dict(lr=1e-2, weight_decay=0.3)),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_torch(config):
    torch = pytest.importorskip("torch")
    make_ours, torch_name, torch_kwargs = CONFIGS[config]
    params = make_params()
    grads = gradient_sequence()
    tensors = {p.name: torch.tensor(p.data.copy(), requires_grad=True) for p in params}
    reference = getattr(torch.optim, torch_name)(list(tensors.values()), **torch_kwargs)
    for step_grads in grads:
        reference.zero_grad(set_to_none=True)
        for name, g in step_grads.items():
            tensors[name].grad = None if g is None else torch.tensor(g)
        reference.step()
    ours = run(make_ours(params), params, grads)
    for name, t in tensors.items():
        assert rel_err(ours[name], t.detach().numpy()) < 1e-12, name


# ------------------------------------------------------------------ state dicts


@pytest.mark.parametrize("config", ["sgd-momentum", "sgd-nesterov-wd", "adam-l2", "adamw"])
def test_state_dict_round_trip(config):
    make = CONFIGS[config][0]
    grads = gradient_sequence()
    params = make_params()
    optimizer = make(params)
    run(optimizer, params, grads[:3])
    saved = optimizer.state_dict()
    saved_params = [p.data.copy() for p in params]
    saved_copy = {n: {b: a.copy() for b, a in s.items()} for n, s in saved["state"].items()}
    uninterrupted = run(optimizer, params, grads[3:])

    resumed_params = [Parameter(p.name, data, p.global_shape) for p, data in zip(params, saved_params)]
    resumed = make(resumed_params)
    resumed.load_state_dict(saved)
    assert resumed.step_count == 3
    result = run(resumed, resumed_params, grads[3:])
    for name in uninterrupted:
        np.testing.assert_array_equal(result[name], uninterrupted[name])
    # The snapshot did not change when the optimizer went on stepping.
    for name, buffers in saved_copy.items():
        for b, a in buffers.items():
            np.testing.assert_array_equal(saved["state"][name][b], a)


def test_state_dict_layout():
    params = make_params()
    optimizer = Adam(params, lr=0.01)
    run(optimizer, params, gradient_sequence(steps=2))
    sd = optimizer.state_dict()
    assert sd["step"] == 2 and sd["lr"] == 0.01
    assert sd["hyper"] == {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
                           "decoupled": False}
    assert sd["updates"] == {"conv.weight": 2, "conv.bias": 1, "fc.weight": 2}
    for p in params:
        assert set(sd["state"][p.name]) == {"exp_avg", "exp_avg_sq"}
        assert all(a.shape == p.data.shape for a in sd["state"][p.name].values())


def test_load_state_dict_from_json_and_npz_parts():
    # A checkpoint keeps the scalars in JSON and the arrays in .npz, leaving out parameters
    # without buffers: such a dict loads.
    params = make_params()
    optimizer = Adam(params, lr=0.01)
    run(optimizer, params, gradient_sequence(steps=1))  # conv.bias has no gradient at step 0
    sd = optimizer.state_dict()
    scalars = json.loads(json.dumps({k: v for k, v in sd.items() if k != "state"}))
    arrays = {name: buffers for name, buffers in sd["state"].items() if buffers}
    assert set(arrays) == {"conv.weight", "fc.weight"}
    resumed = Adam(make_params(), lr=0.01)
    resumed.load_state_dict({**scalars, "state": arrays})
    assert resumed.updates == sd["updates"] and resumed.state["conv.bias"] == {}
    np.testing.assert_array_equal(resumed.state["fc.weight"]["exp_avg"],
                                  sd["state"]["fc.weight"]["exp_avg"])


def test_load_state_dict_errors():
    params = make_params()
    optimizer = SGD(params, lr=0.1, momentum=0.9)
    run(optimizer, params, gradient_sequence(steps=2))
    sd = optimizer.state_dict()

    renamed = make_params()
    renamed[2].name = "head.weight"
    with pytest.raises(ValueError, match=r"missing \['head.weight'\], unknown \['fc.weight'\]"):
        SGD(renamed, lr=0.1, momentum=0.9).load_state_dict(sd)

    reshaped = make_params()
    reshaped[2] = Parameter("fc.weight", np.zeros((2, 4)), (2, 4))
    with pytest.raises(ValueError, match=r"fc.weight: momentum_buffer has shape \(5, 4\), "
                                         r"the shard has shape \(2, 4\)"):
        SGD(reshaped, lr=0.1, momentum=0.9).load_state_dict(sd)

    with pytest.raises(ValueError, match="Adam expects"):
        Adam(make_params()).load_state_dict(sd)

    no_buffer = {**sd, "state": {**sd["state"], "fc.weight": {}}}
    with pytest.raises(ValueError, match=r"fc.weight, updated 2 times: state dict has buffers "
                                         r"\[\], expected \['momentum_buffer'\]"):
        SGD(make_params(), lr=0.1, momentum=0.9).load_state_dict(no_buffer)

    unknown = {**sd, "state": {**sd["state"], "head.bias": {}}}
    with pytest.raises(ValueError, match=r"unknown parameters \['head.bias'\]"):
        SGD(make_params(), lr=0.1, momentum=0.9).load_state_dict(unknown)

    without_updates = {k: v for k, v in sd.items() if k != "updates"}
    with pytest.raises(ValueError, match=r"lacks the entries \['updates'\]"):
        SGD(make_params(), lr=0.1, momentum=0.9).load_state_dict(without_updates)


# ------------------------------------------------------------------ bad hyperparameters

BAD = [
    (lambda p: SGD(p, lr=-0.1), "learning rate must be >= 0.0, got -0.1"),
    (lambda p: SGD(p, lr=0.1, momentum=-0.5), "momentum must be >= 0.0, got -0.5"),
    (lambda p: SGD(p, lr=0.1, weight_decay=-1.0), "weight_decay must be >= 0.0, got -1.0"),
    (lambda p: SGD(p, lr=0.1, nesterov=True), "momentum=0.0"),
    (lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True, dampening=0.1), "dampening=0.1"),
    (lambda p: Adam(p, lr=-1.0), "Adam learning rate must be >= 0.0, got -1.0"),
    (lambda p: Adam(p, betas=(1.0, 0.999)), r"beta1 must be in \[0, 1\), got 1.0"),
    (lambda p: AdamW(p, betas=(0.9, -0.1)), r"AdamW beta2 must be in \[0, 1\), got -0.1"),
    (lambda p: Adam(p, eps=-1e-8), "eps must be >= 0.0, got -1e-08"),
    (lambda p: SGD(p + p[:1], lr=0.1), r"repeated: \['conv.weight'\]"),
    (lambda p: StepLR(SGD(p, lr=0.1), step_size=0), "step_size must be an integer >= 1, got 0"),
    (lambda p: StepLR(SGD(p, lr=0.1), step_size=2, gamma=0.0), "gamma must be > 0, got 0.0"),
    (lambda p: CosineLR(SGD(p, lr=0.1), total_steps=0), "total_steps .* got 0"),
    (lambda p: CosineLR(SGD(p, lr=0.1), 10, min_lr=-1.0), "min_lr must be >= 0.0, got -1.0"),
    (lambda p: LinearWarmup(SGD(p, lr=0.1), warmup_steps=-2), "warmup_steps .* got -2"),
]


@pytest.mark.parametrize("make, message", BAD, ids=[m for _, m in BAD])
def test_bad_hyperparameters(make, message):
    with pytest.raises(ValueError, match=message):
        make(make_params())


# ------------------------------------------------------------------ schedules


def lr_sequence(make_schedule, base_lr=1.0, steps=8):
    optimizer = SGD(make_params(), lr=base_lr)
    schedule = make_schedule(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.lr)
        schedule.step()
    return lrs


def test_step_lr_values():
    lrs = lr_sequence(lambda o: StepLR(o, step_size=3, gamma=0.5))
    assert lrs == pytest.approx([1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25])


def test_cosine_values():
    lrs = lr_sequence(lambda o: CosineLR(o, total_steps=4, min_lr=0.2), base_lr=1.0, steps=7)
    half = 0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2
    quarter = 0.2 + 0.8 * (1 + math.cos(3 * math.pi / 4)) / 2
    # Stays at min_lr after total_steps.
    assert lrs == pytest.approx([1.0, half, 0.6, quarter, 0.2, 0.2, 0.2])


def test_linear_warmup_values():
    assert lr_sequence(lambda o: LinearWarmup(o, 4), steps=6) == \
        pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    after = lr_sequence(lambda o: LinearWarmup(o, 2, after=StepLR(o, step_size=2, gamma=0.1)))
    assert after == pytest.approx([0.5, 1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01])
    assert lr_sequence(lambda o: LinearWarmup(o, 0), steps=2) == [1.0, 1.0]


@pytest.mark.parametrize("name", ["StepLR", "CosineAnnealingLR", "LinearLR"])
def test_schedules_match_torch(name):
    torch = pytest.importorskip("torch")
    steps = 12
    ours = {
        "StepLR": lambda o: StepLR(o, step_size=5, gamma=0.3),
        "CosineAnnealingLR": lambda o: CosineLR(o, total_steps=steps, min_lr=0.01),
        "LinearLR": lambda o: LinearWarmup(o, 5),
    }[name]
    torch_kwargs = {"StepLR": dict(step_size=5, gamma=0.3),
                    "CosineAnnealingLR": dict(T_max=steps, eta_min=0.01),
                    "LinearLR": dict(start_factor=1 / 5, end_factor=1.0, total_iters=4)}[name]
    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.5)
    schedule = getattr(torch.optim.lr_scheduler, name)(optimizer, **torch_kwargs)
    expected = []
    for _ in range(steps + 1):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lr_sequence(ours, base_lr=0.5, steps=steps + 1) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("make", [
    lambda o: StepLR(o, step_size=3, gamma=0.5),
    lambda o: CosineLR(o, total_steps=10, min_lr=0.01),
    lambda o: LinearWarmup(o, 3, after=CosineLR(o, total_steps=6)),
], ids=["step", "cosine", "warmup-cosine"])
def test_schedule_state_dict_round_trip(make):
    optimizer = SGD(make_params(), lr=0.3)
    schedule = make(optimizer)
    for _ in range(4):
        schedule.step()
    saved = schedule.state_dict()
    uninterrupted = []
    for _ in range(6):
        schedule.step()
        uninterrupted.append(optimizer.lr)

    # A fresh optimizer whose lr is not the base lr any more: the state dict restores it.
    fresh = SGD(make_params(), lr=123.0)
    resumed = make(fresh)
    resumed.load_state_dict(saved)
    assert fresh.lr == pytest.approx(schedule.lr_at(4))
    continued = []
    for _ in range(6):
        resumed.step()
        continued.append(fresh.lr)
    assert continued == uninterrupted


def test_schedule_state_dict_of_another_kind():
    optimizer = SGD(make_params(), lr=0.3)
    with pytest.raises(ValueError, match="'StepLR' schedule given to a CosineLR"):
        CosineLR(optimizer, 5).load_state_dict(StepLR(optimizer, 2).state_dict())
