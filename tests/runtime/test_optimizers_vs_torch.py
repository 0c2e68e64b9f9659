"""Module/Optimizer training equals torch.optim step for step: 200 steps of each optimizer,
gradient clipping, gradient accumulation, and BatchNorm running statistics."""

from __future__ import annotations

import math

import _training_models as tm
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from graphforge.passes.optimizers import _float32

import graphforge
from graphforge import Module, Optimizer, roles
from graphforge.builder import Builder
from graphforge.program import ProgramRoles

torch = pytest.importorskip("torch")
F = torch.nn.functional

STEPS = 200


class TimmLamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019, arXiv:1904.00962) written from timm's ``timm.optim.Lamb``
    (the NVIDIA FusedLAMB behaviour), which cannot be installed here (it needs torchvision);
    independent of graphforge's pass. Per parameter, with t the step:

        m = beta1 m + (1 - beta1) g,  v = beta2 v + (1 - beta2) g²
        update = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps) + weight_decay * p
        p -= lr * trust * update,  trust = ||p|| / ||update|| (1 when either norm is 0)

    timm applies the trust ratio only to parameters with weight decay unless
    ``always_adapt``; its global gradient-norm clip (``max_grad_norm``, default 1.0) is
    left off here, as graphforge clips only when asked (``clip_grad_norm=``)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, always_adapt=False):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "always_adapt": always_adapt}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            group["step"] = group.get("step", 0) + 1
            correction1, correction2 = 1 - beta1 ** group["step"], 1 - beta2 ** group["step"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / correction1) / (v.sqrt() / math.sqrt(correction2) + group["eps"])
                if group["weight_decay"]:
                    update = update + group["weight_decay"] * p
                if group["weight_decay"] or group["always_adapt"]:
                    w_norm, u_norm = p.norm(), update.norm()
                    update = update * (w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0)
                p.sub_(update, alpha=group["lr"])


class HuggingFaceAdamW(torch.optim.Optimizer):
    """AdamW as HuggingFace's transformers.AdamW computed it (and onnxruntime-training's
    AdamWOptimizer with adam_mode 1), written from its documented algorithm; independent of
    graphforge's pass. Per parameter, with t the step:

        m = beta1 m + (1 - beta1) g,  v = beta2 v + (1 - beta2) g²
        p -= lr sqrt(1 - beta2^t) / (1 - beta1^t) · m / (sqrt(v) + eps)
        p -= lr weight_decay p          (after the update, from the updated p)"""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            group["step"] = group.get("step", 0) + 1
            rate = group["lr"] * math.sqrt(1 - beta2 ** group["step"]) / (1 - beta1 ** group["step"])
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-rate)
                if group["weight_decay"]:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])


