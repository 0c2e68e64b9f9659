"""Module/Optimizer training equals torch.optim step for step: 200 steps of each optimizer,
gradient clipping, gradient accumulation, and BatchNorm running statistics."""

from __future__ import annotations

import math

import _training_models as tm
import numpy as np
import pytest

from graphforge import Module, Optimizer

torch = pytest.importorskip("torch")
F = torch.nn.functional

STEPS = 200


class ReferenceLamb(torch.optim.Optimizer):
    """LAMB as graphforge's lamb pass states it (torch.optim has none): Adam's bias-corrected
    direction plus decoupled weight decay, scaled by the trust ratio ||p|| / ||direction||
    (1 where either norm is 0)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                direction = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    direction = direction + group["weight_decay"] * p
                w_norm, d_norm = p.norm(), direction.norm()
                trust = (w_norm / d_norm).item() if w_norm > 0 and d_norm > 0 else 1.0
                p.sub_(direction * (trust * group["lr"]))


CASES = {
    "sgd_nesterov": (
        "sgd(lr=0.05, momentum=0.9, nesterov=true, weight_decay=0.01)",
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "sgd_dampening": (
        "sgd(lr=0.05, momentum=0.8, dampening=0.1)",
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.1),
    ),
    "adam": ("adam(lr=0.01, weight_decay=0.01)", lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
    "adamw": ("adamw(lr=0.01, weight_decay=0.1)", lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    "lamb": ("lamb(lr=0.01, weight_decay=0.01)", lambda p: ReferenceLamb(p, lr=0.01, weight_decay=0.01)),
}


@pytest.fixture(scope="module")
def mlp_bytes():
    return tm.mlp_onnx()


def assert_parameters_match(module: Module, reference, *, rtol=1e-5, atol=1e-6):
    ours = module.parameters
    theirs = {name: p.detach().numpy() for name, p in reference.named_parameters()}
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_200_steps_equal_torch(mlp_bytes, case):
    spec, make_torch = CASES[case]
    module = Module(tm.compile_program(mlp_bytes, spec), device="cpu")
    optimizer = Optimizer(module)
    reference = tm.mlp()
    torch_optimizer = make_torch(reference.parameters())
    for x, target in tm.batches(STEPS):
        loss = module(x, target)
        optimizer.step()
        torch_optimizer.zero_grad()
        torch_loss = F.mse_loss(reference(torch.from_numpy(x)), torch.from_numpy(target))
        torch_loss.backward()
        torch_optimizer.step()
    assert module.state.step == STEPS
    np.testing.assert_allclose(loss, torch_loss.item(), rtol=1e-5)
    assert_parameters_match(module, reference)


def test_clip_grad_norm_equals_torch(mlp_bytes):
    module = Module(tm.compile_program(mlp_bytes, "sgd(lr=0.1, momentum=0.9, clip_grad_norm=0.5)"), device="cpu")
    optimizer = Optimizer(module)
    reference = tm.mlp()
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    clipped = 0
    for x, target in tm.batches(50):
        module(x, target)
        optimizer.step()
        torch_optimizer.zero_grad()
        F.mse_loss(reference(torch.from_numpy(x)), torch.from_numpy(target)).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch_optimizer.step()
        np.testing.assert_allclose(optimizer.grad_norm, norm.item(), rtol=1e-5)  # the norm before clipping
        clipped += norm.item() > 0.5
    assert clipped > 10  # the clip really fired
    assert_parameters_match(module, reference)


@pytest.mark.parametrize("fused_last", [False, True], ids=["step", "train_step"])
def test_accumulating_4_micro_batches_equals_torch_accumulated_gradients(mlp_bytes, fused_last):
    """4 micro-batches accumulated then one update, as torch does with 4 backward() calls
    before step(); ``module.lazy_reset_grad()`` starts the next accumulation. With
    ``fused_last``, the last micro-batch and the update run as one ``train_step``."""
    module = Module(tm.compile_program(mlp_bytes, "adamw(lr=0.01, weight_decay=0.1, accumulate=true)"), device="cpu")
    optimizer = Optimizer(module)
    reference = tm.mlp()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    micro = tm.batches(40, batch=3, seed=1)
    for k in range(0, len(micro), 4):
        for i, (x, target) in enumerate(micro[k : k + 4]):
            if fused_last and i == 3:
                module.train_step(x, target)
            else:
                module(x, target)
        if not fused_last:
            optimizer.step()
            module.lazy_reset_grad()
        torch_optimizer.zero_grad()
        for x, target in micro[k : k + 4]:
            F.mse_loss(reference(torch.from_numpy(x)), torch.from_numpy(target)).backward()
        torch_optimizer.step()
    assert module.state.step == 10
    assert_parameters_match(module, reference)


def test_accumulated_gradients_of_equal_micro_batches_equal_one_big_batch(mlp_bytes):
    """Summed gradients of 4 mean-loss micro-batches are 4x the big batch's: with sgd and
    lr/4, one accumulated step equals one big-batch step."""
    big = Module(tm.compile_program(mlp_bytes, "sgd(lr=0.2)"), device="cpu")
    accumulated = Module(tm.compile_program(mlp_bytes, "sgd(lr=0.05, accumulate=true)"), device="cpu")
    big_optimizer, accumulated_optimizer = Optimizer(big), Optimizer(accumulated)
    for x, target in tm.batches(5, batch=8, seed=2):
        big(x, target)
        big_optimizer.step()
        for i in range(4):
            accumulated(x[2 * i : 2 * i + 2], target[2 * i : 2 * i + 2])
        accumulated_optimizer.step()
        accumulated.lazy_reset_grad()
    for name, value in big.parameters.items():
        np.testing.assert_allclose(accumulated.parameters[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.filterwarnings("ignore:autodiff. the loss does not depend")
def test_batchnorm_running_statistics_follow_torch():
    """A CNN exported in training mode: parameters and running mean equal torch's after 20
    steps. ONNX's BatchNormalization updates the running variance with the population
    variance (its spec); torch uses the sample variance (N-1), so the running variance is
    checked against torch's running mean formula applied to the population variance."""
    onnx_bytes = tm.cnn_onnx()
    module = Module(tm.compile_program(onnx_bytes, "sgd(lr=0.1, momentum=0.9)"), device="cpu")
    optimizer = Optimizer(module)
    reference = tm.cnn()
    tm.buffers_from_onnx(reference, onnx_bytes)
    reference.train()
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    bn = reference[1]
    running_var = bn.running_var.clone()
    seen = []
    bn.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    for x, target in tm.batches(20, batch=4, shape=(2, 5, 5)):
        module(x, target)
        optimizer.step()
        torch_optimizer.zero_grad()
        F.mse_loss(reference(torch.from_numpy(x)), torch.from_numpy(target)).backward()
        torch_optimizer.step()
        population_var = seen[-1].var(dim=(0, 2, 3), unbiased=False)
        running_var = (1 - bn.momentum) * running_var + bn.momentum * population_var
    assert_parameters_match(module, reference)
    buffers = module.buffers
    assert sorted(buffers) == ["1.running_mean", "1.running_var"]
    np.testing.assert_allclose(buffers["1.running_mean"], bn.running_mean.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(buffers["1.running_var"], running_var.numpy(), rtol=1e-5, atol=1e-7)
    assert not math.isclose(float(buffers["1.running_mean"][1]), 0.1)  # they really moved
