"""The lora pass against PEFT: on random-initialized Hugging Face models of seven families,
exported by torch's TorchScript exporter (and by its dynamo exporter for GPT-2 and Llama),
graphforge's adapters choose PEFT's modules, and with the same A and B values give PEFT's
loss and adapter gradients; the base trains nothing. Then the pass's own cases on small
hand-written models: scale, dropout on the adapter's input alone, initialization, dtype,
roles, and the errors."""

from __future__ import annotations

import copy
import math
import warnings
import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import graphforge
from graphforge import roles
from graphforge.pass_spec import format_value
from graphforge.program import ProgramRoles

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64
#: batch and sequence of the comparison's input, not the export example's (2, 8)
BATCH, SEQ = 3, 7
#: every family at a size that exports in about a second: one layer (two for Llama), hidden 32
_SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "max_position_embeddings": 64}  # fmt: skip
FAMILIES = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "vocab_size": VOCAB,
            "n_embd": 32,
            "n_layer": 1,
            "n_head": 2,
            "n_positions": 64,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_SMALL, "num_hidden_layers": 2, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_SMALL, "num_key_value_heads": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_SMALL, "num_key_value_heads": 2, "sliding_window": None}),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        {**_SMALL, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0, "partial_rotary_factor": 0.5},
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 64,
            "word_embed_proj_dim": 32,
            "dropout": 0.0,
            "attention_dropout": 0.0,
        },
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        {**_SMALL, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    ),
}
#: (family, exporter): TorchScript with torch's default constant folding (a Linear's weight
#: becomes ``onnx::MatMul_<n>``, [in, out], named by its node's scope), and unfolded for Llama
#: (``Transpose(weight)``); dynamo (optimize=False) where the repository's tests use it
EXPORTS = [*((f, "torchscript") for f in FAMILIES), ("llama", "torchscript-unfolded"), ("gpt2", "dynamo"),
           ("llama", "dynamo")]  # fmt: skip


