"""QAT on Keras 3 itself (``edgeq.quantize.keras3_qat``, ``edgeq train --qat-engine keras3``).

Real Keras 3, TensorFlow's converter and LiteRT on digits CNNs. No tf_keras translation happens on this
path: the files it writes are Keras 3 files, and the int8 file's scales are the ranges QAT trained.
"""

import edgeq.models.compat  # noqa: F401, I001  (the suite's process: TF-MOT's engine is here too)

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from edgeq.convert.converter import float_ops
from edgeq.models.keras3 import KERAS3, keras_flavour_of_file
from edgeq.quantize import keras3_qat
from edgeq.runtime.interpreter import TFLiteModel
from tests.conftest import ROOT, assert_one_line_error

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


def keras3_only(*args, **env):
    """``edgeq ARGS`` in a process where tf_keras and TF-MOT cannot be imported (tests/keras3_only.py), with
    TF_USE_LEGACY_KERAS unset (the suite sets it once a test reaches TF-MOT); exit 97 if that process reached
    either or set the switch."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "KERAS_BACKEND")}
    command = [sys.executable, str(ROOT / "tests" / "keras3_only.py"), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env={**clean, **env}, check=False)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """`edgeq train` (the default engine) on the Keras 3 residual CNN, with neither tf_keras nor TF-MOT
    importable, and a shell whose KERAS_BACKEND names a backend not installed here: FP32, then QAT."""
    folder = tmp_path_factory.mktemp("k3qat")
    model = residual_cnn(folder / "k3.keras")
    result = keras3_only("train", model, "--data", "digits", "--epochs", "12", "--qat-epochs", "3",
                         "--out", folder / "run", "--no-compare-int8", KERAS_BACKEND="jax")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return folder / "run", result


def test_keras3_engine_trains_converts_and_evals_without_tf_keras_or_tfmot(trained_run, tmp_path):
    run, result = trained_run
    assert "qat" in result.stdout and "w8a8" in result.stdout
    assert "QAT engine: keras3" in result.stdout, result.stdout
    assert "KERAS_BACKEND=jax" in result.stderr and "TensorFlow backend" in result.stderr, result.stderr
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
    converted = keras3_only("convert", run / "qat.keras", "--int8-only", "--out", out)
    assert converted.returncode == 0, converted.stdout + converted.stderr
    assert "integer-only" in converted.stdout and "1 partitions" in converted.stderr + converted.stdout
    assert not float_ops(TFLiteModel(out))

    evaluated = keras3_only("eval", out, "--reference", run / "qat.keras", "--data", "digits",
                            "--json", tmp_path / "e.json")  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    e = json.loads((tmp_path / "e.json").read_text())
    agreement = e["outputs"][0]["comparison"]["agreement"]
    assert agreement >= 0.97, e["outputs"][0]["comparison"]
    assert fp32_val == fp32_val  # recorded (the FP32 stage ran)


def test_the_blocked_process_fails_when_the_legacy_stack_is_reached(tmp_path):
    """The check above can fail: the same process, asked for TF-MOT's engine, stops at tf_keras's import
    (named in one line) and reports that the legacy switch was set."""
    model = residual_cnn(tmp_path / "k3.keras")
    result = keras3_only("train", model, "--data", "digits", "--qat-engine", "tfmot", "--out", tmp_path / "r")
    assert result.returncode == 97, result.stdout + result.stderr
    assert "error: this needs tf_keras" in result.stderr and "TF_USE_LEGACY_KERAS=1" in result.stderr


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
    four_bit = tmp_path / "four.json"
    four_bit.write_text(json.dumps({"layers": {"conv1": {"weight_bits": 4}}}))
    for extra, named in ((("--granularity", "per-tensor"), "--granularity"), (("--distill",), "--distill"),
                         (("--weight-bits", "4"), "--weight-bits"), (("--resume",), "--resume"),
                         (("--layer-config", four_bit), "'conv1' at w4a8")):  # fmt: skip
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


def test_a_stage_or_plan_that_leaves_units_off_computes_them_in_float(tmp_path):
    """Units a stage has not reached, or a plan keeps float, compute in float: with every unit off the QAT model
    is the float model (BN folded exactly), and a quantizer that is off still follows its input's range."""
    model = keras.saving.load_model(residual_cnn(tmp_path / "m.keras"))
    from sklearn.datasets import load_digits

    x = (load_digits().images[..., None] / 16.0).astype("float32")[:200]
    qat = keras3_qat.quantize_model(model)
    keras3_qat.calibrate(qat, [x[:100]])
    units = keras3_qat.units(qat)
    assert units[0] == "rescale_quant" and units[-1] == "classes", units
    keras3_qat.set_quantized(qat, set())
    np.testing.assert_allclose(qat.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-5)
    assert set(keras3_qat.float_layers(qat)) >= {"conv1", "dw", "join_quant", "rescale_quant"}
    join = keras3_qat.quantizers(qat)["join_quant"]
    before = float(join.range_max.numpy())
    qat(x[100:] * 3.0, training=True)  # off, it still observes
    assert float(join.range_max.numpy()) > before
    # the input half on: the first units quantize, the rest do not
    half = set(units[: len(units) // 2])
    keras3_qat.set_quantized(qat, half)
    layers = {layer.name: layer for layer in qat.layers}
    assert layers["conv1"].enabled and layers["conv1"].output_quantizer.enabled
    assert not layers["classes"].enabled and not layers["classes"].output_quantizer.enabled
    assert not np.allclose(qat.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-5)


def test_stepped_schedule_and_layer_plan_on_the_keras3_engine(tmp_path):
    """--schedule stepped (the input half first, then all) and a --layer-config that keeps the classifier float,
    on the default engine for a Keras 3 file, with neither tf_keras nor TF-MOT importable."""
    model = residual_cnn(tmp_path / "k3.keras")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"classes": {"keep_float": True}}}))
    run = tmp_path / "run"
    result = keras3_only("train", model, "--data", "digits", "--epochs", "8", "--qat-epochs", "2", "--schedule",
                         "stepped", "--layer-config", plan, "--out", run, "--no-compare-int8")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "QAT engine: keras3" in result.stdout and "left float in QAT: classes" in result.stdout, result.stdout
    record = json.loads((run / "run.json").read_text())
    assert [(s["name"], s["layer_fraction"]) for s in record["schedule"]] == [
        ("fp32", 1.0), ("qat-input-half", 0.5), ("qat-w8a8", 1.0)]  # fmt: skip
    assert [r["name"] for r in record["results"]] == ["fp32", "qat-input-half", "qat-w8a8"]
    assert record["quantization"]["float_layers"] == ["classes"]
    assert record["results"][-1]["val_value"] > 0.6, record["results"]
    qat = keras.saving.load_model(run / "qat.keras")
    assert keras3_qat.float_layers(qat) == ["classes"]  # saved with the last stage's flags: all on but the plan's
