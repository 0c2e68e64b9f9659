"""A LoRA program's export against PEFT, on random-initialized GPT-2 (Conv1D: weights [in, out])
and Llama (nn.Linear exported unfolded: weights [out, in], read through a Transpose) with nonzero
adapters: the merged model equals PEFT's ``merge_and_unload``, PEFT loads the exported folder and
computes the merged model's logits, onnxruntime's ``.onnx_adapter`` gives the merged model active
and the base model inactive, and ``lora(adapter=DIR)`` starts from PEFT's folder at PEFT's loss.
Then the refusals: one line, nothing written, the model untouched."""

from __future__ import annotations

import copy
import json
import shlex
import sys
import warnings

import models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _pages import page_block
from onnx import numpy_helper
from safetensors.numpy import load_file, save_file

import graphforge
import graphforge.train
from graphforge import roles
from graphforge.cli import main
from graphforge.errors import GraphforgeError
from graphforge.program import ProgramRoles

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

PAGE = "docs/guides/pytorch-export.md"
R, ALPHA = 4, 8.0
#: float32 rounding through a 1- or 2-layer model: the largest logit difference, relative to the largest logit
TOLERANCE = 1e-5
FAMILIES = ("gpt2", "llama")


class Case:
    """One family: its torch model (a wrapper whose ``inner`` is the Hugging Face model), the
    export, a compiled LoRA program with random nonzero A and B saved at ``program``, and PEFT's
    model with the same A and B."""

    def __init__(self, family: str, folder):
        if family == "gpt2":
            self.module, vocab = models.gpt2_module(), models.GPT2_CONFIG["vocab_size"]
            self.export = models.export_transformer(folder / "model.onnx")
            loss = "loss(kind=cross_entropy, output=logits, axis=-1)"
        else:
            self.module, vocab = models.llama_module(), models.LLAMA_VOCAB
            self.export = models.export_llama(folder / "model.onnx")
            loss = "loss(kind=cross_entropy, output=logits)"
        program = graphforge.compile(self.export, f"lora(r={R}, alpha={ALPHA}), {loss}, autodiff, adamw(lr=1e-3)").model
        self.adapters = ProgramRoles.read(program).lora
        rng = np.random.default_rng(len(family))
        for t in program.graph.initializer:
            if ".lora_" in t.name:
                t.CopyFrom(
                    numpy_helper.from_array((0.2 * rng.standard_normal(tuple(t.dims))).astype(np.float32), t.name)
                )
        self.values = {t.name: numpy_helper.to_array(t) for t in program.graph.initializer if ".lora_" in t.name}
        self.program = folder / "program.onnx"
        graphforge.save(program, self.program)
        self.peft = _peft_model(self.module, self.adapters, self.values)
        self.ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            self.merged = self.peft.merge_and_unload()  # the oracle (PEFT's merge, in place of its copy)
            self.merged_logits = self.merged(self.ids).numpy()


def _peft_model(module, adapters, values):
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=[a.module for a in adapters], lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Conv1D's fan_in_fan_out, set for it
        tuned = peft.get_peft_model(copy.deepcopy(module), config).eval()
    params = dict(tuned.named_parameters())
    with torch.no_grad():
        for a in adapters:
            for name, part in ((a.a, "lora_A"), (a.b, "lora_B")):
                params[f"base_model.model.{a.module}.{part}.default.weight"].copy_(
                    torch.from_numpy(values[name].copy())
                )
    return tuned


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def case_of(family: str) -> Case:
        if family not in made:
            made[family] = Case(family, tmp_path_factory.mktemp(family))
        return made[family]

    return case_of


