"""A float .tflite as the model: float32 and float16 weights, no signature, one and two outputs.

Files from other frameworks come as float .tflite files, often with float16 weights (DEQUANTIZE
ops) and no signature. `edgeq convert X.tflite --int8-only --calib SRC` quantizes them through
LiteRT Quantizer with edgeq's ranges and verifies the result against the file, per output; eval
and profile then take the quantized model with the float file as its reference.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import assert_one_line_error


def _without_signature(content: bytes) -> bytes:
    """The same flatbuffer with its signatures removed, as many downloaded files are."""
    import flatbuffers

    from edgeq.runtime.flatbuffer import schema

    model = schema().ModelT.InitFromPackedBuf(content, 0)
    model.signatureDefs = []
    builder = flatbuffers.Builder(len(content) + 4096)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


@pytest.fixture(scope="module")
def float_files(tmp_path_factory):
    """A digits classifier with a second, regression head (the digit's value / 9), trained briefly,
    exported by the TFLite converter as float32 and with float16 weights, without signatures."""
    from edgeq.data.sources import load_dataset
    from edgeq.models.compat import keras, tf

    folder = tmp_path_factory.mktemp("float_tflite")
    data = load_dataset("digits")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    digit = keras.layers.Dense(10, activation="softmax", name="digit")(x)
    value = keras.layers.Dense(1, name="value")(x)
    two = keras.Model(inputs, [digit, value])
    two.compile("adam", ["sparse_categorical_crossentropy", "mse"])
    y = data.y_train.astype(np.int64)
    two.fit(data.x_train, [y, (y / 9.0).astype(np.float32)], epochs=8, batch_size=32, verbose=0)
    one = keras.Model(inputs, digit)
    files = {}
    for name, model in (("one", one), ("two", two)):
        for dtype in ("float32", "float16"):
            converter = tf.lite.TFLiteConverter.from_keras_model(model)
            if dtype == "float16":
                converter.optimizations = [tf.lite.Optimize.DEFAULT]
                converter.target_spec.supported_types = [tf.float16]
            path = folder / f"{name}_{dtype}.tflite"
            path.write_bytes(_without_signature(converter.convert()))
            files[name, dtype] = path
    return files


@pytest.mark.parametrize("name,dtype", [("one", "float32"), ("one", "float16"), ("two", "float16")])
def test_a_float_tflite_without_signature_converts_integer_only_and_is_verified_per_output(
    cli, float_files, tmp_path, name, dtype
):
    from edgeq.runtime.inputs import manifest_beside
    from edgeq.runtime.interpreter import TFLiteModel

    source = float_files[name, dtype]
    assert not TFLiteModel(source).interpreter.get_signature_list()  # as downloaded: no signature
    out = tmp_path / "q.tflite"
    result = cli("convert", source, "--int8-only", "--calib", "digits", "--out", out)
    assert result.exit_code == 0, result.output
    q = TFLiteModel(out)
    assert q.input.dtype == "int8" and all(o.dtype == "int8" for o in q.outputs)
    manifest = json.loads(manifest_beside(out).read_text())
    verification = manifest["verification"]
    assert verification["integer_only"] and verification["passed"]
    assert len(verification["outputs"]) == (2 if name == "two" else 1)
    assert all(o["passed"] and o["sqnr_db"] > 15 for o in verification["outputs"])
    if dtype == "float16":
        assert any("float16 constant(s) read as float32" in n for n in manifest["notes"])
    assert any("no signature" in n for n in manifest["notes"])
    # the quantized model's outputs are named as the float file's: eval and profile match them by name
    assert sorted(q.output_names) == sorted(TFLiteModel(source).output_names)


def test_eval_and_profile_take_the_quantized_model_against_the_float_file(cli, float_files, tmp_path):
    from edgeq.data.sources import load_dataset

    for name in ("one", "two"):
        source, out = float_files[name, "float32"], tmp_path / f"{name}_q.tflite"
        assert cli("convert", source, "--int8-only", "--calib", "digits", "--out", out).exit_code == 0
    # labelled: the classifier judged by accuracy against its float file, with n and the interval
    result = cli("eval", tmp_path / "one_q.tflite", "--reference", float_files["one", "float32"], "--data", "digits",
                 "--max-drop", "3", "--json", tmp_path / "one.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "one.json").read_text())
    assert record["metric"] == "accuracy" and record["samples"] >= 300 and record["passed"]
    assert record["verdicts"][0]["n"] == record["samples"]
    # two heads and no labels: each output compared with the float file's, matched by name
    np.savez(tmp_path / "x.npz", x=load_dataset("digits").x_test)
    result = cli("eval", tmp_path / "two_q.tflite", "--reference", float_files["two", "float32"],
                 "--data", f"npz:{tmp_path / 'x.npz'}", "--json", tmp_path / "two.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "two.json").read_text())
    assert len(record["outputs"]) == 2 and record["matching"] is None
    assert all(o["comparison"]["sqnr_db"] > 15 for o in record["outputs"])
    result = cli("data", "export", "digits", "--split", "test", "--out", tmp_path / "test.npz")
    assert result.exit_code == 0, result.output
    result = cli("profile", tmp_path / "one_q.tflite", "--compare", float_files["one", "float32"],
                 "--data", tmp_path / "test.npz", "--runs", "5", "--json", tmp_path / "p.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["comparison"] and profile["model"]["model"]["integer_only"]


def test_int16x8_and_w4a8_of_a_float_tflite(cli, float_files, tmp_path):
    """--int16x8 (every op at 16-bit activations) and --weight-bits 4 (W4A8, packed INT4 weights)
    through LiteRT Quantizer: integer inputs and outputs, verified against the float file."""
    from edgeq.runtime.flatbuffer import bytes_by_dtype, read_tflite
    from edgeq.runtime.inputs import manifest_beside
    from edgeq.runtime.interpreter import TFLiteModel

    source = float_files["one", "float16"]
    out = tmp_path / "w16.tflite"
    result = cli("convert", source, "--int16x8", "--calib", "digits", "--out", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads(manifest_beside(out).read_text())
    assert manifest["verification"]["passed"] and manifest["precision"].get("int16", 0) > 0
    assert manifest["precision"].get("float", 0) == 0 and TFLiteModel(out).input.dtype == "int8"
    out = tmp_path / "w4.tflite"
    result = cli("convert", source, "--int8-only", "--weight-bits", "4", "--calib", "digits", "--out", out)
    assert result.exit_code == 0, result.output
    assert json.loads(manifest_beside(out).read_text())["verification"]["passed"]
    assert bytes_by_dtype(read_tflite(out)).get("int4", 0) > 0


def test_what_a_tflite_cannot_be_given_is_refused_in_one_line(cli, float_files, tmp_path):
    source = float_files["one", "float32"]
    assert_one_line_error(cli("convert", source, "--int8-only", "--calib", "digits", "--equalize"), "source model")
    assert_one_line_error(cli("convert", source, "--dynamic"), "--int8-only, --int8")
    assert_one_line_error(cli("convert", source, "--int8-only"), "--calib")
    out = tmp_path / "q.tflite"
    assert cli("convert", source, "--int8-only", "--calib", "digits", "--out", out).exit_code == 0
    assert_one_line_error(cli("convert", out, "--int8-only", "--calib", "digits"), "quantized already")
    assert not list(tmp_path.glob("q_int8_only*"))  # nothing written by a refusal


def test_eval_matches_a_hand_converted_models_outputs_with_the_keras_reference(cli, float_files, tmp_path):
    """A .tflite converted by hand names its outputs as its converter did (StatefulPartitionedCall:0),
    its Keras reference as Keras does (digit, value): one output matches trivially, two by shape."""
    from edgeq.data.sources import load_dataset
    from edgeq.models.compat import keras

    np.savez(tmp_path / "x.npz", x=load_dataset("digits").x_test)  # two heads, one label array: compare outputs
    for name in ("one", "two"):
        inputs = keras.Input((8, 8, 1), name="image")
        x = keras.layers.Flatten()(keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs))
        x = keras.layers.Dense(32, activation="relu")(x)
        heads = [keras.layers.Dense(10, activation="softmax", name="digit")(x)]
        if name == "two":
            heads.append(keras.layers.Dense(1, name="value")(x))
        reference = tmp_path / f"{name}.keras"
        keras.Model(inputs, heads).save(reference)
        data = "digits" if name == "one" else f"npz:{tmp_path / 'x.npz'}"
        result = cli("eval", float_files[name, "float32"], "--reference", reference, "--data", data,
                     "--json", tmp_path / f"{name}.json")  # fmt: skip
        assert result.exit_code == 0, result.output
        record = json.loads((tmp_path / f"{name}.json").read_text())
        expected = "the one output" if name == "one" else "matched by shape"
        assert expected in record["matching"] and expected in result.output
        assert len(record["outputs"]) == len(heads)


def test_an_old_schema_file_and_its_input_range(cli, float_files, tmp_path):
    """MediaPipe's 2020 files name each op only in deprecated_builtin_code (builtin_code 0, ADD): edgeq
    gives each op both before LiteRT Quantizer reads them, or a CONV_2D filter is quantized as an ADD's
    input and LiteRT refuses the model. --input-range records what 8-bit images are in the model's units."""
    import flatbuffers

    from edgeq.runtime.flatbuffer import schema
    from edgeq.runtime.inputs import manifest_beside

    s = schema()
    model = s.ModelT.InitFromPackedBuf(float_files["one", "float16"].read_bytes(), 0)
    for code in model.operatorCodes:
        code.deprecatedBuiltinCode, code.builtinCode = max(code.builtinCode, code.deprecatedBuiltinCode), 0
    builder = flatbuffers.Builder(1 << 20)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    old = tmp_path / "old_schema.tflite"
    old.write_bytes(bytes(builder.Output()))
    from sklearn.datasets import load_digits

    digits = load_digits()
    np.savez(tmp_path / "raw.npz", x=(digits.images * 255 / 16).astype(np.uint8)[..., None], y=digits.target)
    out = tmp_path / "q.tflite"
    calib = f"npz:{tmp_path / 'raw.npz'}"
    result = cli("convert", old, "--int8-only", "--calib", calib, "--input-range", "0:1", "--out", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads(manifest_beside(out).read_text())
    assert manifest["verification"]["passed"]
    assert manifest["normalization"]["offset"] == 0.0 and manifest["normalization"]["scale"] == pytest.approx(1 / 255)
    assert_one_line_error(cli("convert", old, "--int8-only", "--calib", calib, "--input-range", "1:0"), "HI")
    assert_one_line_error(cli("convert", old, "--int8-only", "--calib", "digits", "--input-range", "0:1"), "own units")


def test_analyze_sensitivity_of_a_tflite_ranks_its_ops(cli, float_files, tmp_path):
    source = float_files["one", "float32"]
    result = cli("analyze", "sensitivity", source, "--data", "digits", "--json", tmp_path / "s.json")
    assert result.exit_code == 0, result.output
    assert "16-bit activations on the op" in result.output
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["metric"] == "accuracy" and len(report["exact"]) >= 3
    mse = [row["mse_only_this"] for row in report["exact"]]
    assert mse == sorted(mse, reverse=True) and mse[0] > 0  # most output error first


def test_analyze_plan_of_a_tflite_names_ops_and_convert_takes_it(cli, float_files, tmp_path):
    """A .tflite's plan gives ops (named by their first output tensor) 16-bit activations; an unmeetable
    budget ranks every op, and convert --plan builds the mixed integer-only model from a plan."""
    from edgeq.quantize.float_model import prepared_float_model
    from edgeq.quantize.mixed import op_names
    from edgeq.runtime.inputs import manifest_beside

    source = float_files["one", "float32"]
    result = cli("analyze", "plan", source, "--data", "digits", "--max-drop", "-100", "--fallback", "int16",
                 "--out", tmp_path / "plan.json")  # fmt: skip
    assert result.exit_code != 0  # the budget cannot be met: the least-worse plan is written, and the gate fails
    plan = json.loads((tmp_path / "plan.json").read_text())
    ops = op_names(prepared_float_model(source.read_bytes(), str(source)).content)
    assert plan["ranking"] and set(plan["ranking"]) <= set(ops) and plan["met"] is False
    refused = cli("analyze", "plan", source, "--data", "digits", "--max-drop", "1", "--out", tmp_path / "p.json")
    assert_one_line_error(refused, "--fallback int16")
    wide = {"kind": "edgeq.plan", "layers": {ops[0]: {"activation_bits": 16}}}
    (tmp_path / "wide.json").write_text(json.dumps(wide))
    out = tmp_path / "mixed.tflite"
    result = cli("convert", source, "--int8-only", "--plan", tmp_path / "wide.json", "--calib", "digits", "--out", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads(manifest_beside(out).read_text())
    assert manifest["verification"]["passed"] and manifest["precision"].get("int16", 0) >= 1
    assert manifest["precision"].get("float", 0) == 0
