"""The graph passes a downloaded float .tflite goes through before it is quantized (quantize.float_passes).

Each test builds a tiny .tflite with what MediaPipe's files have (a standalone RELU, a PRELU with one
alpha or one per channel, a filter read through DENSIFY, the custom transposed convolution, an average
pool over the whole map), checks
that the pass leaves the float outputs equal, that `edgeq convert --int8-only` then gives an
integer-only file in one XNNPACK partition, and that without the pass the same file does not.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from tests.conftest import assert_one_line_error

SHAPE = (8, 8, 3)


def _pack(model) -> bytes:
    import flatbuffers

    builder = flatbuffers.Builder(1 << 16)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _tflite(build) -> bytes:
    """A tiny Keras model from ``build(keras, inputs)``, converted to float by the TFLite converter."""
    from edgeq.models.compat import keras
    from edgeq.shims.tflite import keras_converter

    keras.utils.set_random_seed(0)
    inputs = keras.Input(SHAPE, name="image")
    return keras_converter(keras.Model(inputs, build(keras, inputs)), True).convert()


def _code(s, model, op) -> int:
    code = model.operatorCodes[op.opcodeIndex]
    return max(code.builtinCode, code.deprecatedBuiltinCode)


def _opcode(s, model, builtin: int, version: int = 1) -> int:
    for i, code in enumerate(model.operatorCodes):
        if max(code.builtinCode, code.deprecatedBuiltinCode) == builtin and not code.customCode:
            return i
    code = s.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode, code.version = builtin, min(builtin, 127), version
    model.operatorCodes.append(code)
    return len(model.operatorCodes) - 1


def _unfused_relus(content: bytes) -> bytes:
    """Each conv's fused RELU written as a standalone RELU op after it, as MediaPipe's files have them."""
    from edgeq.runtime.flatbuffer import schema

    s = schema()
    model = s.ModelT.InitFromPackedBuf(content, 0)
    graph = model.subgraphs[0]
    ops = []
    for op in graph.operators:
        ops.append(op)
        options = op.builtinOptions
        if _code(s, model, op) != s.BuiltinOperator.CONV_2D or options.fusedActivationFunction != 1:
            continue
        options.fusedActivationFunction = s.ActivationFunctionType.NONE
        before = s.TensorT()
        out = graph.tensors[int(op.outputs[0])]
        before.name, before.type, before.shape, before.buffer = out.name + b"/pre", out.type, out.shape, 0
        graph.tensors.append(before)
        relu = s.OperatorT()
        relu.opcodeIndex = _opcode(s, model, s.BuiltinOperator.RELU)
        relu.inputs, relu.outputs = [len(graph.tensors) - 1], [int(op.outputs[0])]
        op.outputs = [len(graph.tensors) - 1]
        ops.append(relu)
    graph.operators = ops
    return _pack(model)


def _densified_filter(content: bytes) -> bytes:
    """The first conv's filter stored sparse (block-free CSR over its last dimension, as the TACO format
    writes it) and read through a DENSIFY op, as MediaPipe's sparse files store theirs."""
    from edgeq.runtime.flatbuffer import schema

    s = schema()
    model = s.ModelT.InitFromPackedBuf(content, 0)
    graph = model.subgraphs[0]
    conv = next(op for op in graph.operators if _code(s, model, op) == s.BuiltinOperator.CONV_2D)
    dense = graph.tensors[int(conv.inputs[1])]
    values = np.frombuffer(bytes(bytearray(model.buffers[dense.buffer].data)), "<f4").reshape(dense.shape).copy()
    values[np.abs(values) < np.quantile(np.abs(values), 0.5)] = 0  # half the weights pruned
    rows = values.reshape(-1, values.shape[-1])
    segments, indices = [0], []
    for row in rows:
        nonzero = np.flatnonzero(row)
        indices.extend(int(i) for i in nonzero)
        segments.append(len(indices))
    sparse = s.TensorT()
    sparse.name, sparse.type, sparse.shape = dense.name + b"/sparse", s.TensorType.FLOAT32, dense.shape
    buffer = s.BufferT()
    buffer.data = np.frombuffer(rows[rows != 0].astype("<f4").tobytes(), np.uint8)
    model.buffers.append(buffer)
    sparse.buffer = len(model.buffers) - 1
    sparse.sparsity = s.SparsityParametersT()
    sparse.sparsity.traversalOrder = list(range(values.ndim))
    metadata = []
    for size in values.shape[:-1]:
        dim = s.DimensionMetadataT()
        dim.format, dim.denseSize = s.DimensionType.DENSE, int(size)
        metadata.append(dim)
    last = s.DimensionMetadataT()
    last.format = s.DimensionType.SPARSE_CSR
    last.arraySegmentsType, last.arraySegments = s.SparseIndexVector.Int32Vector, s.Int32VectorT()
    last.arraySegments.values = segments
    last.arrayIndicesType, last.arrayIndices = s.SparseIndexVector.Int32Vector, s.Int32VectorT()
    last.arrayIndices.values = indices
    sparse.sparsity.dimMetadata = [*metadata, last]
    graph.tensors.append(sparse)
    dense.buffer = 0  # now computed: DENSIFY writes it
    densify = s.OperatorT()
    densify.opcodeIndex = _opcode(s, model, s.BuiltinOperator.DENSIFY)
    densify.inputs, densify.outputs = [len(graph.tensors) - 1], [int(conv.inputs[1])]
    graph.operators.insert(0, densify)
    return _pack(model)


