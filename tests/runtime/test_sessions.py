"""Sessions: which execution providers work here, the session factory, and its environment overrides."""

from __future__ import annotations

import os
import tempfile

import models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _io_models import affine_model, inputs, relu_model, set_location

import graphforge
from graphforge import ort_compat, payloads
from graphforge.errors import GraphforgeError, InvalidModelError, ModelLoadError
from graphforge.model_io import load, save
from graphforge.ort_compat import runtime_limits
from graphforge.runtime import sessions
from graphforge.runtime.sessions import CPU, CUDA, available_providers, create_session, session_options

NO_CUDA_DEVICE = not ort_compat.cuda_driver_has_device()


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No override from the surrounding shell, and provider probes re-run in every test."""
    monkeypatch.delenv("GRAPHFORGE_PROVIDERS", raising=False)
    monkeypatch.delenv("GRAPHFORGE_THREADS", raising=False)
    sessions.provider_works.cache_clear()
    yield
    sessions.provider_works.cache_clear()


def affine_reference(x, w, b):
    return x @ w + b


# --------------------------------------------------------------------------- providers


@pytest.mark.skipif(not NO_CUDA_DEVICE, reason="a CUDA device answers here")
def test_available_providers_without_a_cuda_device_is_cpu_only_and_silent(capfd):
    ort_compat.runtime_limits.cache_clear()
    assert CUDA in ort.get_available_providers()  # onnxruntime-gpu lists it all the same
    assert available_providers() == [CPU]
    session = create_session(relu_model())
    x = inputs(shape=(2, 3))
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x, 0))
    assert session.get_providers() == [CPU]
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_available_providers_ends_with_the_cpu():
    providers = available_providers()
    assert providers[-1] == CPU
    assert providers in ([CPU], [CUDA, CPU])


def test_failing_provider_probe_prints_nothing(capfd, monkeypatch):
    """The probe for a provider whose libraries cannot load (CUDA here) must swallow what
    onnxruntime writes to fds 1 and 2; the control shows onnxruntime does write it."""
    if CUDA not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider to probe")
    options = ort.SessionOptions()
    options.log_severity_level = 4
    control = ort.InferenceSession(
        relu_model_bytes(), options, providers=[CUDA, CPU]
    )  # onnxruntime's own logger, not the session's, reports the library failure
    out, err = capfd.readouterr()
    if control.get_providers()[0] == CUDA:
        pytest.skip("CUDA works here: no failing probe to silence")
    if not (out or err):
        pytest.skip("onnxruntime printed nothing for a failing CUDA provider here")
    monkeypatch.setattr(ort_compat, "cuda_driver_has_device", lambda: True)  # get past the driver check
    assert sessions.provider_works(CUDA) is False
    assert capfd.readouterr() == ("", "")
    print("after the probe")  # fds 1 and 2 are back
    os.write(2, b"stderr after the probe\n")
    assert capfd.readouterr() == ("after the probe\n", "stderr after the probe\n")


def relu_model_bytes() -> bytes:
    model = relu_model()
    ort_compat.make_runtime_compatible(model)
    return model.SerializeToString()


@pytest.mark.parametrize(
    "value", ["cpu", "CPU", " cpu ", "CPUExecutionProvider", "cpu,cpu", "cpu, CPUExecutionProvider,"]
)
def test_providers_override_cpu(monkeypatch, value):
    monkeypatch.setenv("GRAPHFORGE_PROVIDERS", value)
    assert available_providers() == [CPU]
    assert create_session(relu_model()).get_providers() == [CPU]


def test_providers_override_unknown_lists_the_available_ones(monkeypatch, capfd):
    monkeypatch.setenv("GRAPHFORGE_PROVIDERS", "cpu,NoSuchExecutionProvider")
    expected = (
        "$GRAPHFORGE_PROVIDERS names NoSuchExecutionProvider, which this onnxruntime does not have; "
        f"it has: {', '.join(ort.get_available_providers())}"
    )
    with pytest.raises(GraphforgeError) as info:
        available_providers()
    assert str(info.value) == expected
    with pytest.raises(GraphforgeError) as info:
        create_session(relu_model())
    assert str(info.value) == expected
    assert capfd.readouterr() == ("", "")


def test_providers_override_naming_nothing(monkeypatch):
    monkeypatch.setenv("GRAPHFORGE_PROVIDERS", " , ,")
    with pytest.raises(GraphforgeError) as info:
        available_providers()
    assert str(info.value) == (
        f"$GRAPHFORGE_PROVIDERS names no execution provider; this onnxruntime has: {', '.join(ort.get_available_providers())}"
    )


@pytest.mark.skipif(not NO_CUDA_DEVICE, reason="a CUDA device answers here")
@pytest.mark.parametrize("value", ["cuda", "CUDAExecutionProvider,cpu"])
def test_providers_override_cuda_without_a_device(monkeypatch, capfd, value):
    if CUDA not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider")
    monkeypatch.setenv("GRAPHFORGE_PROVIDERS", value)
    with pytest.raises(GraphforgeError) as info:
        create_session(relu_model())
    assert str(info.value) == "$GRAPHFORGE_PROVIDERS asks for CUDA, but no CUDA device is usable on this machine"
    assert capfd.readouterr() == ("", "")


@pytest.mark.skipif(not NO_CUDA_DEVICE, reason="a CUDA device answers here")
def test_listed_provider_that_does_not_work_is_refused_quietly(monkeypatch, capfd):
    """onnxruntime-gpu lists TensorRT; asking for it used to print an "EP Error" banner and
    silently run on the CPU."""
    if sessions.TENSORRT not in ort.get_available_providers():
        pytest.skip("this onnxruntime does not list TensorRT")
    monkeypatch.setenv("GRAPHFORGE_PROVIDERS", "tensorrt")
    with pytest.raises(GraphforgeError) as info:
        create_session(relu_model())
    assert str(info.value) == (
        "$GRAPHFORGE_PROVIDERS asks for TensorrtExecutionProvider, which this onnxruntime lists but which does not "
        "work here"
    )
    assert capfd.readouterr() == ("", "")


def test_explicit_providers_are_checked_like_the_override(capfd):
    with pytest.raises(GraphforgeError) as info:
        create_session(relu_model(), providers=["Bogus"])
    assert str(info.value).startswith("providers names Bogus, which this onnxruntime does not have; it has: ")
    if NO_CUDA_DEVICE and CUDA in ort.get_available_providers():
        with pytest.raises(GraphforgeError) as info:
            create_session(relu_model(), providers=[CUDA])
        assert str(info.value) == "providers asks for CUDA, but no CUDA device is usable on this machine"
    assert capfd.readouterr() == ("", "")
    session = create_session(relu_model(), providers=[(CPU, {}), "cpu"])
    assert session.get_providers() == [CPU]


def test_explicit_providers_win_over_the_override(monkeypatch):
    monkeypatch.setenv("GRAPHFORGE_PROVIDERS", "NoSuchExecutionProvider")
    assert create_session(relu_model(), providers=["cpu"]).get_providers() == [CPU]


# --------------------------------------------------------------------------- CUDA provider options


def test_cuda_defaults_fill_in_what_the_entry_leaves_out(monkeypatch):
    monkeypatch.delenv(sessions.ENV_TF32, raising=False)
    given = [CUDA, (CUDA, {"device_id": "1", "use_tf32": "1"}), CPU, (CPU, {})]
    assert sessions.cuda_defaults(given) == [
        (CUDA, {"use_tf32": "0", "arena_extend_strategy": "kSameAsRequested"}),
        (CUDA, {"use_tf32": "1", "arena_extend_strategy": "kSameAsRequested", "device_id": "1"}),
        CPU,
        (CPU, {}),
    ]
    assert given[1] == (CUDA, {"device_id": "1", "use_tf32": "1"})  # the caller's entry is not changed


@pytest.mark.parametrize("value, expected", [("1", "1"), ("0", "0"), ("yes", "0"), ("", "0")])
def test_tf32_is_turned_on_only_by_the_variable_set_to_1(monkeypatch, value, expected):
    monkeypatch.setenv(sessions.ENV_TF32, value)
    assert sessions.cuda_defaults([CUDA]) == [
        (CUDA, {"use_tf32": expected, "arena_extend_strategy": "kSameAsRequested"})
    ]


def test_the_sessions_of_a_device_share_one_arena(monkeypatch):
    """CPU: one arena in onnxruntime's environment, which each session is told to use. CUDA
    (wired here; its memory is measured on a GPU): one per device, registered with that device's
    id and the strategy of each session's own arena; where onnxruntime refuses, sessions keep
    their own."""
    options = ort.SessionOptions()
    assert sessions.share_arena(options)
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    calls = []
    monkeypatch.setattr(sessions, "_shared_arenas", {})
    monkeypatch.setattr(ort, "create_and_register_allocator_v2", lambda *args: calls.append(args))
    cuda = ort.SessionOptions()
    assert sessions.share_arena(cuda, "cuda", 1) and sessions.share_arena(ort.SessionOptions(), "cuda", 1)
    ((provider, info, provider_options, _),) = calls  # registered once for the device
    assert (provider, info.name, info.device_id, provider_options) == (CUDA, "Cuda", 1, {"device_id": "1"})
    assert cuda.get_session_config_entry("session.use_env_allocators") == "1"

    def refused(*args):
        raise ort.capi.onnxruntime_pybind11_state.Fail("no CUDA allocator in this build")

    monkeypatch.setattr(ort, "create_and_register_allocator_v2", refused)
    own = ort.SessionOptions()
    assert not sessions.share_arena(own, "cuda", 2)
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime raises a bare RuntimeError for a missing entry)
        own.get_session_config_entry("session.use_env_allocators")


@pytest.mark.skipif(NO_CUDA_DEVICE or not sessions.provider_works(CUDA), reason="no working CUDA provider here")
def test_a_cuda_session_runs_in_full_float32_precision():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 256, 256)).astype(np.float32)
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("MatMul", ["a", "b"], ["c"])],
            "mm",
            [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [256, 256]) for n in "ab"],
            [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [256, 256])],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 17)],
    )
    session = create_session(model, providers=[CUDA, CPU])
    assert session.get_provider_options()[CUDA]["use_tf32"] == "0"
    (c,) = session.run(None, {"a": a, "b": b})
    reference = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(c - reference) / np.linalg.norm(reference) < 1e-6  # TF32 gives about 3e-4


def _training_batch_norm(opset: int, shape: tuple, statistics: bool, dtype=onnx.TensorProto.FLOAT):
    channels = shape[1]
    outputs = ["y", "mean_out", "var_out"] if statistics else ["y"]
    node = onnx.helper.make_node(
        "BatchNormalization",
        ["x", "scale", "bias", "mean", "var"],
        outputs,
        name="bn",
        epsilon=1e-3,
        momentum=0.8,
        training_mode=1,
    )
    inputs = [onnx.helper.make_tensor_value_info("x", dtype, ["batch", *shape[1:]])] + [
        onnx.helper.make_tensor_value_info(n, dtype, [channels]) for n in ("scale", "bias", "mean", "var")
    ]
    model_outputs = [onnx.helper.make_tensor_value_info("y", dtype, ["batch", *shape[1:]])] + [
        onnx.helper.make_tensor_value_info(n, dtype, [channels]) for n in outputs[1:]
    ]
    graph = onnx.helper.make_graph([node], "bn", inputs, model_outputs)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize(
    ("opset", "shape", "statistics", "dtype"),
    [
        (14, (4, 3, 5, 6), True, np.float32),
        (15, (4, 3, 5, 6), True, np.float32),
        (18, (4, 3, 5, 6), True, np.float32),
        (17, (8, 5), True, np.float32),
        (17, (2, 4, 7), True, np.float32),
        (14, (4, 3, 5, 6), True, np.float64),
        (18, (2, 3, 4, 4, 4), True, np.float64),
    ],
)
def test_training_batch_norm_expanded_for_cuda_computes_what_onnxruntime_does(opset, shape, statistics, dtype):
    """onnxruntime's CUDA provider refuses training-mode BatchNormalization (opset 14+); its
    sessions get the standard ops instead. Checked here against onnxruntime's own kernel."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = _training_batch_norm(opset, shape, statistics, elem)
    expanded = onnx.ModelProto()
    expanded.CopyFrom(model)
    assert ort_compat.has_training_batch_norm(model)
    assert ort_compat.expand_training_batch_norm(expanded) == 1
    assert not ort_compat.has_training_batch_norm(expanded)
    assert "BatchNormalization" not in {n.op_type for n in expanded.graph.node}
    onnx.checker.check_model(expanded, full_check=True)
    rng = np.random.default_rng(opset)
    channels = shape[1]
    feeds = {
        "x": (rng.standard_normal(shape) * 3 + 1).astype(dtype),
        "scale": rng.standard_normal(channels).astype(dtype),
        "bias": rng.standard_normal(channels).astype(dtype),
        "mean": rng.standard_normal(channels).astype(dtype),
        "var": rng.uniform(0.5, 2, channels).astype(dtype),
    }
    expected = create_session(model, providers=[CPU]).run(None, feeds)
    got = create_session(expanded, providers=[CPU]).run(None, feeds)
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    for name, a, b in zip(("y", "running mean", "running variance"), got, expected, strict=False):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance, err_msg=name)


