"""Optimizers (SGD, Adam, AdamW) and learning-rate schedules: local math on parameter shards.

Each rank updates its own shards from gradients already summed over the ranks holding the
same shard, so no MPI is needed here and the optimizer state is sharded like the parameters.

Semantics are PyTorch's (torch.optim.SGD, Adam, AdamW and the closed forms of its StepLR,
CosineAnnealingLR and LinearLR), so torch serves as an oracle in the tests. State dict layout:

    {"step": int,                      # calls of step() so far
     "lr": float,
     "hyper": {name: float or bool},   # momentum, betas, ... (restored on load, like PyTorch)
     "updates": {param.name: int},     # updates each parameter received (Adam's bias correction)
     "state": {param.name: {buffer name: array of the shard's shape}}}

A parameter with no buffers (not yet updated, or SGD without momentum) may be left out of
"state" on load; "updates" must name every parameter.
"""
import math

from .backend import get_array_module
from .checks import at_least, finite_number, int_at_least


class Optimizer:
    """What every optimizer shares: the parameters, `lr`, the step count, per-parameter state.

    A subclass names its buffers, checks its hyperparameters in `_check_hyper` and updates one
    parameter in place in `_update(param, state, count)`.
    """

    def __init__(self, params, lr, hyper):
        self.params = list(params)
        names = [p.name for p in self.params]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            # State is keyed by name, so two parameters sharing one would share momentum.
            raise ValueError(f"parameter names must be unique, repeated: {repeated}")
        self._check_hyper(lr, hyper)
        self.lr = float(lr)
        self.hyper = dict(hyper)
        self.step_count = 0
        self.updates = {name: 0 for name in names}
        self.state = {name: {} for name in names}

    def buffer_names(self, hyper):
        """Names of the state arrays each parameter gets under hyperparameters `hyper`."""
        raise NotImplementedError

    def _check_hyper(self, lr, hyper):
        raise NotImplementedError

    def _update(self, param, state, count):
        raise NotImplementedError

    def step(self):
        """Update every parameter that has a gradient; parameters with grad None are skipped."""
        for p in self.params:
            if p.grad is None:
                continue
            if tuple(p.grad.shape) != tuple(p.data.shape):
                raise ValueError(f"parameter {p.name}: gradient of shape {tuple(p.grad.shape)} "
                                 f"for a shard of shape {tuple(p.data.shape)}")
            self.updates[p.name] += 1
            self._update(p, self.state[p.name], self.updates[p.name])
        self.step_count += 1

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_bytes(self):
        """Bytes of optimizer state held by this rank."""
        return sum(int(a.nbytes) for buffers in self.state.values() for a in buffers.values())

    def state_dict(self):
        """A snapshot (arrays copied, so later steps do not change it); layout in the module
        docstring."""
        return {
            "step": self.step_count,
            "lr": self.lr,
            "hyper": dict(self.hyper),
            "updates": dict(self.updates),
            "state": {name: {b: a.copy() for b, a in buffers.items()}
                      for name, buffers in self.state.items()},
        }

    def load_state_dict(self, state_dict):
        """Restore a snapshot of an optimizer of the same kind over parameters of the same names
        and shard shapes. Everything is checked before anything changes."""
        missing = [k for k in ("step", "lr", "hyper", "updates", "state") if k not in state_dict]
        if missing:
            raise ValueError(f"optimizer state dict lacks the entries {missing}")
        hyper = dict(state_dict["hyper"])
        if set(hyper) != set(self.hyper):
            raise ValueError(f"state dict has hyperparameters {sorted(hyper)}, "
                             f"{type(self).__name__} expects {sorted(self.hyper)}")
        self._check_hyper(state_dict["lr"], hyper)
        ours, theirs = set(self.updates), set(state_dict["updates"])
        if theirs != ours:
            raise ValueError(f"state dict does not match the optimizer's parameters: "
                             f"missing {sorted(ours - theirs)}, unknown {sorted(theirs - ours)}")
        unknown = sorted(set(state_dict["state"]) - ours)
        if unknown:
            raise ValueError(f"state dict holds buffers of unknown parameters {unknown}")
        by_name = {p.name: p for p in self.params}
        for name in sorted(ours):
            # A parameter has all its buffers once updated, none before; a parameter without
            # buffers may be left out of "state".
            buffers = state_dict["state"].get(name, {})
            expected = set(self.buffer_names(hyper)) if state_dict["updates"][name] else set()
            if set(buffers) != expected:
                raise ValueError(f"parameter {name}, updated {state_dict['updates'][name]} times: "
                                 f"state dict has buffers {sorted(buffers)}, expected "
                                 f"{sorted(expected)}")
            shard_shape = tuple(by_name[name].data.shape)
            for buffer, array in buffers.items():
                if tuple(array.shape) != shard_shape:
                    raise ValueError(f"parameter {name}: {buffer} has shape {tuple(array.shape)}, "
                                     f"the shard has shape {shard_shape}")
        self.hyper = hyper
        self.lr = float(state_dict["lr"])
        self.step_count = int(state_dict["step"])
        self.updates = {name: int(n) for name, n in state_dict["updates"].items()}
        self.state = {}
        for name in self.updates:
            data = by_name[name].data
            xp = get_array_module(data)
            # Copy into the shard's array module and dtype (a NumPy checkpoint onto CuPy shards).
            self.state[name] = {b: xp.array(a, dtype=data.dtype)
                                for b, a in state_dict["state"].get(name, {}).items()}


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, Nesterov momentum and L2 weight decay.

    As torch.optim.SGD, with g the gradient and b the momentum buffer of a parameter p:
        g = g + weight_decay * p
        b = g at the first update, then b = momentum * b + (1 - dampening) * g
        g = g + momentum * b  (nesterov)  or  g = b  (otherwise; b unused when momentum is 0)
        p = p - lr * g
    """

    def __init__(self, params, lr, momentum=0.0, nesterov=False, weight_decay=0.0, dampening=0.0):
        hyper = {"momentum": float(momentum), "dampening": float(dampening),
                 "nesterov": bool(nesterov), "weight_decay": float(weight_decay)}
        super().__init__(params, lr, hyper)

    def _check_hyper(self, lr, hyper):
        at_least(lr, 0.0, "SGD learning rate")
        at_least(hyper["momentum"], 0.0, "SGD momentum")
        at_least(hyper["weight_decay"], 0.0, "SGD weight_decay")
        if hyper["nesterov"] and (hyper["momentum"] <= 0 or hyper["dampening"] != 0):
            raise ValueError(f"SGD with nesterov=True needs momentum > 0 and dampening 0, got "
                             f"momentum={hyper['momentum']!r}, dampening={hyper['dampening']!r}")

    def buffer_names(self, hyper):
        return ("momentum_buffer",) if hyper["momentum"] > 0 else ()

    def _update(self, param, state, count):
        h = self.hyper
        grad = param.grad
        if h["weight_decay"] != 0:
            grad = grad + h["weight_decay"] * param.data
        if h["momentum"] > 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.copy()
            else:
                buf *= h["momentum"]
                buf += (1 - h["dampening"]) * grad
            grad = grad + h["momentum"] * buf if h["nesterov"] else buf
        param.data -= self.lr * grad  # in place: layers may hold a reference to param.data


class Adam(Optimizer):
    """Adam (Kingma and Ba), with L2 weight decay, or AdamW's decoupled decay.

    As torch.optim.Adam / AdamW, with t the number of updates this parameter has received:
        p = p * (1 - lr * weight_decay)            (decoupled)
        g = g + weight_decay * p                   (otherwise)
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2   (from zeros)
        p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled=False):
        beta1, beta2 = betas
        hyper = {"beta1": float(beta1), "beta2": float(beta2), "eps": float(eps),
                 "weight_decay": float(weight_decay), "decoupled": bool(decoupled)}
        super().__init__(params, lr, hyper)

    def _check_hyper(self, lr, hyper):
        name = "AdamW" if hyper["decoupled"] else "Adam"
        at_least(lr, 0.0, f"{name} learning rate")
        at_least(hyper["eps"], 0.0, f"{name} eps")
        at_least(hyper["weight_decay"], 0.0, f"{name} weight_decay")
        for key in ("beta1", "beta2"):
            if not 0.0 <= hyper[key] < 1.0:
                raise ValueError(f"{name} {key} must be in [0, 1), got {hyper[key]!r}")

    def buffer_names(self, hyper):
        return ("exp_avg", "exp_avg_sq")

    def _update(self, param, state, count):
        h = self.hyper
        xp = get_array_module(param.data)
        grad = param.grad
        if h["weight_decay"] != 0:
            if h["decoupled"]:
                param.data *= 1 - self.lr * h["weight_decay"]
            else:
                grad = grad + h["weight_decay"] * param.data
        if not state:
            state["exp_avg"] = xp.zeros_like(param.data)
            state["exp_avg_sq"] = xp.zeros_like(param.data)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m *= h["beta1"]
        m += (1 - h["beta1"]) * grad
        v *= h["beta2"]
        v += (1 - h["beta2"]) * grad * grad
        # The moments start at zero, so early on they underestimate; dividing by
        # 1 - beta^t undoes that bias.
        step_size = self.lr / (1 - h["beta1"] ** count)
        denom = xp.sqrt(v) / math.sqrt(1 - h["beta2"] ** count) + h["eps"]
        param.data -= step_size * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov and Hutter), default decay 1e-2 as torch."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled=True)