CASES = {
    "sgd": ("sgd(lr=0.05)", lambda p: torch.optim.SGD(p, lr=0.05)),
    "sgd_momentum_weight_decay": (
        "sgd(lr=0.05, momentum=0.9, weight_decay=0.01)",
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    ),
    "sgd_nesterov": (
        "sgd(lr=0.05, momentum=0.9, nesterov=true, weight_decay=0.01)",
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "sgd_dampening": (
        "sgd(lr=0.05, momentum=0.8, dampening=0.1)",
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.1),
    ),
    "adam": ("adam(lr=0.01, weight_decay=0.01)", lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
    "adam_betas_eps": (
        "adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6)",
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6),
    ),
    "adamw": ("adamw(lr=0.01, weight_decay=0.1)", lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    "adamw_hf": (  # onnxruntime-training's on-device AdamW (its defaults but the decay)
        "adamw(lr=0.01, weight_decay=0.1, eps=1e-6, mode=hf)",
        lambda p: HuggingFaceAdamW(p, lr=0.01, weight_decay=0.1),
    ),
    "lamb": ("lamb(lr=0.01, weight_decay=0.01)", lambda p: TimmLamb(p, lr=0.01, weight_decay=0.01)),
    "lamb_betas_no_decay": (  # graphforge adapts every parameter: timm's always_adapt
        "lamb(lr=0.01, weight_decay=0, beta1=0.8, beta2=0.99)",
        lambda p: TimmLamb(p, lr=0.01, betas=(0.8, 0.99), weight_decay=0.0, always_adapt=True),
    ),
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


def torch_step(reference, torch_optimizer, x, target) -> float:
    """One torch.optim step of ``reference`` on the MSE loss; returns the loss."""
    torch_optimizer.zero_grad()
    loss = F.mse_loss(reference(torch.from_numpy(x)), torch.from_numpy(target))
    loss.backward()
    torch_optimizer.step()
    return loss.item()


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
        torch_loss = torch_step(reference, torch_optimizer, x, target)
    assert module.state.step == STEPS
    np.testing.assert_allclose(loss, torch_loss, rtol=1e-5)
    assert_parameters_match(module, reference)


@pytest.mark.parametrize(("case", "powers"), [("adam", 2), ("adamw", 2), ("lamb", 2), ("sgd_momentum_weight_decay", 0)])
def test_the_step_scalars_are_made_once_for_all_parameters(mlp_bytes, case, powers):
    """The bias corrections, step size and weight-decay factor depend on the step only: made
    once in the step's scope whatever the number of parameters, and no Cast of a constant."""
    spec = CASES[case][0]

    def step_scope(trainable: str) -> list[str]:
        program = graphforge.compile(mlp_bytes, f"loss(kind=mse, output=y), autodiff(trainable={trainable!r}), {spec}")
        program = program.model
        nodes = [n for n in program.graph.node if n.name.startswith(roles.OPTIM_PREFIX)]
        constants = {t.name for t in program.graph.initializer}
        assert not [n.name for n in nodes if n.op_type == "Cast" and n.input[0] in constants]
        assert [n.op_type for n in nodes].count("Pow") == powers
        parameters = len(ProgramRoles.read(program).parameters)
        return parameters, sorted(n.op_type for n in nodes if n.name.startswith(f"{roles.OPTIM_PREFIX}step/"))

    every, few = step_scope("*"), step_scope("0.*")
    assert (every[0], few[0]) == (4, 2)
    assert every[1] == few[1]
    assert every[1].count("Pow") == powers


def test_the_gradient_norm_reads_a_float32_gradient_as_it_is(mlp_bytes):
    """No Cast to float32 before ReduceSumSquare where the gradient is float32; a type that
    onnx-graphsurgeon keeps as ONNX's number (bfloat16) or does not know still gets one."""
    program = tm.compile_program(mlp_bytes, CASES["adamw"][0])
    producers = {o: n for n in program.graph.node for o in n.output}
    squares = [n for n in program.graph.node if n.op_type == "ReduceSumSquare"]
    assert len(squares) == 4
    assert not [n.name for n in squares if producers.get(n.input[0]) and producers[n.input[0]].op_type == "Cast"]
    b = Builder(gs.Graph(opset=17), prefix="t::")
    for dtype in (onnx.TensorProto.BFLOAT16, None, np.float16):
        assert _float32(b, gs.Variable("g", dtype=dtype)).inputs[0].op == "Cast"


@pytest.mark.parametrize("case", ["sgd_momentum_weight_decay", "adamw", "lamb"])
def test_a_learning_rate_changing_every_step_equals_torch(mlp_bytes, case):
    """The learning rate is a graph input: a new one each step, as a schedule sets it."""
    spec, make_torch = CASES[case]
    module = Module(tm.compile_program(mlp_bytes, spec), device="cpu")
    optimizer = Optimizer(module)
    reference = tm.mlp()
    torch_optimizer = make_torch(reference.parameters())
    for step, (x, target) in enumerate(tm.batches(60, seed=4)):
        lr = 0.02 * (1.0 + math.sin(step)) + 1e-3 * (step % 7)
        optimizer.set_learning_rate(lr)
        for group in torch_optimizer.param_groups:
            group["lr"] = lr
        module.train_step(x, target)
        torch_step(reference, torch_optimizer, x, target)
    assert_parameters_match(module, reference)


def test_lstm_training_equals_torch():
    """Adam on an LSTM regressor (the recurrent gradient rules) equals torch.optim step for step."""
    module = Module(tm.compile_program(tm.lstm_onnx(), "adam(lr=0.01)"), device="cpu")
    optimizer = Optimizer(module)
    reference = tm.lstm()
    torch_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for x, target in tm.batches(8, shape=(tm.SEQ, tm.N_IN), seed=5):
        loss = module(x, target)
        optimizer.step()
        torch_loss = torch_step(reference, torch_optimizer, x, target)
    np.testing.assert_allclose(loss, torch_loss, rtol=1e-5)
    assert_parameters_match(module, reference, rtol=1e-4, atol=1e-5)


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
@pytest.mark.parametrize("variance", ["unbiased", "population"])
def test_batchnorm_running_statistics_follow_torch(variance):
    """A CNN exported in training mode: parameters and running statistics equal torch's after
    20 steps. By default the running variance takes the batch's unbiased variance (N - 1), as
    torch does; batchnorm_variance="population" keeps the ONNX spec's (N), checked against
    torch's update formula applied to the population variance."""
    onnx_bytes = tm.cnn_onnx()
    pipeline = f'sgd(lr=0.1, momentum=0.9, batchnorm_variance="{variance}")'
    module = Module(tm.compile_program(onnx_bytes, pipeline), device="cpu")
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
        torch_step(reference, torch_optimizer, x, target)
        population_var = seen[-1].var(dim=(0, 2, 3), unbiased=False)
        running_var = (1 - bn.momentum) * running_var + bn.momentum * population_var
    assert_parameters_match(module, reference)
    buffers = module.buffers
    assert sorted(buffers) == ["1.running_mean", "1.running_var"]
    np.testing.assert_allclose(buffers["1.running_mean"], bn.running_mean.numpy(), rtol=1e-5, atol=1e-7)
    expected = bn.running_var if variance == "unbiased" else running_var
    np.testing.assert_allclose(buffers["1.running_var"], expected.numpy(), rtol=1e-5, atol=1e-7)
    assert not np.allclose(bn.running_var.numpy(), running_var.numpy(), rtol=1e-3)  # the two really differ
    assert not math.isclose(float(buffers["1.running_mean"][1]), 0.1)  # they really moved


def test_a_1x1_convolutions_update_reads_its_scalars_at_its_rank_and_equals_torch(tmp_path):
    """A weight whose last dim is 1 (a 1×1 convolution's [4, 3, 1, 1]): AdamW's scalars reach its
    update shaped [1, 1, 1, 1] (onnxruntime broadcasts a 0-d one over it element by element, 25×
    slower), and 20 steps equal torch.optim.AdamW's."""
    import warnings

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    path = tmp_path / "conv.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(reference, (torch.zeros(5, 3, 2, 2),), str(path), dynamo=False, do_constant_folding=False,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})  # fmt: skip
    program = graphforge.compile(str(path), "loss(kind=mse, output=y), autodiff, adamw(lr=0.01, weight_decay=0.1)")
    ranks = {t.name: len(t.dims) for t in program.model.graph.initializer}
    update = [n for n in program.model.graph.node if n.name.startswith(f"{roles.OPTIM_PREFIX}0.weight/")]
    arithmetic = [n for n in update if n.op_type in ("Add", "Sub", "Mul", "Div")]
    assert arithmetic and not [n.name for n in arithmetic if any(ranks.get(i) == 0 for i in n.input)]
    module = Module(program.model, device="cpu")
    optimizer = Optimizer(module)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    rng = np.random.default_rng(0)
    for _ in range(20):
        x, target = rng.standard_normal((5, 3, 2, 2)).astype(np.float32), rng.standard_normal((5, 2)).astype(np.float32)
        loss = module(x, target)
        optimizer.step()
        torch_loss = torch_step(reference, torch_optimizer, x, target)
    np.testing.assert_allclose(loss, torch_loss, rtol=1e-5)
    assert_parameters_match(module, reference)