class Logits(torch.nn.Module):
    """A causal or masked LM as input_ids [B, T] -> logits [B, V, T] (cross_entropy's layout).
    transformers 5.x traces a dynamic sequence only with an explicit attention mask."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.transpose(1, 2)


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model, random-initialized (never downloaded), in eval mode, its 1-D
    parameters jittered (the TorchScript exporter merges equal initializers)."""
    config_class, model_class, settings = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**settings, attn_implementation="eager", use_cache=False)
    model = getattr(transformers, model_class)(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model.eval()


def export(module: torch.nn.Module, path, exporter: str):
    example = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
            torch.onnx.export(module, (example,), str(path), dynamo=True, optimize=False, opset_version=18,
                              input_names=["input_ids"], output_names=["logits"], dynamic_shapes=(dims,),
                              external_data=False, verbose=False)  # fmt: skip
        else:
            torch.onnx.export(module, (example,), str(path), dynamo=False, opset_version=17,
                              do_constant_folding=exporter == "torchscript", input_names=["input_ids"],
                              output_names=["logits"],
                              dynamic_axes={"input_ids": {0: "b", 1: "t"}, "logits": {0: "b", 2: "t"}})  # fmt: skip
    return onnx.load(str(path))


@pytest.fixture(scope="module", params=EXPORTS, ids=["-".join(e) for e in EXPORTS])
def exported(request, tmp_path_factory):
    family, exporter = request.param
    module = Logits(hf_model(family))
    return family, exporter, module, export(module, tmp_path_factory.mktemp(family) / "model.onnx", exporter)


def compile_lora(model: onnx.ModelProto, lora: str) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` compiled with ``lora`` before the loss and autodiff; the autodiff pass's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = graphforge.compile(model, f"{lora}, loss(kind=cross_entropy, output=logits), autodiff").model
    return program, [str(w.message) for w in caught if str(w.message).startswith("autodiff")]


def peft_modules(model: torch.nn.Module, targets, exclude=None) -> set[str]:
    """The modules PEFT adapts in (a copy of) ``model`` for these targets."""
    config = peft.LoraConfig(r=2, target_modules=targets, exclude_modules=exclude)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Conv1D's fan_in_fan_out, set for it
        return set(peft.get_peft_model(copy.deepcopy(model), config).base_model.targeted_module_names)


def adapted(program: onnx.ModelProto) -> set[str]:
    return {a.module for a in ProgramRoles.read(program).lora}


# --------------------------------------------------------------------------- against PEFT


def test_all_linear_chooses_peft_modules(exported):
    """all-linear: every Linear and Conv1D but the model's output embeddings, as PEFT chooses
    them on the Hugging Face model itself (the wrapper adds ``inner.``)."""
    _, _, module, model = exported
    program, _ = compile_lora(model, "lora(r=2, targets='all-linear')")
    assert adapted(program) == {f"inner.{m}" for m in peft_modules(module.inner, "all-linear")}


#: per family: a list of targets, a regular expression, and a list to exclude from all-linear
CHOICES = {
    "gpt2": (["c_attn"], r".*\.c_(fc|proj)", ["mlp.c_proj"]),
    "llama": (["q_proj", "v_proj"], r".*\.(k|o)_proj", ["down_proj"]),
    "qwen2": (["q_proj", "v_proj"], r".*\.(k|o)_proj", ["down_proj"]),
    "mistral": (["q_proj", "v_proj"], r".*\.(k|o)_proj", ["down_proj"]),
    "phi": (["q_proj", "v_proj"], r".*\.(dense|fc1)", ["fc2"]),
    "opt": (["q_proj", "v_proj"], r".*\.(out_proj|fc1)", ["fc2"]),
    "bert": (["query", "value"], r".*\.attention\.output\.dense", ["intermediate.dense"]),
}


@pytest.mark.parametrize("how", ["list", "regex", "exclude"])
def test_targets_and_exclude_choose_peft_modules(exported, how):
    """A list matches names ending in an item, a string is a regular expression matched
    whole, exclude removes what it matches: PEFT's modules (its regular expressions here
    start with ``.*``, so the wrapper's ``inner.`` changes nothing)."""
    family, exporter, module, model = exported
    if exporter != "torchscript":
        pytest.skip("one export a family: the exports' names are checked by all-linear and the gradients")
    listed, regex, excluded = CHOICES[family]
    targets, exclude = {"list": (listed, None), "regex": (regex, None), "exclude": ("all-linear", excluded)}[how]
    spec = f"lora(r=2, targets={format_value(targets)}" + (f", exclude={format_value(exclude)})" if exclude else ")")
    program, _ = compile_lora(model, spec)
    want = peft_modules(module.inner, targets, exclude)
    assert want and adapted(program) == {f"inner.{m}" for m in want}


@pytest.mark.parametrize(
    "config", [{"r": 4, "alpha": 8.0, "rslora": False}, {"r": 3, "alpha": 5.0, "rslora": True}], ids=["r4", "rslora"]
)
def test_loss_and_adapter_gradients_equal_peft(exported, config):
    """Every linear layer but the head adapted; A copied from PEFT's initialization, B random
    in both: the loss and every adapter's gradients equal PEFT's within 1e-5 (relative to
    each gradient's largest element), and no frozen weight has a gradient output."""
    family, exporter, module, model = exported
    if config["rslora"] and exporter != "torchscript":
        pytest.skip("rslora is the scale alone: checked on one export per family")
    spec = f"lora(r={config['r']}, alpha={config['alpha']}, rslora={str(config['rslora']).lower()})"
    program, warned = compile_lora(model, spec)
    assert warned == []  # autodiff refuses nothing new, and warns of nothing
    adapters = ProgramRoles.read(program).lora
    tuned = _peft_model(module, [a.module for a in adapters], config)
    values = _adapter_values(tuned, adapters, seed=zlib.crc32(family.encode()))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))

    loss = torch.nn.functional.cross_entropy(tuned(ids), labels)
    loss.backward()
    expected = {n: p.grad.numpy() for n, p in _peft_parameters(tuned, adapters).items()}

    outputs = _run(_with_values(program, values), {"input_ids": ids.numpy(), "labels": labels.numpy()})
    np.testing.assert_allclose(outputs["loss"], loss.item(), rtol=1e-5)
    gradients = {o for o in outputs if o.endswith(roles.GRAD_SUFFIX)}
    assert gradients == {roles.grad_name(n) for n in expected}  # the adapters', no frozen weight's
    for name, want in expected.items():
        got = outputs[roles.grad_name(name)]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name
    assert all(a.scale == config["alpha"] / (math.sqrt(a.r) if config["rslora"] else a.r) for a in adapters)


def test_the_first_loss_is_the_base_models(exported):
    """B = 0: the adapted program's loss is the base model's, exactly."""
    _, _, _, model = exported
    feeds = {"input_ids": np.arange(BATCH * SEQ).reshape(BATCH, SEQ) % VOCAB, "labels": np.ones((BATCH, SEQ), np.int64)}
    base = graphforge.compile(model, "loss(kind=cross_entropy, output=logits), autodiff").model
    program, _ = compile_lora(model, "lora(r=4, alpha=16)")
    assert _run(program, feeds)["loss"] == _run(base, feeds)["loss"]


def test_the_roles_name_adapters_as_peft_and_record_the_layout(exported):
    """A [r, in] and B [out, r] named ``<module>.lora_A.weight``/``lora_B.weight``, the base
    weight frozen by the lora pass, and its layout: [in, out] (fan_in_fan_out) in a folded
    TorchScript export and for GPT-2's Conv1D, [out, in] through a Transpose elsewhere."""
    family, exporter, module, model = exported
    program, _ = compile_lora(model, "lora(r=2, alpha=4)")
    program_roles = ProgramRoles.read(program)
    shapes = {t.name: tuple(t.dims) for t in program.graph.initializer}
    torch_shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    for a in program_roles.lora:
        conv1d = family == "gpt2" and ".c_" in a.module  # Conv1D holds its weight [in, out]
        rows, cols = torch_shapes[f"{a.module}.weight"]
        in_features, out_features = (rows, cols) if conv1d else (cols, rows)
        assert shapes[a.a] == (2, in_features) and shapes[a.b] == (out_features, 2)
        assert (a.a, a.b) == (f"{a.module}.lora_A.weight", f"{a.module}.lora_B.weight")
        assert program_roles.frozen[a.weight].by == "lora"
        assert a.fan_in_fan_out == (conv1d or (exporter == "torchscript" and not a.weight.endswith(".weight")))
    assert set(program_roles.parameters) == {n for a in program_roles.lora for n in (a.a, a.b)}


def _peft_model(module: torch.nn.Module, modules: list[str], config: dict) -> torch.nn.Module:
    lora_config = peft.LoraConfig(r=config["r"], lora_alpha=config["alpha"], use_rslora=config["rslora"],
                                  target_modules=modules, lora_dropout=0.0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(copy.deepcopy(module), lora_config).eval()


def _peft_parameters(tuned: torch.nn.Module, adapters) -> dict[str, torch.nn.Parameter]:
    """graphforge's adapter name -> PEFT's parameter (``base_model.model.<module>.lora_A.default.weight``)."""
    params = dict(tuned.named_parameters())
    found = {}
    for a in adapters:
        for name, part in ((a.a, "lora_A"), (a.b, "lora_B")):
            found[name] = params[f"base_model.model.{a.module}.{part}.default.weight"]
    return found


def _adapter_values(tuned: torch.nn.Module, adapters, seed: int) -> dict[str, np.ndarray]:
    """PEFT's A as it initialized it, B set to random values in PEFT's model: both, by graphforge's names."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, p in _peft_parameters(tuned, adapters).items():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
            values[name] = p.detach().numpy().copy()
    return values


def _with_values(program: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(program)
    for i, t in enumerate(out.graph.initializer):
        if t.name in values:
            out.graph.initializer[i].CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    return out


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))
