"""QAT on Keras 3 itself (``edgeq.quantize.keras3_qat``, ``edgeq train --qat-engine keras3``).

Real Keras 3, TensorFlow's converter and LiteRT on digits CNNs. No tf_keras translation happens on this
path: the files it writes are Keras 3 files, and the int8 file's scales are the ranges QAT trained.
"""

import edgeq.models.compat  # noqa: F401, I001  (the suite's process: TF-MOT's engine is here too)

import json

import keras
import numpy as np
import pytest

from edgeq.convert.converter import float_ops
from edgeq.models.keras3 import KERAS3, keras_flavour_of_file
from edgeq.quantize import keras3_qat
from edgeq.runtime.interpreter import TFLiteModel
from tests.conftest import assert_one_line_error

L = keras.layers


def residual_cnn(path, rescale: bool = True):
    """Conv-BN-ReLU, a depthwise block with ReLU6, a 1x1 conv + BN into an Add, pooling, a softmax Dense.
    The layers the tests read are named: Keras numbers unnamed ones across the whole process."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = L.Rescaling(2.0, -1.0, name="rescale")(inputs) if rescale else inputs
    x = L.Conv2D(16, 3, padding="same", use_bias=False, name="conv1")(x)
    x = L.BatchNormalization()(x)
    skip = x = L.ReLU()(x)
    x = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    x = L.BatchNormalization()(x)
    x = L.ReLU(6.0)(x)
    x = L.Conv2D(16, 1, use_bias=False)(x)
    x = L.BatchNormalization()(x)
    x = L.Add(name="join")([x, skip])
    x = L.MaxPooling2D()(x)
    x = L.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    outputs = L.Dense(10, activation="softmax", name="classes")(x)
    keras.Model(inputs, outputs, name="k3_residual").save(path)
    return path


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """`edgeq train --qat-engine keras3` on the residual CNN: FP32 epochs, then QAT with keep-best."""
    from click.testing import CliRunner

    from edgeq.cli import cli as group

    folder = tmp_path_factory.mktemp("k3qat")
    model = residual_cnn(folder / "k3.keras")
    args = ["train", str(model), "--data", "digits", "--qat-engine", "keras3", "--epochs", "25", "--qat-epochs", "3",
            "--out", str(folder / "run"), "--no-compare-int8"]  # fmt: skip
    result = CliRunner().invoke(group, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return folder / "run", result


def test_keras3_engine_trains_converts_integer_only_and_evals_in_keras3_files(cli, trained_run, tmp_path):
    run, result = trained_run
    assert "qat" in result.output and "w8a8" in result.output
    record = json.loads((run / "run.json").read_text())
    assert record["quantization"]["engine"] == "keras3" and record["config"]["qat_engine"] == "keras3"
    # both files stay Keras 3 files that Keras 3 loads (edgeq's layers registered on load)
    assert keras_flavour_of_file(run / "fp32.keras") == KERAS3 and keras_flavour_of_file(run / "qat.keras") == KERAS3
    assert not (run / "qat.h5").exists()
    qat = keras.saving.load_model(run / "qat.keras")
    assert keras3_qat.is_keras3_qat(qat)
    # BN folded into its conv, the ReLU after it fused: no BatchNormalization left to run
    assert not any(type(la).__name__ == "BatchNormalization" for la in qat.layers)
    fp32_val, qat_val = record["results"][0]["val_value"], record["results"][1]["val_value"]
    assert qat_val > 0.85, record["results"]

    out = tmp_path / "q.tflite"
    converted = cli("convert", run / "qat.keras", "--int8-only", "--out", out)
    assert converted.exit_code == 0, converted.output
    assert "integer-only" in converted.output and "1 partitions" in converted.output
    assert not float_ops(TFLiteModel(out))

    evaluated = cli("eval", out, "--reference", run / "qat.keras", "--data", "digits", "--json", tmp_path / "e.json")
    assert evaluated.exit_code == 0, evaluated.output
    e = json.loads((tmp_path / "e.json").read_text())
    agreement = e["outputs"][0]["comparison"]["agreement"]
    assert agreement >= 0.97, e["outputs"][0]["comparison"]
    assert fp32_val == fp32_val  # recorded (the FP32 stage ran)


def test_the_int8_files_scales_are_the_trained_ranges(cli, trained_run, tmp_path):
    """Every activation quantizer's trained [min, max] is a scale of the int8 file ((max - min) / 255), and
    the file was not recalibrated from data: a range the EMA never saw cannot appear by chance."""
    run, _ = trained_run
    qat = keras.saving.load_model(run / "qat.keras")
    ranges = keras3_qat.ranges(qat)
    assert set(ranges) >= {"conv1", "dw", "join_quant", "classes", "rescale_quant"}, ranges
    out = tmp_path / "q.tflite"
    assert cli("convert", run / "qat.keras", "--int8-only", "--out", out).exit_code == 0
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(out))
    scales = [t["quantization"][0] for t in interpreter.get_tensor_details() if t["dtype"] == np.int8]
    for name, (low, high) in ranges.items():
        expected = (high - low) / 255
        assert any(abs(s - expected) <= 1e-5 * expected for s in scales), (name, expected, sorted(scales))
    # the recorded ranges are the model's
    assert json.loads((run / "run.json").read_text())["quantization"]["final_ranges"] == ranges


def test_quantized_model_computes_the_float_model_before_rounding_bites(tmp_path):
    """Folding BN and fusing ReLU keep the function: with ranges wide enough, the QAT model's classes are the
    float model's (a wrong fold or a lost activation would change them)."""
    model = keras.saving.load_model(residual_cnn(tmp_path / "m.keras"))
    from sklearn.datasets import load_digits

    x = (load_digits().images[..., None] / 16.0).astype("float32")[:300]
    # BN statistics away from their defaults, so a fold that ignored them would show
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            gamma, beta, mean, var = layer.get_weights()
            layer.set_weights([gamma * 1.5, beta + 0.1, mean + 0.2, var * 2.0])
    qat = keras3_qat.quantize_model(model)
    keras3_qat.calibrate(qat, [x[k : k + 100] for k in range(0, 300, 100)])
    float_out, qat_out = model.predict(x, verbose=0), qat.predict(x, verbose=0)
    assert np.mean(np.argmax(float_out, 1) == np.argmax(qat_out, 1)) >= 0.97
    assert np.abs(float_out - qat_out).max() < 0.2


