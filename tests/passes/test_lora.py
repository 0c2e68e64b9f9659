"""The lora pass against PEFT: on random-initialized Hugging Face models of seven families,
exported by torch's TorchScript exporter (and by its dynamo exporter for GPT-2 and Llama),
graphforge's adapters choose PEFT's modules, and with the same A and B values give PEFT's
loss and adapter gradients; the base trains nothing. Then the pass's own cases on small
hand-written models: scale, dropout on the adapter's input alone, initialization, dtype,
roles, and the errors."""

from __future__ import annotations

import copy
import math
import re
import warnings
import zlib
from pathlib import Path

import models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _pages import page_block, run_block
from graphforge.passes.lora_layers import module_path, torchscript_scope
from onnx import TensorProto, helper, numpy_helper

import graphforge
from graphforge import roles
from graphforge.errors import GraphforgeError
from graphforge.pass_spec import format_value
from graphforge.program import ProgramRoles
from graphforge.train.logs import read_jsonl

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]
PAGE = "docs/guides/pytorch-export.md"
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
#: (``Transpose(weight)``); dynamo (optimize=False) where the repository's tests use it, and with
#: its optimizer once (weights folded into ``val_<n>`` [in, out], named by the nodes' metadata)
EXPORTS = [*((f, "torchscript") for f in FAMILIES), ("llama", "torchscript-unfolded"), ("gpt2", "dynamo"),
           ("llama", "dynamo"), ("qwen2", "dynamo-optimized")]  # fmt: skip


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
        if exporter.startswith("dynamo"):
            dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
            torch.onnx.export(module, (example,), str(path), dynamo=True, optimize=exporter == "dynamo-optimized",
                              opset_version=18,
                              input_names=["input_ids"], output_names=["logits"], dynamic_shapes=(dims,),
                              external_data=False, verbose=False)  # fmt: skip
        else:
            torch.onnx.export(module, (example,), str(path), dynamo=False, opset_version=17,
                              do_constant_folding=exporter == "torchscript", input_names=["input_ids"],
                              output_names=["logits"],
                              dynamic_axes={"input_ids": {0: "b", 1: "t"}, "logits": {0: "b", 2: "t"}})  # fmt: skip
    return onnx.load(str(path))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(family, exporter) -> (the torch module, its export), each made once for the module's tests."""
    made = {}

    def export_of(family: str, exporter: str):
        if (family, exporter) not in made:
            module = Logits(hf_model(family))
            path = tmp_path_factory.mktemp(f"{family}-{exporter}") / "model.onnx"
            made[family, exporter] = module, export(module, path, exporter)
        return made[family, exporter]

    return export_of


EACH_EXPORT = pytest.mark.parametrize(("family", "exporter"), EXPORTS, ids=["-".join(e) for e in EXPORTS])


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


@EACH_EXPORT
def test_all_linear_chooses_peft_modules(exports, family, exporter):
    """all-linear: every Linear and Conv1D but the model's output embeddings, as PEFT chooses
    them on the Hugging Face model itself (the wrapper adds ``inner.``)."""
    module, model = exports(family, exporter)
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
@pytest.mark.parametrize("family", FAMILIES)
def test_targets_and_exclude_choose_peft_modules(exports, family, how):
    """A list matches names ending in an item, a string is a regular expression matched
    whole, exclude removes what it matches: PEFT's modules (its regular expressions here
    start with ``.*``, so the wrapper's ``inner.`` changes nothing). One export a family: the
    others' names are checked by all-linear and the gradients."""
    module, model = exports(family, "torchscript")
    listed, regex, excluded = CHOICES[family]
    targets, exclude = {"list": (listed, None), "regex": (regex, None), "exclude": ("all-linear", excluded)}[how]
    spec = f"lora(r=2, targets={format_value(targets)}" + (f", exclude={format_value(exclude)})" if exclude else ")")
    program, _ = compile_lora(model, spec)
    want = peft_modules(module.inner, targets, exclude)
    assert want and adapted(program) == {f"inner.{m}" for m in want}


#: r = 4, alpha = 8 on every export; r = 3, alpha = 5 with rsLoRA's scale on one export a family
GRADIENT_CASES = [
    *((f, e, {"r": 4, "alpha": 8.0, "rslora": False}) for f, e in EXPORTS),
    *((f, "torchscript", {"r": 3, "alpha": 5.0, "rslora": True}) for f in FAMILIES),
]


@pytest.mark.parametrize(
    ("family", "exporter", "config"),
    GRADIENT_CASES,
    ids=[f"{f}-{e}-{'rslora' if c['rslora'] else 'r4'}" for f, e, c in GRADIENT_CASES],
)
def test_loss_and_adapter_gradients_equal_peft(exports, family, exporter, config):
    """Every linear layer but the head adapted; A copied from PEFT's initialization, B random
    in both: the loss and every adapter's gradients equal PEFT's within 1e-5 (relative to
    each gradient's largest element), and no frozen weight has a gradient output."""
    module, model = exports(family, exporter)
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