# ---------------------------------------------------------------------------------------------
# Learning-rate schedules. A schedule computes the lr of iteration t (0, 1, 2, ...) in closed
# form from the base lr (the optimizer's lr when the schedule is made) and sets optimizer.lr:
# at construction to lr_at(0), and at each step() (called once per iteration, after
# optimizer.step()) to lr_at(t + 1). So a schedule restored from its state dict continues the
# same lr sequence.


class LRSchedule:
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.base_lr = float(optimizer.lr)
        self.last_step = 0  # iterations completed; the optimizer's lr is lr_at(last_step)
        self.optimizer.lr = self.lr_at(0)

    def lr_at(self, t):
        """The learning rate of iteration t."""
        raise NotImplementedError

    def step(self):
        self.last_step += 1
        self.optimizer.lr = self.lr_at(self.last_step)

    def state_dict(self):
        return {"kind": type(self).__name__, "last_step": self.last_step, "base_lr": self.base_lr}

    def load_state_dict(self, state_dict):
        if state_dict.get("kind") != type(self).__name__:
            raise ValueError(f"state dict of a {state_dict.get('kind')!r} schedule given to "
                             f"a {type(self).__name__}")
        self.last_step = int(state_dict["last_step"])
        self.base_lr = float(state_dict["base_lr"])
        self.optimizer.lr = self.lr_at(self.last_step)