def _weights(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each matrix initializer's type and shape, by name (a program's folded shape constants left out)."""
    return {t.name: (t.data_type, tuple(t.dims)) for t in model.graph.initializer if len(t.dims) == 2}


def _run(path, feeds, run_options=None) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], feeds, run_options)[0]


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_merged_export_is_peft_s_merge_and_unload(cases, family, tmp_path):
    """The plain model again: the export's initializers, each merged weight PEFT's merged
    weight in its own layout (within 1e-6), and PEFT's merged logits."""
    case = cases(family)
    report = graphforge.train.export(case.program, tmp_path / "merged.onnx")
    merged = onnx.load(str(report.path))
    assert not [n.name for n in merged.graph.node if n.name.startswith(roles.LORA_PREFIX)]
    base = onnx.load(str(graphforge.train.export(case.export, tmp_path / "base.onnx").path))  # as graphforge exports it
    assert _weights(merged) == _weights(base)
    products = [[n.op_type for n in m.graph.node if n.op_type in ("MatMul", "Gemm")] for m in (merged, base)]
    assert products[0] == products[1]  # the adapters' products gone
    assert not any(k.startswith("graphforge.lora") for k in (p.key for p in merged.metadata_props))
    stored = {t.name: numpy_helper.to_array(t) for t in merged.graph.initializer}
    torch_weights = dict(case.merged.named_parameters())
    for a in case.adapters:
        # GPT-2's Conv1D holds [in, out] as the export does; an unfolded Linear [out, in] as torch does
        want = torch_weights[a.weight].detach().numpy()
        assert stored[a.weight].dtype == np.float32
        np.testing.assert_allclose(stored[a.weight], want, rtol=0, atol=1e-6)
    _close(_run(report.path, {"input_ids": case.ids.numpy()}), case.merged_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_the_exported_adapters(cases, family, tmp_path):
    """PEFT's keys and layouts, its config, and PeftModel.from_pretrained on the torch model
    gives the merged export's logits."""
    case = cases(family)
    report = graphforge.train.export_peft(case.program, tmp_path / "adapter", base_model="tiny-" + family)
    tensors = load_file(str(report.folder / "adapter_model.safetensors"))
    for a in case.adapters:
        np.testing.assert_array_equal(tensors[f"base_model.model.{a.module}.lora_A.weight"], case.values[a.a])
        np.testing.assert_array_equal(tensors[f"base_model.model.{a.module}.lora_B.weight"], case.values[a.b])
    assert len(tensors) == 2 * len(case.adapters)
    config = json.loads((report.folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == ("LORA", R, 8, False)
    assert config["fan_in_fan_out"] == (family == "gpt2") and config["base_model_name_or_path"] == "tiny-" + family
    assert sorted(config["target_modules"]) == sorted(a.module for a in case.adapters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(case.module), str(report.folder)).eval()
    merged = graphforge.train.export(case.program, tmp_path / "merged.onnx").path
    with torch.no_grad():
        _close(loaded(case.ids).numpy(), _run(merged, {"input_ids": case.ids.numpy()}))


def test_the_onnx_adapter_is_the_merged_model_active_and_the_base_inactive(cases, tmp_path):
    """onnxruntime's own LoraAdapter over the exported file, through RunOptions."""
    case = cases("llama")
    report = graphforge.train.export(case.program, tmp_path / "adapted.onnx", adapters="onnx")
    assert report.adapter_file == tmp_path / "adapted.onnx_adapter"
    feeds = {"input_ids": case.ids.numpy()}
    adapter = ort.LoraAdapter()
    adapter.Load(str(report.adapter_file))
    active = ort.RunOptions()
    active.add_active_adapter(adapter)
    _close(_run(report.path, feeds, active), case.merged_logits)
    inactive = _run(report.path, feeds)
    np.testing.assert_allclose(inactive, _run(case.export, feeds), rtol=0, atol=1e-6)
    assert not np.allclose(inactive, case.merged_logits, atol=1e-3)  # the adapters change the logits


def test_lora_starts_from_a_peft_folder_at_peft_s_loss(cases, tmp_path):
    """A folder PEFT saved from the Hugging Face model itself (its names lack the wrapper's
    ``inner.``): the program's first loss is PEFT's, and r and alpha are the folder's."""
    case = cases("gpt2")
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["c_attn", "c_fc"], lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuned = peft.get_peft_model(copy.deepcopy(case.module.inner), config)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    tuned.save_pretrained(str(tmp_path / "adapter"))
    labels = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = tuned(input_ids=case.ids, attention_mask=torch.ones_like(case.ids)).logits
        want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels).item()
    pipeline = f"lora(adapter='{tmp_path / 'adapter'}'), loss(kind=cross_entropy, output=logits, axis=-1), autodiff"
    program = graphforge.compile(case.export, pipeline).model
    session = ort.InferenceSession(program.SerializeToString(), providers=["CPUExecutionProvider"])
    (loss,) = session.run(["loss"], {"input_ids": case.ids.numpy(), "labels": labels.numpy()})
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    adapters = ProgramRoles.read(program).lora
    assert {(a.module, a.r, a.alpha) for a in adapters} == {
        (f"inner.transformer.h.0.{m}", 2, 6.0) for m in ("attn.c_attn", "mlp.c_fc")
    }


# --------------------------------------------------------------------------- small cases and refusals


def _folder(path, a_shape=(2, 4), b_shape=(8, 2), module="w1", **config):
    """A PEFT folder for tanh_mlp's w1 (4 in, 8 out), written as PEFT writes one."""
    path.mkdir()
    rng = np.random.default_rng(3)
    save_file({f"base_model.model.{module}.lora_A.weight": rng.standard_normal(a_shape).astype(np.float32),
               f"base_model.model.{module}.lora_B.weight": rng.standard_normal(b_shape).astype(np.float32)},
              str(path / "adapter_model.safetensors"))  # fmt: skip
    settings = {"peft_type": "LORA", "r": a_shape[0], "lora_alpha": 3, "target_modules": [module], **config}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


def test_lora_merge_folds_a_folder_s_adapter_into_the_plain_model(tmp_path):
    """``lora(adapter=DIR), lora_merge``: what the adapted model computes (onnxruntime), with
    the base's nodes and initializers and no role left."""
    folder = _folder(tmp_path / "adapter")
    adapted = graphforge.compile(models.tanh_mlp(), f"lora(adapter='{folder}')").model
    merged = graphforge.compile(adapted, "lora_merge").model
    base = models.tanh_mlp()
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in base.graph.node]
    assert {p.key for p in merged.metadata_props} == {p.key for p in base.metadata_props}
    x = np.random.default_rng(4).standard_normal((5, 4)).astype(np.float32)
    want = models.run(adapted, {"x": x})["y"]
    np.testing.assert_allclose(models.run(merged, {"x": x})["y"], want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(models.run(base, {"x": x})["y"], want)  # the adapter changes what it computes


@pytest.mark.parametrize(
    ("spec", "folder", "message"),
    [
        ("", {"a_shape": (2, 5)}, "the adapter of 'w1' does not fit it: lora_A [2, 5] and lora_B [8, 2], "
         "where the layer (4 in, 8 out) takes [2, 4] and [8, 2]"),
        ("", {"module": "w9"}, "module 'w9' is no linear layer of the model (its layers: w1, w2)"),
        (", r=3", {}, "r=3 disagrees with the folder's 2 (adapter_config.json); leave r out to take the folder's"),
        (", targets=[w2]", {}, "the folder's weights name the modules; leave targets and exclude out"),
        ("", {"use_dora": True}, "use_dora set; graphforge starts from plain LoRA adapters"),
    ],
    ids=["shapes", "module", "r", "targets", "dora"],
)  # fmt: skip
def test_a_folder_that_does_not_fit_is_refused_and_the_model_untouched(tmp_path, spec, folder, message):
    path = _folder(tmp_path / "adapter", **folder)
    model = models.tanh_mlp()
    before = model.SerializeToString()
    with pytest.raises(GraphforgeError) as info:
        graphforge.compile(model, f"lora(adapter='{path}'{spec})")
    assert message in str(info.value) and "\n" not in str(info.value)
    assert model.SerializeToString() == before


def test_the_cli_refuses_adapters_of_a_program_without_and_writes_nothing(tmp_path, monkeypatch, capsys):
    graphforge.save(graphforge.compile(models.tanh_mlp(), "loss(kind=mse, output=y), autodiff, sgd").model,
                    tmp_path / "program.onnx")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    for how in ("peft", "onnx"):
        monkeypatch.setattr(sys, "argv", ["graphforge", "export", "program.onnx", "--adapters", how, "-o", "out"])
        with pytest.raises(SystemExit) as info:
            main()
        assert info.value.code == 2
        error = capsys.readouterr().err.strip()
        assert error == f"error: --adapters {how}: program.onnx has no LoRA adapters (compile it with the lora pass)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["program.onnx"]


def test_the_export_guides_adapter_blocks_run(tmp_path, monkeypatch, capsys):
    """docs/guides/pytorch-export.md: the LoRA block, then the export's Python block and its
    commands (run in this process), as written in a fresh folder."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in (page_block(PAGE, "python", "lora(r=4, alpha=8)"), page_block(PAGE, "python", "export_peft")):
            exec(compile(block, PAGE, "exec", dont_inherit=True), namespace)
    capsys.readouterr()
    for line in page_block(PAGE, "sh", "--adapters peft").splitlines():
        monkeypatch.setattr(sys, "argv", shlex.split(line.split("#")[0]))
        with pytest.raises(SystemExit) as info:
            main()
        assert info.value.code == 0, capsys.readouterr().err
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    assert (tmp_path / "adapted.onnx_adapter").is_file() and (tmp_path / "merged.onnx").is_file()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(models.run("merged.onnx", {"x": x})["logits"],
                               models.run("program-merged.onnx", {"x": x})["logits"], rtol=1e-6, atol=1e-6)  # fmt: skip


def test_the_peft_folder_on_a_file_is_refused_in_one_line_and_the_file_kept(tmp_path, monkeypatch, capsys):
    graphforge.save(graphforge.compile(models.tanh_mlp(), "lora(r=2, targets=[w1]), loss(kind=mse, output=y), "
                                       "autodiff, sgd").model, tmp_path / "program.onnx")  # fmt: skip
    (tmp_path / "taken").write_text("mine")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["graphforge", "export", "program.onnx", "--adapters", "peft", "-o", "taken"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --adapters peft: taken is a file, not a folder"
    assert (tmp_path / "taken").read_text() == "mine"