@EACH_EXPORT
def test_the_first_loss_is_the_base_models(exports, family, exporter):
    """B = 0: the adapted program's loss is the base model's, exactly."""
    _, model = exports(family, exporter)
    feeds = {"input_ids": np.arange(BATCH * SEQ).reshape(BATCH, SEQ) % VOCAB, "labels": np.ones((BATCH, SEQ), np.int64)}
    base = graphforge.compile(model, "loss(kind=cross_entropy, output=logits)").model
    program, _ = compile_lora(model, "lora(r=4, alpha=16)")
    assert _run(program, feeds)["loss"] == _run(base, feeds)["loss"]


@EACH_EXPORT
def test_the_roles_name_adapters_as_peft_and_record_the_layout(exports, family, exporter):
    """A [r, in] and B [out, r] named ``<module>.lora_A.weight``/``lora_B.weight``, the base
    weight frozen by the lora pass, and its layout: [in, out] (fan_in_fan_out) in a folded
    TorchScript export and for GPT-2's Conv1D, [out, in] through a Transpose elsewhere."""
    module, model = exports(family, exporter)
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
        folded = exporter in ("torchscript", "dynamo-optimized") and not a.weight.endswith(".weight")
        assert a.fan_in_fan_out == (conv1d or folded)
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


# --------------------------------------------------------------------------- the pass's own cases


def _mlp_program(spec: str, **changes) -> onnx.ModelProto:
    return graphforge.compile(models.tanh_mlp(**changes), spec).model


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_torchscript_scopes_become_module_paths():
    """A scope is the call path; the named parameters a scope's nodes read map it to the module
    path, and the longest prefix a known pair rewrites carries over to scopes without one."""
    assert torchscript_scope("/inner/decoder/layers.0/fc1/Gemm") == "inner.decoder.layers.0.fc1"
    assert torchscript_scope("/MatMul") is None and torchscript_scope("node_linear_3") is None
    known = {"inner.decoder.layers.0.fc1": "inner.model.decoder.layers.0.fc1", "inner.head": "inner.head"}
    assert module_path("inner.decoder.layers.0.fc1", known) == "inner.model.decoder.layers.0.fc1"
    assert (
        module_path("inner.decoder.layers.1.self_attn.q_proj", known) == "inner.model.decoder.layers.1.self_attn.q_proj"
    )
    assert module_path("inner.lm_head", known) == "inner.lm_head"  # no pair rewrites it


def test_dropout_drops_the_adapters_input_alone():
    """With dropout p, the layer computes x·W + b + scale · ((x ⊙ mask / (1 - p)) · Aᵀ) · Bᵀ with
    the Dropout's own mask (fetched from the run): the base product reads x undropped."""
    p, scale = 0.5, 3.0 / 2
    program = _mlp_program(f"lora(r=2, alpha=3, targets=[w1], dropout={p})")
    (dropout,) = [n for n in program.graph.node if n.op_type == "Dropout"]
    assert dropout.input[0] == "x" and dropout.name.startswith(roles.LORA_PREFIX)
    values = _initializers(program)
    values["w1.lora_B.weight"] = np.random.default_rng(5).standard_normal((8, 2)).astype(np.float32)
    dropout.output.append("mask")
    program.graph.output.extend(
        [helper.make_tensor_value_info("mask", TensorProto.BOOL, None), helper.make_tensor_value_info("h1", 1, None)]
    )
    x = np.random.default_rng(6).standard_normal((64, 4)).astype(np.float32)
    out = _run(_with_values(program, values), {"x": x})
    mask = out["mask"]
    assert 0.3 < mask.mean() < 0.7  # a mask, neither all kept nor all dropped
    adapter_input = x * mask / (1 - p)
    delta = scale * (adapter_input @ values["w1.lora_A.weight"].T) @ values["w1.lora_B.weight"].T
    expected = x @ values["w1"] + delta + values["b1"]
    np.testing.assert_allclose(out["h1"], expected, rtol=1e-5, atol=1e-5)


