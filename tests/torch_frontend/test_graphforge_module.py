"""GraphforgeModule against plain PyTorch: the same module trained by the same
torch.optim.AdamW loop, wrapped and not, gives the same losses, parameters, BatchNorm running
statistics and input gradients step for step; the compiled programs are reused across batch
sizes and made again when an input's rank or dtype changes; no_grad and eval run the forward
alone; what cannot be compiled falls back to torch with one warning, or raises. (How tensors
cross between torch and onnxruntime: test_dlpack.py.)

The models train on the CPU here and in CI; ``GRAPHFORGE_TEST_DEVICE=cuda`` trains them on a GPU
(module and batches on CUDA, the sessions on onnxruntime's CUDA provider)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from graphforge import GraphforgeError  # noqa: E402
from graphforge.torch import GraphforgeModule  # noqa: E402

STEPS = 20
#: float32 sums in another order, over 20 AdamW steps
RTOL, ATOL = 1e-5, 1e-6
DEVICE = os.environ.get("GRAPHFORGE_TEST_DEVICE", "cpu")
if DEVICE == "cuda":  # torch's cuDNN convolutions default to TF32; graphforge's sessions compute full float32
    torch.backends.cudnn.allow_tf32 = False


def values(t) -> np.ndarray:
    return t.detach().cpu().numpy()


def digits_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)), (16, 64), 10


def cnn_with_batchnorm():
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3, padding=1, bias=False),  # no bias before a BatchNorm (it removes it)
        torch.nn.BatchNorm2d(6),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Dropout(0.0),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 4 * 4, 5),
    )
    return net, (8, 3, 8, 8), 5


class Block(torch.nn.Module):
    """A pre-norm transformer block over [batch, seq, 16] (causal attention written as GPT-2's
    is, 4 heads), then a classifier on the mean token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.norm1, self.norm2 = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        # no bias on q, k, v: a key bias moves every score of a query alike, which softmax
        # ignores, so its gradient is rounding noise that AdamW turns into steps of size lr
        self.qkv, self.proj = torch.nn.Linear(16, 48, bias=False), torch.nn.Linear(16, 16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 4)

    def attention(self, h):
        b, t, _ = h.shape
        q, k, v = (z.reshape(b, t, 4, 4).transpose(1, 2) for z in self.qkv(h).split(16, dim=-1))
        scores = q @ k.transpose(-1, -2) / 2.0
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, 16))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(dim=1))


def transformer_block():
    return Block(), (4, 6, 16), 4


def batch(shape, classes, seed):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    return x.to(DEVICE), torch.from_numpy(rng.integers(0, classes, shape[0])).to(DEVICE)


def train_side_by_side(build, steps=STEPS, **options):
    net, shape, classes = build()
    net.to(DEVICE)
    plain = copy.deepcopy(net)
    wrapped = GraphforgeModule(net, fallback="error", **options)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (wrapped, plain)]
    for step in range(steps):
        x, y = batch((shape[0] + step % 3, *shape[1:]), classes, step)  # the batch size changes too
        losses = []
        for model, optimizer in zip((wrapped, plain), optimizers, strict=True):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        np.testing.assert_allclose(losses[0], losses[1], rtol=RTOL, err_msg=f"step {step}")
    return wrapped, plain


@pytest.mark.parametrize("exporter", ["auto", "dynamo"])
@pytest.mark.parametrize("build", [digits_mlp, cnn_with_batchnorm, transformer_block])
def test_training_equals_plain_torch_step_for_step(build, exporter):
    wrapped, plain = train_side_by_side(build, exporter=exporter)
    assert wrapped.compiles == 1  # three batch sizes, one program
    # auto: TorchScript's export, which these modules have
    assert {c.exporter for c in wrapped._compiled.values()} == {"torchscript" if exporter == "auto" else exporter}
    ours = dict(wrapped.module.named_parameters())
    for name, value in plain.named_parameters():
        np.testing.assert_allclose(values(ours[name]), values(value), rtol=RTOL, atol=ATOL, err_msg=name)
    ours = dict(wrapped.module.named_buffers())
    for name, value in plain.named_buffers():  # BatchNorm's running statistics and its counter
        np.testing.assert_allclose(values(ours[name]), values(value), rtol=RTOL, atol=ATOL, err_msg=name)