def _custom_transpose_conv(content: bytes) -> bytes:
    """Each TRANSPOSE_CONV written as MediaPipe's custom Convolution2DTransposeBias (input, weights, bias;
    its options the raw TfLiteTransposeConvParams: padding SAME = 1, stride w, stride h)."""
    from edgeq.runtime.flatbuffer import schema

    s = schema()
    model = s.ModelT.InitFromPackedBuf(content, 0)
    graph = model.subgraphs[0]
    code = s.OperatorCodeT()
    code.builtinCode, code.deprecatedBuiltinCode, code.customCode = 32, 32, b"Convolution2DTransposeBias"
    model.operatorCodes.append(code)
    gone = []
    for op in graph.operators:
        if _code(s, model, op) != s.BuiltinOperator.TRANSPOSE_CONV:
            continue
        _, weights, x, *bias = (int(t) for t in op.inputs)
        if not bias or bias[0] < 0:  # the converter adds the bias after it: that ADD becomes the op's bias
            add = next(o for o in graph.operators if int(op.outputs[0]) in [int(t) for t in o.inputs])
            bias = [int(t) for t in add.inputs if int(t) != int(op.outputs[0])]
            op.outputs, gone = add.outputs, [*gone, add]
        bias = bias[0]
        options = op.builtinOptions
        padding = 1 if options.padding == s.Padding.SAME else 2
        op.opcodeIndex = len(model.operatorCodes) - 1
        op.inputs = [x, weights, bias]
        op.builtinOptionsType, op.builtinOptions = 0, None
        op.customOptions = list(struct.pack("<iii", padding, options.strideW, options.strideH))
    graph.operators = [op for op in graph.operators if all(op is not g for g in gone)]
    return _pack(model)


def _relu_model(keras, x):
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    return keras.layers.Conv2D(4, 1)(x)


def _prelu_model(shared):
    def build(keras, x):
        x = keras.layers.Conv2D(8, 3, padding="same")(x)
        layer = keras.layers.PReLU(shared_axes=shared)
        x = layer(x)
        # MediaPipe's alphas: some negative, some above 1 (the palm detector's run -4.6..3.6)
        alpha = np.linspace(-1.5, 2.5, int(np.prod(layer.alpha.shape))).reshape(layer.alpha.shape)
        layer.set_weights([alpha if shared == [1, 2] else np.full(layer.alpha.shape, 0.25)])
        return keras.layers.Conv2D(4, 1)(x)

    return build