def test_initialization_is_peft_s_and_seeded():
    """peft: A uniform in ±1/√in (std bound/√3), B zero; gaussian: A normal with std 1/r; the
    seed decides the draw. On a 256-in layer of rank 16: 4,096 draws."""
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], "one", [helper.make_tensor_value_info("x", 1, ["N", 256])],
            [helper.make_tensor_value_info("y", 1, ["N", 32])],
            [numpy_helper.from_array(np.ones((256, 32), np.float32), "w")],
        ),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
    )  # fmt: skip
    peft_a = _initializers(graphforge.compile(model, "lora(r=16, targets=[w])").model)
    bound = 1 / 16  # 1/√256
    a = peft_a["w.lora_A.weight"]
    assert a.shape == (16, 256) and np.abs(a).max() <= bound
    assert abs(a.std() / (bound / np.sqrt(3)) - 1) < 0.05
    assert not peft_a["w.lora_B.weight"].any() and peft_a["w.lora_B.weight"].shape == (32, 16)
    gaussian = _initializers(graphforge.compile(model, "lora(r=16, targets=[w], init=gaussian)").model)
    assert abs(gaussian["w.lora_A.weight"].std() * 16 - 1) < 0.05
    again = _initializers(graphforge.compile(model, "lora(r=16, targets=[w])").model)["w.lora_A.weight"]
    other = _initializers(graphforge.compile(model, "lora(r=16, targets=[w], seed=1)").model)["w.lora_A.weight"]
    assert np.array_equal(again, a) and not np.array_equal(other, a)


def test_float16_adapters_compute_in_float16_and_add_in_the_base_type():
    values_32 = None
    outputs = {}
    for dtype in ("float32", "float16"):
        program = _mlp_program(f"lora(r=2, alpha=4, targets=[w1, w2], dtype={dtype})")
        types = {t.name: t.data_type for t in program.graph.initializer}
        expected = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
        assert types["w1.lora_A.weight"] == types["w2.lora_B.weight"] == expected
        assert types["w1"] == TensorProto.FLOAT  # the base keeps its type
        values = _initializers(program)
        if values_32 is None:
            rng = np.random.default_rng(7)
            values["w1.lora_B.weight"] = rng.standard_normal((8, 2)).astype(np.float32)
            values["w2.lora_B.weight"] = rng.standard_normal((3, 2)).astype(np.float32)
            values_32 = values
        else:
            values = {k: v.astype(np.float16) if k in types and ".lora_" in k else v for k, v in values_32.items()}
        x = np.random.default_rng(8).standard_normal((5, 4)).astype(np.float32)
        outputs[dtype] = _run(_with_values(program, values), {"x": x})["y"]
    assert outputs["float16"].dtype == np.float32
    np.testing.assert_allclose(outputs["float16"], outputs["float32"], rtol=1e-2, atol=1e-2)
    assert not np.array_equal(outputs["float16"], outputs["float32"])  # computed in float16 indeed


def test_bfloat16_adapters_are_stored_as_bfloat16():
    """onnxruntime's CPU has no bfloat16 MatMul: the program is checked, not run, here."""
    program = _mlp_program("lora(r=2, targets=[w1], dtype=bfloat16)")
    types = {t.name: t.data_type for t in program.graph.initializer}
    assert types["w1.lora_A.weight"] == types["w1.lora_B.weight"] == TensorProto.BFLOAT16
    casts = [n for n in program.graph.node if n.op_type == "Cast" and n.name.startswith(roles.LORA_PREFIX)]
    assert sorted(helper.get_attribute_value(n.attribute[0]) for n in casts) == [
        TensorProto.FLOAT,
        TensorProto.BFLOAT16,
    ]
    assert ProgramRoles.read(program).lora[0].dtype == "bfloat16"
    with pytest.raises(GraphforgeError, match=r"parameter 'w1\.lora_A\.weight' is bfloat16: the optimizers update"):
        _mlp_program("lora(r=2, targets=[w1], dtype=bfloat16), loss(kind=mse, output=y), autodiff, adamw")


def test_the_roles_and_the_note():
    result = graphforge.compile(models.tanh_mlp(), "lora(r=2, alpha=3, targets=[w1, w2], rslora=true)")
    adapters = ProgramRoles.read(result.model).lora
    assert [(a.module, a.weight, a.r, a.alpha, a.fan_in_fan_out) for a in adapters] == [
        ("w1", "w1", 2, 3.0, True),
        ("w2", "w2", 2, 3.0, True),
    ]
    assert adapters[0].scale == 3 / math.sqrt(2) and adapters[0].rslora
    assert result.records[0].note == "2 adapters of rank 2 (46 parameters)"  # 2·(4+8) + 2·(8+3)