def test_only_cuda_sessions_get_batch_norm_expanded():
    model = _training_batch_norm(17, (4, 3, 5, 6), True)
    assert not sessions._needs_changes(model, on_cuda=False)
    assert sessions._needs_changes(model, on_cuda=True)
    inference = _training_batch_norm(17, (4, 3, 5, 6), False)
    inference.graph.node[0].attribute.pop()  # training_mode: 0 is the default
    assert not sessions._needs_changes(inference, on_cuda=True)


@pytest.mark.skipif(NO_CUDA_DEVICE or not sessions.provider_works(CUDA), reason="no working CUDA provider here")
def test_a_training_batch_norm_runs_on_cuda():
    model = _training_batch_norm(17, (4, 3, 5, 6), True)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 3, 5, 6)).astype(np.float32)}
    feeds.update({n: rng.uniform(0.5, 2, 3).astype(np.float32) for n in ("scale", "bias", "mean", "var")})
    expected = create_session(model, providers=[CPU]).run(None, feeds)
    session = create_session(model, providers=[CUDA, CPU])
    assert session.get_providers()[0] == CUDA
    for a, b in zip(session.run(None, feeds), expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- threads


def test_threads_override_sets_intra_op_threads(monkeypatch):
    assert session_options().intra_op_num_threads == 0  # onnxruntime's default: it chooses
    monkeypatch.setenv("GRAPHFORGE_THREADS", "3")
    assert session_options().intra_op_num_threads == 3
    session = create_session(relu_model())
    assert session.get_session_options().intra_op_num_threads == 3
    session = create_session(relu_model(), intra_op_threads=2, inter_op_threads=1)
    assert session.get_session_options().intra_op_num_threads == 2
    assert session.get_session_options().inter_op_num_threads == 1


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_threads_override_is_ignored(monkeypatch, value):
    monkeypatch.setenv("GRAPHFORGE_THREADS", value)
    assert session_options().intra_op_num_threads == 0


@pytest.mark.parametrize("value", ["four", "2.5", "-1", "0x4"])
def test_threads_override_that_is_no_whole_number(monkeypatch, value):
    monkeypatch.setenv("GRAPHFORGE_THREADS", value)
    expected = f"$GRAPHFORGE_THREADS must be a whole number ≥ 0 (0 lets onnxruntime choose), got {value!r}"
    with pytest.raises(GraphforgeError) as info:
        session_options()
    assert str(info.value) == expected
    with pytest.raises(GraphforgeError) as info:
        create_session(relu_model())
    assert str(info.value) == expected


@pytest.mark.parametrize("value", [-2, 1.5, True])
def test_thread_arguments_are_checked(value):
    with pytest.raises(GraphforgeError) as info:
        create_session(relu_model(), intra_op_threads=value)
    assert str(info.value) == f"intra_op_threads must be a whole number ≥ 0 (0 lets onnxruntime choose), got {value!r}"


def test_given_options_are_used(monkeypatch):
    monkeypatch.setenv("GRAPHFORGE_THREADS", "3")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = create_session(relu_model(), options=options)
    assert session.get_session_options().intra_op_num_threads == 1


# --------------------------------------------------------------------------- sources


@pytest.fixture
def affine(tmp_path):
    model, w, b = affine_model(seed=11)
    x = inputs(seed=12)
    return model, x, affine_reference(x, w, b)


def run(session, x):
    return session.run(None, {"x": x})[0]


def test_session_from_proto_bytes_and_paths(tmp_path, affine):
    model, x, expected = affine  # IR 14, opset 28: newer than onnxruntime reads
    before = model.SerializeToString()
    path = save(model, tmp_path / "affine.onnx")
    newest = tmp_path / "newest.onnx"
    onnx.save(model, newest)  # as onnx writes it, not loadable by onnxruntime as it is
    sources = [model, before, bytearray(before), path, str(path), newest, str(newest), path.read_bytes()]
    for source in sources:
        np.testing.assert_allclose(run(create_session(source), x), expected, rtol=1e-5, atol=1e-5)
    assert model.SerializeToString() == before


def test_session_from_a_path_with_external_data(tmp_path, affine, monkeypatch):
    model, x, expected = affine
    path = save(model, tmp_path / "affine.onnx", external_data=True)
    assert sorted(os.listdir(tmp_path)) == ["affine.onnx", "affine.onnx.data"]
    monkeypatch.chdir(tempfile.gettempdir())  # the data is found next to the model, not in the cwd
    np.testing.assert_allclose(run(create_session(path), x), expected, rtol=1e-5, atol=1e-5)


def test_session_from_a_newer_file_with_external_data_is_converted_in_memory(tmp_path, affine, monkeypatch):
    model, x, expected = affine
    path = tmp_path / "affine.onnx"
    onnx.save(model, path, save_as_external_data=True, location="weights.bin", size_threshold=1024)
    assert onnx.load(path, load_external_data=False).ir_version > runtime_limits()[0]
    monkeypatch.chdir(tempfile.gettempdir())

    def must_not_read(*args, **kwargs):
        raise AssertionError("the external data was read into Python")

    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", must_not_read)
    np.testing.assert_allclose(run(create_session(path), x), expected, rtol=1e-5, atol=1e-5)
    assert sorted(os.listdir(tmp_path)) == ["affine.onnx", "weights.bin"]


@pytest.mark.parametrize("location", ["../secret.data", "ABSOLUTE"])
def test_session_refuses_external_data_outside_the_folder(tmp_path, affine, location):
    model = affine[0]
    folder = tmp_path / "model"
    folder.mkdir()
    save(model, folder / "m.onnx", external_data=True)
    os.replace(folder / "m.onnx.data", tmp_path / "secret.data")
    location = str(tmp_path / "secret.data") if location == "ABSOLUTE" else location
    bad = set_location(load(folder / "m.onnx", load_external_data=False), location)
    (folder / "bad.onnx").write_bytes(bad.SerializeToString())
    with pytest.raises(ModelLoadError, match=r"outside the model's folder .*; refusing to read it$"):
        create_session(folder / "bad.onnx")


@pytest.mark.parametrize("form", ["bytes", "proto"])
def test_session_refuses_a_model_in_memory_that_refers_to_external_data(tmp_path, affine, monkeypatch, form):
    """onnxruntime would read such data relative to the current folder, unchecked."""
    save(affine[0], tmp_path / "m.onnx", external_data=True)
    lazy = load(tmp_path / "m.onnx", load_external_data=False)
    monkeypatch.chdir(tmp_path)  # where onnxruntime would find m.onnx.data
    with pytest.raises(ModelLoadError, match=r"^(<bytes>|the model): tensor 'W' keeps its data in the external file"):
        create_session(lazy.SerializeToString() if form == "bytes" else lazy)


def test_session_over_the_protobuf_limit_goes_through_a_temporary_file(tmp_path, affine, monkeypatch):
    model, x, expected = affine
    monkeypatch.setattr(payloads, "PROTOBUF_LIMIT", 4096)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    before = model.SerializeToString()
    for source in (model, before):
        np.testing.assert_allclose(run(create_session(source), x), expected, rtol=1e-5, atol=1e-5)
    assert model.SerializeToString() == before
    assert os.listdir(tmp_path / "tmp") == []


def test_model_onnxruntime_refuses_raises_invalid_model_error(tmp_path, capfd):
    model = onnx.parser.parse_model(
        '<ir_version: 10, opset_import: ["" : 17, "com.example" : 1]> '
        "g (float[2] x) => (float[2] y) { y = com.example.Foo(x) }"
    )
    path = tmp_path / "custom.onnx"
    path.write_bytes(model.SerializeToString())
    for source, where in ((model, "the model"), (model.SerializeToString(), "<bytes>"), (path, str(path))):
        with pytest.raises(InvalidModelError) as info:
            create_session(source)
        message = str(info.value)
        assert message.startswith(f"onnxruntime cannot load {where}: [ONNXRuntimeError]")
        assert "com.example:Foo" in message and "\n" not in message
    with pytest.raises(InvalidModelError, match=r"^onnxruntime cannot load the input model: "):
        create_session(model, where="the input model")
    assert capfd.readouterr() == ("", "")


def test_unconvertible_opset_raises_invalid_model_error(tmp_path):
    if runtime_limits()[1] >= 28:
        pytest.skip("onnxruntime reads opset 28")
    model = onnx.parser.parse_model(
        '<ir_version: 14, opset_import: ["" : 28]> g (float[2] a, float[2] b) => (float[2] y) { y = SwiGLU(a, b) }'
    )
    path = tmp_path / "swiglu.onnx"
    onnx.save(model, path)
    for source, where in ((model, "the model"), (path, str(path))):
        with pytest.raises(InvalidModelError) as info:
            create_session(source)
        assert str(info.value).startswith(
            f"onnxruntime cannot load {where}: the model uses ai.onnx opset 28, onnxruntime reads at most "
            f"{runtime_limits()[1]}, and converting it failed: "
        )


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        create_session(tmp_path / "nope.onnx")
    assert str(info.value) == f"{tmp_path / 'nope.onnx'}: no such file"


def test_public_api_exports_the_session_functions():
    assert graphforge.create_session is create_session
    assert graphforge.available_providers is available_providers


def test_a_fresh_training_mode_batchnorm_keeps_its_scale_and_bias():
    """A gradient program (no optimizer) of a fresh BatchNorm keeps its statistics as
    initializers: zeros and ones, equal to the bias and the scale. onnxruntime's ConstantSharing
    made them one buffer each, which the CPU kernel's in-place statistics update then overwrote:
    every run normalised with other values. graphforge's sessions run without it; the oracle is
    onnxruntime with no graph optimization at all."""
    rng = np.random.default_rng(0)
    model = models.parse(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 2, 4, 4] x) => (float[N, 3] logits)
          <float[4, 2, 3, 3] w = {{{", ".join(map(str, rng.normal(0, 0.3, 72).round(3)))}}},
           float[4] scale = {{1, 1, 1, 1}}, float[4] bias = {{0, 0, 0, 0}},
           float[4] mean = {{0, 0, 0, 0}}, float[4] var = {{1, 1, 1, 1}},
           float[3, 64] fc = {{{", ".join(map(str, rng.normal(0, 0.3, 192).round(3)))}}}> {{
          c = Conv <pads = [1, 1, 1, 1]> (x, w)
          n, running_mean, running_var = BatchNormalization <training_mode = 1> (c, scale, bias, mean, var)
          r = Relu (n)
          f = Flatten (r)
          logits = Gemm <transB = 1> (f, fc)
        }}
    """)
    program = graphforge.compile(model, "loss(kind=cross_entropy, output=logits), autodiff").model
    feeds = {"x": (3 * rng.standard_normal((4, 2, 4, 4)) + 2).astype(np.float32), "labels": rng.integers(0, 3, 4)}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    oracle = ort.InferenceSession(program.SerializeToString(), options, providers=["CPUExecutionProvider"])
    expected = oracle.run(["loss", "w_grad"], feeds)
    session = create_session(program, providers=["CPUExecutionProvider"])
    for _ in range(3):
        for got, want in zip(session.run(["loss", "w_grad"], feeds), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