def _transpose_model(keras, x):
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(x)
    layer = keras.layers.Conv2DTranspose(2, 2, strides=2, padding="same")
    x = layer(x)
    layer.set_weights([layer.get_weights()[0], np.asarray([0.5, -0.25], np.float32)])  # a bias the file keeps
    return x


def _squeeze_excite_model(keras, x):
    """A squeeze-and-excite block whose squeeze is an average pool over the whole map, as MediaPipe's
    selfie segmentation writes it (AVERAGE_POOL_2D, not MEAN)."""
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    squeezed = keras.layers.AveragePooling2D(SHAPE[:2])(x)
    x = keras.layers.Multiply()([x, keras.layers.Conv2D(8, 1, activation="sigmoid")(squeezed)])
    return keras.layers.Conv2D(4, 1)(x)


CASES = {
    "relu": (lambda: _unfused_relus(_tflite(_relu_model)), "fused_activations"),
    "prelu_channels": (lambda: _tflite(_prelu_model([1, 2])), "prelu"),
    "prelu_one": (lambda: _tflite(_prelu_model([1, 2, 3])), "prelu"),
    "densify": (lambda: _densified_filter(_tflite(_relu_model)), "folded_constants"),
    "custom_transpose_conv": (lambda: _custom_transpose_conv(_tflite(_transpose_model)), "custom_ops"),
    "global_average_pool": (lambda: _tflite(_squeeze_excite_model), "global_pools"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("float_passes")
    rng = np.random.default_rng(0)
    np.savez(folder / "x.npz", x=rng.uniform(0, 1, (240, *SHAPE)).astype(np.float32))
    made = {"data": f"npz:{folder / 'x.npz'}", "folder": folder}
    for name, (make, _) in CASES.items():
        made[name] = folder / f"{name}.tflite"
        made[name].write_bytes(make())
    made["transpose_reference"] = folder / "transpose_reference.tflite"
    made["transpose_reference"].write_bytes(_tflite(_transpose_model))
    return made


def _outputs(content: bytes, x) -> dict:
    from edgeq.runtime.interpreter import TFLiteModel

    return TFLiteModel(model_content=content).predict_outputs(x)


def _int8_without_passes(path, data) -> bytes:
    """What convert made of the file before these passes: LiteRT Quantizer on the file as it is."""
    from edgeq.data.sources import load_dataset
    from edgeq.quantize.float_model import prepared_float_model
    from edgeq.quantize.mixed import calibrate_float, op_names

    content = prepared_float_model(path.read_bytes(), str(path), graph_passes=False).content
    x = load_dataset(data, (1, *SHAPE), labels_required=False).calibration_samples(32)
    return calibrate_float(content, x, op_names(content), "minmax").quantize()


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_pass_keeps_the_float_outputs_and_gives_one_integer_partition(cli, files, tmp_path, case):
    from edgeq.errors import ModelLoadError
    from edgeq.quantize.float_model import prepared_float_model
    from edgeq.runtime.delegation import structure_of
    from edgeq.runtime.flatbuffer import is_integer_only, read_tflite
    from edgeq.runtime.inputs import manifest_beside

    path, pass_name = files[case], CASES[case][1]
    x = np.random.default_rng(1).uniform(0, 1, (4, *SHAPE)).astype(np.float32)
    prepared = prepared_float_model(path.read_bytes(), str(path))
    assert pass_name in prepared.record(), prepared.passes
    # the float model after the pass computes what the file did (the custom op: what TRANSPOSE_CONV did)
    before = files["transpose_reference"] if case == "custom_transpose_conv" else path
    want, got = _outputs(before.read_bytes(), x), _outputs(prepared.content, x)
    for a, b in zip(want.values(), got.values(), strict=True):  # one output each (names: Keras' counters)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * np.abs(a).max())
    out = tmp_path / "q.tflite"
    result = cli("convert", path, "--int8-only", "--calib", files["data"], "--out", out, "--min-sqnr", "15")
    assert result.exit_code == 0, result.output
    manifest = json.loads(manifest_beside(out).read_text())
    assert pass_name in manifest["float_passes"] and any(pass_name.split("_")[0] in n.lower() or "op(s)" in n
                                                         for n in manifest["notes"])  # fmt: skip
    assert manifest["delegate"] == {"partitions": 1, "ops": manifest["delegate"]["ops"], "outside": {}}
    assert is_integer_only(read_tflite(out)) and structure_of(out.read_bytes()).whole
    # without the pass: split partitions, a float op, or a file the interpreter refuses
    try:
        without = _int8_without_passes(path, files["data"])
        structure = structure_of(without)
    except ModelLoadError as exc:
        # a filter quantized as an activation (the interpreter's zero point, or a scale of a constant range
        # our reader refuses first, as the calibration data falls); a custom op the interpreter lacks
        refusal = {
            "densify": ("zero_point", "quantization scale"),
            "custom_transpose_conv": ("Convolution2DTransposeBias",),
        }
        assert any(s in str(exc) for s in refusal.get(case, ("(none)",))), exc
        return
    assert not structure.whole or not is_integer_only(read_tflite_bytes(without)), structure.summary()


def read_tflite_bytes(content: bytes):
    from edgeq.runtime.flatbuffer import verify_tflite

    return verify_tflite(content, "model")


def test_a_custom_op_with_no_builtin_is_refused_in_one_line(cli, files, tmp_path):
    from edgeq.runtime.flatbuffer import schema

    s = schema()
    model = s.ModelT.InitFromPackedBuf(files["custom_transpose_conv"].read_bytes(), 0)
    model.operatorCodes[-1].customCode = b"TransformTensorBilinear"
    path = tmp_path / "custom.tflite"
    path.write_bytes(_pack(model))
    result = cli("convert", path, "--int8-only", "--calib", files["data"], "--out", tmp_path / "q.tflite")
    assert_one_line_error(result, "TransformTensorBilinear", "no builtin equivalent")
    assert not (tmp_path / "q.tflite").exists()


def test_inspect_shows_the_delegate_structure(cli, files, tmp_path):
    """inspect loads the file as profile does and says how XNNPACK partitions it: the standalone RELUs
    of the float file are delegated (float RELU is), an int8 file without the pass splits at each."""
    path = tmp_path / "split.tflite"
    path.write_bytes(_int8_without_passes(files["relu"], files["data"]))
    result = cli("inspect", path, "--json", tmp_path / "i.json")
    assert result.exit_code == 0, result.output
    assert "XNNPACK: 3 partitions" in result.output and "RELU x2" in result.output, result.output
    record = json.loads((tmp_path / "i.json").read_text())["delegate"]
    assert record["partitions"] == 3 and record["outside"] == {"RELU": 2}


def _detector_model(keras, x):
    """Pixel boxes (about +-100) beside 0..1 scores, concatenated into one output, as YOLO exports do."""
    h = keras.layers.Flatten()(keras.layers.Conv2D(8, 3, activation="relu")(x))
    boxes = keras.layers.Dense(4, kernel_initializer=keras.initializers.RandomNormal(0.0, 20.0))(h)
    scores = keras.layers.Dense(2, activation="sigmoid")(h)
    return keras.layers.Concatenate(name="detections")([boxes, scores])


def test_a_concatenated_output_of_uneven_parts_is_split_by_default_and_read_back_joined(cli, files, tmp_path):
    """Parts whose ranges differ over 16x get their own int8 scales by default; the manifest's joins make
    eval and profile read the parts as the file's one output. --no-split-outputs keeps one tensor (and
    one scale), and its scores come out coarser: the test that fails without the split."""
    from edgeq.runtime.inputs import manifest_beside
    from edgeq.runtime.interpreter import TFLiteModel, with_joins

    path = tmp_path / "det.tflite"
    path.write_bytes(_tflite(_detector_model))
    (name,) = TFLiteModel(path).output_names
    x = np.random.default_rng(2).uniform(0, 1, (200, *SHAPE)).astype(np.float32)
    want = TFLiteModel(path).predict_outputs(x)[name]
    score_error = {}
    for flag in ("", "--no-split-outputs"):
        out = tmp_path / f"q{flag}.tflite"
        result = cli("convert", path, "--int8-only", "--calib", files["data"], "--out", out, *([flag] if flag else []))
        assert result.exit_code == 0, result.output
        manifest = json.loads(manifest_beside(out).read_text())
        raw, joined = TFLiteModel(out), with_joins(TFLiteModel(out))
        assert joined.output_names == [name]
        got = joined.predict_outputs(x)[name]
        assert got.shape == want.shape
        score_error[flag] = float(np.abs(got[:, 4:] - want[:, 4:]).mean())
        if flag:
            assert manifest["joined_outputs"] == [] and len(raw.output_names) == 1
            assert any("concatenates tensors whose ranges differ" in n for n in manifest["notes"]), manifest["notes"]
            continue
        assert len(raw.output_names) == 2 and len({o.scale for o in raw.outputs}) == 2, raw.outputs
        assert manifest["delegate"]["partitions"] == 1, manifest["delegate"]  # no rescale before a concatenation
        assert manifest["joined_outputs"][0]["output"] == name and len(manifest["joined_outputs"][0]["parts"]) == 2
        assert any("split into its 2 concatenated parts" in n for n in manifest["notes"]), manifest["notes"]
        assert [o["name"] for o in manifest["outputs"]] == [name]
        np.savez(tmp_path / "eval.npz", x=x)
        record = tmp_path / "eval.json"
        result = cli("eval", out, "--reference", path, "--data", f"npz:{tmp_path / 'eval.npz'}", "--json", record)
        assert result.exit_code == 0, result.output
        assert [o["name"] for o in json.loads(record.read_text())["outputs"]] == [name]
        profiled = tmp_path / "profile.json"
        result = cli("profile", out, "--runs", "3", "--data", tmp_path / "eval.npz", "--compare", path,
                     "--json", profiled)  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "XNNPACK: 1 partition" in result.output, result.output
    assert score_error[""] * 4 < score_error["--no-split-outputs"], score_error


def test_masks_and_points_are_scored_by_their_task():
    """IoU and pixel accuracy of a mask, the mean (x, y) distance of points, on values worked by hand."""
    from edgeq.tasks.table import OutputSpec, score

    mask = OutputSpec("mask", "segmentation", (2, 2, 1))
    probs = np.array([[[[0.9], [0.2]], [[0.6], [0.1]]]])  # foreground at (0, 0) and (1, 0)
    labels = np.array([[[1, 1], [0, 0]]])  # foreground at (0, 0) and (0, 1)
    got = score(mask, probs, labels)
    assert got == {"iou": pytest.approx(1 / 3), "pixel_accuracy": pytest.approx(0.5)}
    points = OutputSpec("points", "landmarks", (6,))
    out = np.array([[3.0, 4.0, 9.0, 1.0, 1.0, 0.0]])  # two (x, y, z) points; z is not judged
    want = np.array([[0.0, 0.0, 0.0, 1.0, 1.0, 5.0]])
    assert score(points, out, want) == {"point_error": pytest.approx(2.5), "max_point_error": pytest.approx(5.0)}


def _heads_model(keras, x):
    """A per-pixel mask (sigmoid, the input's size), points in input pixels and a presence score."""
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    mask = keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid", name="mask")(h)
    flat = keras.layers.Flatten()(h)
    points = keras.layers.Rescaling(8.0, name="points")(keras.layers.Dense(15, activation="sigmoid")(flat))
    presence = keras.layers.Dense(1, activation="sigmoid", name="presence")(flat)
    return [mask, points, presence]


def test_masks_points_and_presence_of_a_float_tflite_are_judged_by_their_task_against_float(cli, files, tmp_path):
    """No labels: the mask is inferred as segmentation, the presence score as binary, the points declared as
    landmarks; each is judged by its task metric against the float file's own answers, with n and interval
    and a budget, instead of SQNR; a budget the int8 file cannot meet fails the conversion in one line."""
    from edgeq.runtime.inputs import manifest_beside
    from edgeq.runtime.interpreter import TFLiteModel

    path = tmp_path / "heads.tflite"
    path.write_bytes(_tflite(_heads_model))
    names = TFLiteModel(path).output_names
    points = next(n for n in names if TFLiteModel(path).output_named(n).shape[-1] == 15)
    out = tmp_path / "q.tflite"
    task = ("--task", f"{points}=landmarks")
    result = cli("convert", path, "--int8-only", "--calib", files["data"], "--out", out, *task)
    assert result.exit_code == 0, result.output
    rows = {o["name"]: o for o in json.loads(manifest_beside(out).read_text())["verification"]["outputs"]}
    judged = {rows[n]["task"]: rows[n] for n in names}
    assert set(judged) == {"segmentation", "landmarks", "binary"}, {n: r["task"] for n, r in rows.items()}
    for kind, metric in (("segmentation", "iou"), ("landmarks", "point_error"), ("binary", "accuracy")):
        verdict = judged[kind]["verdict"]
        assert judged[kind]["judged_by"] == metric and verdict["n"] >= 20 and len(verdict["interval95"]) == 2
        assert verdict["against"].startswith("the float model") and verdict["passed"], verdict
    assert judged["landmarks"]["verdict"]["budget"] == pytest.approx(0.08)  # 1% of the 8-pixel width
    strict = cli("convert", path, "--int8-only", "--calib", files["data"], "--out", tmp_path / "s.tflite", *task,
                 "--max-drop", "0")  # fmt: skip
    assert_one_line_error(strict, "verification failed")
    assert not (tmp_path / "s.tflite").exists()


def _negated_square_model(keras, x):
    """basic-pitch's shape of graph: an output (``first``) that later ops read too, a NEG and a SQUARE."""
    import tensorflow as tf

    first = keras.layers.Conv2D(4, 3, padding="same", name="first")(x)
    y = keras.layers.Lambda(lambda t: tf.square(tf.negative(t)), name="neg_square")(first)
    return [first, keras.layers.Conv2D(2, 1, name="second")(y)]


def test_neg_square_and_an_output_read_inside_the_graph_stay_int8_and_named(cli, files, tmp_path):
    from edgeq.quantize.float_model import prepared_float_model
    from edgeq.quantize.passes import signature_outputs
    from edgeq.runtime.flatbuffer import is_integer_only, read_tflite
    from edgeq.runtime.inputs import manifest_beside
    from edgeq.runtime.interpreter import TFLiteModel

    path = tmp_path / "negsq.tflite"
    path.write_bytes(_tflite(_negated_square_model))
    prepared = prepared_float_model(path.read_bytes(), str(path))
    assert {"negations", "squares"} <= set(prepared.record()), prepared.passes
    x = np.random.default_rng(1).uniform(0, 1, (4, *SHAPE)).astype(np.float32)
    want, got = _outputs(path.read_bytes(), x), _outputs(prepared.content, x)
    assert set(want) == set(got) == {"first", "second"}
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    # without the passes: NEG and SQUARE stay float; and LiteRT Quantizer's float copy of `first` as the output
    without = _int8_without_passes(path, files["data"])
    assert not is_integer_only(read_tflite_bytes(without))
    fixed, named = signature_outputs(without)
    assert named == ["first"] and "first" not in TFLiteModel(model_content=without).output_names
    assert sorted(TFLiteModel(model_content=fixed).output_names) == ["first", "second"]
    out = tmp_path / "q.tflite"
    result = cli("convert", path, "--int8-only", "--calib", files["data"], "--out", out, "--min-sqnr", "15")
    assert result.exit_code == 0, result.output
    notes = " ".join(json.loads(manifest_beside(out).read_text())["notes"])
    assert "NEG op(s) written as MUL by -1" in notes and "SQUARE op(s) written as MUL(x, x)" in notes, notes
    assert is_integer_only(read_tflite(out))
    model = TFLiteModel(out)
    assert sorted(model.output_names) == ["first", "second"]
    assert all(o.dtype == "int8" for o in model.outputs)
    assert json.loads(manifest_beside(out).read_text())["float_passes"].keys() >= {"negations", "squares"}