def test_two_lora_passes_adapt_two_sets_of_modules_at_their_own_ranks():
    """As PEFT's rank_pattern: each pass's adapters keep their rank and scale, and the second
    pass freezes the base, not the first pass's adapters."""
    program = _mlp_program("lora(r=2, alpha=2, targets=[w1]), lora(r=3, alpha=6, targets=[w2]), "
                           "loss(kind=mse, output=y), autodiff")  # fmt: skip
    program_roles = ProgramRoles.read(program)
    assert [(a.module, a.r, a.scale) for a in program_roles.lora] == [("w1", 2, 1.0), ("w2", 3, 2.0)]
    assert set(program_roles.parameters) == {f"{m}.lora_{x}.weight" for m in ("w1", "w2") for x in "AB"}
    assert set(program_roles.frozen) == {"w1", "b1", "w2", "b2"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("lora(targets=[w3])", "targets pattern 'w3' matches no linear layer; the closest names: w"),
        (
            "lora(targets=['q_proj'])",
            "targets pattern 'q_proj' matches no linear layer; the closest names: w",
        ),
        ("lora(targets='w[3-9]')", "targets pattern 'w[3-9]' matches no linear layer"),
        ("lora(targets=[w1], exclude=[w9])", "exclude pattern 'w9' matches no linear layer"),
        ("lora(targets=[w1], exclude=[w1])", "exclude=[w1] removes every layer targets=[w1] chose"),
        ("lora(r=0)", "pass 'lora' parameter 'r': expected a finite number ≥ 1, got 0"),
        ("lora(r=2.5)", "pass 'lora' parameter 'r': expected int, got '2.5'"),
        ("lora(alpha=0)", "pass 'lora' parameter 'alpha': expected a finite number > 0, got 0"),
        ("lora(dropout=1)", "pass 'lora' parameter 'dropout': expected a number in [0, 1), got 1"),
        ("lora(targets=[])", "pass 'lora' parameter 'targets': name at least one module, or all-linear"),
        ("lora(targets='(')", "pass 'lora' parameter 'targets': '(' is no regular expression"),
        ("lora(init=kaiming)", "pass 'lora' parameter 'init'"),
        ("lora(targets=[w1]), lora(targets=[w1])", "module 'w1' has an adapter already"),
        (
            "lora(targets=[w1]), loss(kind=mse, output=y), autodiff, lora",
            "lora does not work on a model with the gradients",
        ),
    ],
)
def test_bad_input_is_one_clear_error_and_the_model_is_untouched(spec, message):
    model = models.tanh_mlp()
    before = model.SerializeToString()
    with pytest.raises(GraphforgeError) as info:
        graphforge.compile(model, spec)
    assert message in str(info.value)
    assert model.SerializeToString() == before


def test_all_linear_refuses_a_model_whose_only_layer_is_its_head():
    head = models.parse("""
        <ir_version: 8, opset_import: ["" : 17]>
        head (float[N, 4] x) => (float[N, 3] y) <float[4, 3] w = {0,1,2,3,4,5,6,7,8,9,10,11}, float[3] b = {1,2,3}>
        { p = MatMul (x, w)  y = Add (p, b) }
    """)  # fmt: skip
    with pytest.raises(
        GraphforgeError, match="all-linear leaves no layer: the model's only linear layers are its output head"
    ):
        graphforge.compile(head, "lora")
    assert adapted(graphforge.compile(models.tanh_mlp(), "lora").model) == {"w1"}  # w2 (+ b2) is the head


def test_a_lora_program_trains_under_graphforge_train(tmp_path):
    """The digits demo's config with lora (dropout 0.1) before its loss, for 2 epochs: the loss falls, and
    only the adapters (and their states) are carried."""
    import graphforge.train

    demo = REPO / "examples/digits"
    text = (demo / "train.toml").read_text()
    text = text.replace('path = "model.onnx"', f'path = "{demo / "model.onnx"}"')
    text = text.replace('pipeline = "', 'pipeline = "lora(r=8, alpha=16, targets=[fc1, fc2], dropout=0.1), ')
    text = text.replace('"../../data/', f'"{REPO / "data"}/')
    text = re.sub(r"(?m)^epochs = \d+", "epochs = 2", text)
    (tmp_path / "train.toml").write_text(text)
    result = graphforge.train.run(tmp_path / "train.toml", out=tmp_path / "out", quiet=True)
    losses = [r["loss"] for r in read_jsonl(result.log) if "loss" in r]
    assert result.step == 90 and losses[-1] < 0.5 * losses[0], losses
    program_roles = ProgramRoles.read(result.program)
    assert {c.like or c.input for c in program_roles.carried} == {n for a in program_roles.lora for n in (a.a, a.b)}


def test_the_export_guides_lora_block_runs(tmp_path, monkeypatch, capsys):
    """docs/guides/pytorch-export.md's LoRA block, as written in a fresh folder: all-linear adapts
    the two hidden layers (not the head), and they alone train."""
    block = page_block(PAGE, "python", "lora(r=4, alpha=8)")
    monkeypatch.chdir(tmp_path)
    namespace = run_block(PAGE, block)
    printed = capsys.readouterr().out.strip()
    assert printed == "('0.lora_A.weight', '0.lora_B.weight', '2.lora_A.weight', '2.lora_B.weight')"
    assert printed in block  # the page says what it prints
    frozen = ProgramRoles.read(namespace["program"]).frozen
    assert set(frozen) == {f"{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias")}