def test_input_gradients_equal_torch():
    net, shape, classes = transformer_block()
    net.to(DEVICE)
    plain, wrapped = copy.deepcopy(net), GraphforgeModule(net, fallback="error")
    x, y = batch(shape, classes, 7)
    grads = []
    for model in (wrapped, plain):
        leaf = x.clone().requires_grad_(True)
        torch.nn.functional.cross_entropy(model(leaf), y).backward()
        grads.append(values(leaf.grad))
    np.testing.assert_allclose(grads[0], grads[1], rtol=RTOL, atol=ATOL)
    for (name, a), b in zip(wrapped.module.named_parameters(), plain.parameters(), strict=True):
        np.testing.assert_allclose(values(a.grad), values(b.grad), rtol=1e-4, atol=ATOL, err_msg=name)


def test_a_new_rank_or_dtype_compiles_again_once():
    torch.manual_seed(3)
    net = torch.nn.Linear(5, 3)
    wrapped = GraphforgeModule(copy.deepcopy(net), fallback="error")
    expected_compiles = [
        (torch.randn(4, 5), 1),
        (torch.randn(9, 5), 1),  # the batch is symbolic from the start
        (torch.randn(2, 7, 5), 2),  # rank 3
        (torch.randn(3, 5), 2),
        (torch.randn(1, 2, 5), 3),  # dim 1 changed: made symbolic
        (torch.randn(6, 11, 5), 3),
    ]
    for x, compiles in expected_compiles:
        np.testing.assert_allclose(wrapped(x).detach(), net(x).detach(), rtol=RTOL, atol=ATOL)
        assert wrapped.compiles == compiles, tuple(x.shape)
    wrapped.double()
    net.double()
    x = torch.randn(4, 5, dtype=torch.float64)
    np.testing.assert_allclose(wrapped(x).detach(), net(x).detach(), rtol=1e-12)
    assert wrapped.compiles == 4


def test_no_grad_and_eval_run_the_forward_alone():
    net, shape, classes = cnn_with_batchnorm()
    net.to(DEVICE)
    plain, wrapped = copy.deepcopy(net), GraphforgeModule(net, fallback="error")
    x, _ = batch(shape, classes, 1)
    with torch.no_grad():  # training mode: batch statistics, and the running ones move as torch's do
        out = wrapped(x)
        expected = plain(x)
    assert out.grad_fn is None and out.device == x.device
    np.testing.assert_allclose(values(out), values(expected), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        values(wrapped.module[1].running_mean), values(plain[1].running_mean), rtol=RTOL, atol=ATOL
    )
    wrapped.eval()
    plain.eval()
    np.testing.assert_allclose(values(wrapped(x)), values(plain(x)), rtol=RTOL, atol=ATOL)
    assert wrapped.compiles == 2  # eval is its own program: the running statistics, no Dropout
    (compiled,) = [c for (kind, _), c in wrapped._compiled.items() if kind[1] is False]  # (inputs, training, device)
    assert compiled.statistics == {}
    assert {c.device.type for c in wrapped._compiled.values()} == {torch.device(DEVICE).type}


def test_what_cannot_compile_falls_back_with_one_warning_or_raises():
    class Cumulative(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return torch.cummax(x * self.scale, dim=1).values  # no ONNX export for cummax

    x = torch.randn(2, 3)
    both = r"cannot run Cumulative: .*torchscript: torch\.onnx\.export failed: .*cummax.*; dynamo: .*aten\.cummax"
    with pytest.raises(GraphforgeError, match=both):
        GraphforgeModule(Cumulative(), fallback="error")(x)
    wrapped = GraphforgeModule(Cumulative())
    with pytest.warns(UserWarning, match="runs Cumulative in plain PyTorch from now on: .*cummax"):
        first = wrapped(x)
    np.testing.assert_allclose(first.detach(), Cumulative()(x).detach())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per call
        wrapped(x)
    with pytest.raises(GraphforgeError, match=r"keyword arguments \(x\) are not taken"):
        GraphforgeModule(torch.nn.Linear(3, 2), fallback="error")(x=x)
    with pytest.raises(GraphforgeError, match="input 1 is a float, not a tensor"):
        GraphforgeModule(torch.nn.Linear(3, 2), fallback="error")(x, 2.0)
    with pytest.raises(GraphforgeError, match="fallback must be 'warn' or 'error'"):
        GraphforgeModule(torch.nn.Linear(3, 2), fallback="ignore")


def test_a_tied_weight_trains_as_one_parameter_and_debug_dir_keeps_the_models(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.embed = torch.nn.Embedding(9, 6)
            self.head = torch.nn.Linear(6, 9, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.embed(ids)))

    net = Tied().to(DEVICE)
    plain, wrapped = copy.deepcopy(net), GraphforgeModule(net, fallback="error", debug_dir=tmp_path)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (wrapped, plain)]
    rng = np.random.default_rng(5)
    for _ in range(5):
        ids, labels = (torch.from_numpy(rng.integers(0, 9, 7)).to(DEVICE) for _ in range(2))
        for model, optimizer in zip((wrapped, plain), optimizers, strict=True):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(ids), labels).backward()
            optimizer.step()
    np.testing.assert_allclose(values(wrapped.module.embed.weight), values(plain.embed.weight), rtol=RTOL, atol=ATOL)
    saved = sorted(p.name for p in (tmp_path / "signature0").iterdir())
    assert saved == ["compiled.onnx", "exported.onnx", "segment0.onnx", "segment1.onnx", "signature.json"]