class StepLR(LRSchedule):
    """lr_at(t) = base_lr * gamma ** (t // step_size), as torch.optim.lr_scheduler.StepLR."""

    def __init__(self, optimizer, step_size, gamma=0.1):
        int_at_least(step_size, "StepLR step_size", 1)
        self.step_size = step_size
        self.gamma = finite_number(gamma, "StepLR gamma", above=0)
        super().__init__(optimizer)

    def lr_at(self, t):
        return self.base_lr * self.gamma ** (t // self.step_size)


class CosineLR(LRSchedule):
    """Half a cosine from base_lr at t = 0 down to min_lr at t = total_steps, then min_lr:

        lr_at(t) = min_lr + (base_lr - min_lr) * (1 + cos(pi * min(t, total_steps) / total_steps)) / 2

    torch's CosineAnnealingLR(T_max=total_steps, eta_min=min_lr) up to total_steps; past it torch
    climbs back up the cosine, this one stays at min_lr.
    """

    def __init__(self, optimizer, total_steps, min_lr=0.0):
        int_at_least(total_steps, "CosineLR total_steps", 1)
        at_least(min_lr, 0.0, "CosineLR min_lr")
        self.total_steps = total_steps
        self.min_lr = float(min_lr)
        super().__init__(optimizer)

    def lr_at(self, t):
        progress = min(t, self.total_steps) / self.total_steps
        return self.min_lr + (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2


class LinearWarmup(LRSchedule):
    """A linear ramp over the first warmup_steps iterations, then constant or another schedule.

        lr_at(t) = target * (t + 1) / warmup_steps    for t < warmup_steps
                 = after.lr_at(t - warmup_steps)      afterwards (target = after.lr_at(0)),
                   or base_lr when after is None      (target = base_lr)

    So iteration 0 uses target / warmup_steps and iteration warmup_steps - 1 the full target:
    torch's LinearLR(start_factor=1/warmup_steps, total_iters=warmup_steps - 1). `after` is a
    schedule made on the same optimizer; step only the warmup, which drives `after`.
    """

    def __init__(self, optimizer, warmup_steps, after=None):
        int_at_least(warmup_steps, "LinearWarmup warmup_steps", 0)
        if after is not None and after.optimizer is not optimizer:
            raise ValueError("LinearWarmup: the `after` schedule drives a different optimizer")
        self.warmup_steps = warmup_steps
        self.after = after
        super().__init__(optimizer)

    def lr_at(self, t):
        target = self.after.lr_at(0) if self.after is not None else self.base_lr
        if t < self.warmup_steps:
            return target * (t + 1) / self.warmup_steps
        return self.after.lr_at(t - self.warmup_steps) if self.after is not None else self.base_lr

    def state_dict(self):
        sd = super().state_dict()
        if self.after is not None:
            sd["after"] = self.after.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        if (self.after is None) != ("after" not in state_dict):
            raise ValueError("LinearWarmup state dict and schedule disagree on having an "
                             "`after` schedule")
        if self.after is not None:
            # Restores the after schedule's base lr (and sets the optimizer's lr, which the
            # warmup's own load below then overrides).
            self.after.load_state_dict(state_dict["after"])
        super().load_state_dict(state_dict)