def test_what_the_keras3_engine_lacks_is_refused_in_one_line(cli, tmp_path):
    model = residual_cnn(tmp_path / "k3.keras")
    for extra, named in ((("--schedule", "stepped"), "--schedule"), (("--distill",), "--distill"),
                         (("--weight-bits", "4"), "--weight-bits"), (("--resume",), "--resume")):  # fmt: skip
        result = cli("train", model, "--data", "digits", "--qat-engine", "keras3", "--out", tmp_path / "r", *extra)
        assert_one_line_error(result, named, "--qat-engine tfmot")
        assert not (tmp_path / "r" / "fp32.keras").exists()
    # a layer it has no quantizer for: named, with the engine that has one
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = L.Flatten()(inputs)
    x = L.Dense(32)(x)
    x = L.LayerNormalization(name="norm")(x)
    odd = keras.Model(inputs, L.Dense(10, activation="softmax")(x))
    odd.save(tmp_path / "odd.keras")
    result = cli("train", tmp_path / "odd.keras", "--data", "digits", "--qat-engine", "keras3", "--epochs", "0",
                 "--out", tmp_path / "o")  # fmt: skip
    assert_one_line_error(result, "'norm'", "LayerNormalization", "--qat-engine tfmot")
    # a tf_keras file: the other engine's
    from edgeq.models.compat import keras as tf_keras

    old = tf_keras.Sequential([tf_keras.Input((8, 8, 1)), tf_keras.layers.Flatten(), tf_keras.layers.Dense(10)])
    old.save(tmp_path / "old.h5")
    result = cli("train", tmp_path / "old.h5", "--data", "digits", "--qat-engine", "keras3", "--out", tmp_path / "h")
    assert_one_line_error(result, "not a Keras 3 file", "--qat-engine tfmot")