def test_the_guides_block_runs():
    """docs/guides/graphforge-module.md's loop, as written."""
    from _pages import page_block

    block = page_block("docs/guides/graphforge-module.md", "python", "GraphforgeModule(net)")
    namespace: dict = {}
    exec(compile(block, "docs/guides/graphforge-module.md", "exec", dont_inherit=True), namespace)
    assert namespace["model"].compiles == 1 and namespace["net"][0].weight.grad is not None


def test_embedding_padding_rows_get_no_gradient_from_the_lookup_as_in_torch():
    """nn.Embedding(padding_idx=0): torch gives the looked-up padding row no gradient (the
    exported Gather does not know the row); a tied output layer still trains it, as in torch."""

    class Padded(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            torch.manual_seed(6)
            self.embed = torch.nn.Embedding(10, 6, padding_idx=0)
            self.head = torch.nn.Linear(6, 10, bias=False)
            if tied:
                self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.embed(ids)).mean(dim=1))

    for tied in (False, True):
        net = Padded(tied).to(DEVICE)
        plain, wrapped = copy.deepcopy(net), GraphforgeModule(net, fallback="error")
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (wrapped, plain)]
        rng = np.random.default_rng(7)
        for _ in range(6):
            ids = torch.from_numpy(rng.integers(0, 4, (5, 3))).to(DEVICE)  # many padding ids (0)
            labels = torch.from_numpy(rng.integers(0, 10, 5)).to(DEVICE)
            for model, optimizer in zip((wrapped, plain), optimizers, strict=True):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(ids), labels).backward()
                optimizer.step()
        if not tied:  # the padding row only decays
            decayed = Padded(False).embed.weight[0] * (1 - 1e-2 * 1e-2) ** 6
            assert torch.equal(plain.embed.weight[0].cpu(), decayed)
        np.testing.assert_allclose(
            values(wrapped.module.embed.weight),
            values(plain.embed.weight),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"tied={tied}",
        )


def test_inputs_and_parameters_must_share_a_device_that_onnxruntime_runs():
    """meta tensors stand for a device graphforge does not run."""
    net = torch.nn.Linear(3, 2)
    with pytest.raises(GraphforgeError, match=r"input 0 is on meta; GraphforgeModule runs CPU and CUDA tensors"):
        GraphforgeModule(net, fallback="error")(torch.empty(4, 3, device="meta"))
    with pytest.raises(GraphforgeError, match=r"weight is on meta and the inputs on cpu; move the module there"):
        GraphforgeModule(torch.nn.Linear(3, 2, device="meta"), fallback="error")(torch.randn(4, 3))
    if DEVICE == "cuda":
        with pytest.raises(GraphforgeError, match=r"input 1 is on cpu and input 0 on cuda:0"):
            GraphforgeModule(net.cuda(), fallback="error")(torch.randn(4, 3, device="cuda"), torch.randn(4, 3))


def test_a_module_torchscript_cannot_export_is_exported_by_dynamo():
    from _torch_modules import RMSNormNet

    wrapped, plain = train_side_by_side(lambda: (RMSNormNet(), (6, 8), 3), steps=6)
    assert {c.exporter for c in wrapped._compiled.values()} == {"dynamo"}
    np.testing.assert_allclose(values(wrapped.module.norm.weight), values(plain.norm.weight), rtol=RTOL, atol=ATOL)
    with pytest.raises(GraphforgeError, match=r"cannot run RMSNormNet: torch\.onnx\.export failed: .*rms_norm"):
        GraphforgeModule(RMSNormNet(), fallback="error", exporter="torchscript")(torch.randn(2, 8))
    with pytest.raises(GraphforgeError, match="exporter must be 'auto', 'torchscript' or 'dynamo'"):
        GraphforgeModule(RMSNormNet(), exporter="jit")
