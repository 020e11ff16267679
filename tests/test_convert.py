"""edgeq convert: one mode table, every conversion verified, no file left on failure."""

import json

import numpy as np
import pytest

from edgeq.convert.cli import MODE_FLAGS
from edgeq.convert.options import MODES, ConvertOptions, Mode
from edgeq.convert.run import convert
from edgeq.errors import IntegerOnlyError, UsageError
from edgeq.models.compat import keras, tf
from edgeq.runtime.interpreter import TFLiteModel
from tests.conftest import assert_one_line_error


def test_cli_flags_are_the_mode_table():
    assert list(MODE_FLAGS) == [m.value for m in MODES]
    assert all(MODE_FLAGS[m.value] == spec.help for m, spec in MODES.items())


EXPECTED = {  # mode: (input dtype, dtypes that must appear among the weights)
    "fp32": ("float32", {"float32"}),
    "fp16": ("float32", {"float16"}),
    "dynamic": ("float32", {"int8"}),
    "int8": ("float32", {"int8"}),
    "int8-only": ("int8", {"int8"}),
    "int16x8": ("float32", {"int16"}),
    "int4-weights": ("float32", {"int4"}),
    "int4-dynamic": ("float32", {"int4"}),
}


@pytest.mark.parametrize("mode", [m.value for m in Mode])
def test_every_mode_converts_ptq_and_verifies(digits_run, tmp_path, mode):
    result = convert(
        digits_run.fp32_model,
        tmp_path / f"m_{mode}.tflite",
        ConvertOptions(mode=mode, calib="digits", calib_samples=100),
    )
    assert result.verification.passed and result.verification.agreement >= 0.95
    model = TFLiteModel(result.path, use_default_delegates=False)
    io_dtype, weight_dtypes = EXPECTED[mode]
    assert model.input.dtype == io_dtype and model.output.dtype == io_dtype
    from edgeq.runtime.flatbuffer import read_tflite, tensors_by_dtype

    dtypes = set(tensors_by_dtype(read_tflite(result.path)))  # LiteRT reports INT4 tensors as int8
    assert weight_dtypes <= dtypes, dtypes
    assert result.manifest.is_file()


def test_per_tensor_ptq_has_one_scale_per_weight_tensor(digits_run, tmp_path):
    scales = {}
    for granularity in ("per-channel", "per-tensor"):
        r = convert(
            digits_run.fp32_model,
            tmp_path / f"{granularity}.tflite",
            ConvertOptions(mode="int8-only", calib="digits", granularity=granularity),
        )
        model = TFLiteModel(r.path, use_default_delegates=False)
        scales[granularity] = [
            len(d["quantization_parameters"]["scales"])
            for d in model.interpreter.get_tensor_details()
            if d["dtype"] == np.int8 and len(d["shape"]) == 4 and d["shape"][0] > 1
        ]
    assert scales["per-tensor"] == [1, 1, 1]
    assert sorted(scales["per-channel"]) == [32, 64, 64]


def test_uint8_io_for_coral(digits_run, digits_int8, tmp_path):
    r = convert(digits_run.qat_model, tmp_path / "u8.tflite", ConvertOptions(mode="int8-only", io_type="uint8"))
    model = TFLiteModel(r.path, use_default_delegates=False)
    assert model.input.dtype == "uint8" and model.output.dtype == "uint8"
    assert r.verification.integer_only and r.verification.agreement >= 0.99


def test_mobilenetv2_ptq_int8_only_with_synthetic_calibration(tmp_path):
    from edgeq.models import zoo

    path = tmp_path / "mnv2.keras"
    zoo.build("mobilenetv2", (64, 64, 3), 10, alpha=0.35).save(path)
    r = convert(
        path,
        tmp_path / "mnv2_int8.tflite",
        ConvertOptions(mode="int8-only", calib="synthetic:64x64x3:10", calib_samples=32),
    )
    assert r.verification.passed and r.verification.integer_only
    assert r.ops.get("CONV_2D", 0) > 30 and r.ops.get("DEPTHWISE_CONV_2D", 0) > 10
    manifest = json.loads(r.manifest.read_text())
    assert manifest["options"]["calib"] == "synthetic:64x64x3:10"


def _float_op_model(path):
    """A model whose COS op has no integer kernel: the converter silently leaves it in float."""
    L = keras.layers
    inputs = L.Input((8, 8, 1))
    h = L.Conv2D(4, 3, name="conv")(inputs)
    h = tf.math.cos(h)
    outputs = L.Dense(10, activation="softmax", name="head")(L.Flatten()(h))
    keras.Model(inputs, outputs).save(path)
    return path


def test_int8_only_refuses_a_model_with_float_ops_and_leaves_nothing(cli, tmp_path):
    model = _float_op_model(tmp_path / "cos.keras")
    out = tmp_path / "out" / "cos.tflite"
    result = cli("convert", model, "--int8-only", "--calib", "digits", "--out", out)
    line = assert_one_line_error(result, "not integer-only", "COS", "--int8")
    assert "DEQUANTIZE" in line and "QUANTIZE" in line
    assert not out.exists() and not (out.parent / "cos.manifest.json").exists()
    assert not out.parent.exists() or not list(out.parent.iterdir())  # no temp files either
    # With float fallback allowed the same model converts, and the manifest says what stays float.
    ok = convert(model, tmp_path / "cos_int8.tflite", ConvertOptions(mode="int8", calib="digits"))
    assert any(op.startswith("COS") for op in ok.verification.float_ops)
    assert not ok.verification.integer_only


def test_op_without_any_tflite_kernel_is_named(tmp_path):
    L = keras.layers
    inputs = L.Input((8, 8, 1))
    outputs = L.Dense(10)(L.Flatten()(tf.math.erf(L.Conv2D(4, 3)(inputs))))
    keras.Model(inputs, outputs).save(tmp_path / "erf.keras")
    with pytest.raises(IntegerOnlyError, match=r"tf\.Erf"):
        convert(tmp_path / "erf.keras", tmp_path / "erf.tflite", ConvertOptions(mode="int8-only", calib="digits"))
    assert not (tmp_path / "erf.tflite").exists()


def test_ptq_without_calibration_data_says_how_to_give_it(tmp_path):
    path = tmp_path / "lonely.keras"
    keras.Sequential([keras.layers.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(3)]).save(path)
    with pytest.raises(UsageError, match="--calib"):
        convert(path, tmp_path / "x.tflite", ConvertOptions(mode="int8-only"))
    # Modes without calibration need no data: verification falls back to random inputs.
    r = convert(path, tmp_path / "x.tflite", ConvertOptions(mode="dynamic"))
    assert "random" in r.verification.data


def test_edgetpu_conversion_is_static_checked_and_says_when_the_compiler_is_missing(
    cli, digits_run, tmp_path, monkeypatch
):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no edgetpu_compiler here (it is x86-64 Debian-only, not on PyPI)
    out = tmp_path / "coral.tflite"
    result = cli("convert", digits_run.qat_model, "--int8-only", "--io-type", "uint8", "--edgetpu", "--out", out)
    assert result.exit_code == 0, result.output
    assert "edgetpu_compiler is not on PATH" in result.stdout
    manifest = json.loads((tmp_path / "coral.manifest.json").read_text())
    assert manifest["edgetpu"]["compatible"] is True and manifest["edgetpu"]["compiler"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coral.manifest.json", "coral.tflite"]  # no staging left
    model = TFLiteModel(out)
    assert model.input.shape == (1, 8, 8, 1) and model.input.dtype == "uint8"
    sig = model.interpreter.get_input_details()[0]["shape_signature"]
    assert list(sig) == [1, 8, 8, 1]  # static: the Edge TPU compiler refuses a dynamic batch
    refused = cli("convert", digits_run.qat_model, "--int8", "--edgetpu", "--out", tmp_path / "x.tflite")
    assert_one_line_error(refused, "--int8-only")


@pytest.mark.parametrize("rescale", [True, False])
def test_a_model_that_rescales_raw_pixels_given_normalised_data_is_told_so(tmp_path, rescale):
    """keras.applications MobileNetV3/EfficientNet rescale 0..255 themselves; [0, 1] data ruins int8."""
    L = keras.layers
    inputs = L.Input((8, 8, 3))
    h = L.Rescaling(1 / 255.0, name="pixels")(inputs) if rescale else inputs
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(L.Conv2D(4, 3, activation="relu")(h)))
    path = tmp_path / "m.keras"
    keras.Model(inputs, outputs).save(path)
    options = ConvertOptions(mode="int8-only", calib="synthetic:8x8x3:10:200", min_sqnr_db=-100.0)
    result = convert(path, tmp_path / "m.tflite", options)
    hints = [n for n in result.notes if "expects raw pixel values" in n]
    assert len(hints) == int(rescale)
    if rescale:
        assert "'pixels'" in hints[0] and "include_preprocessing=False" in hints[0]


@pytest.mark.parametrize("option", [{"weight_ranges": "mse"}, {"rounding": "stochastic"}, {"rounding": "adaround"}])
def test_bias_correction_is_refused_for_weights_it_does_not_correct(option):
    """--bias-correct subtracts (W_q - W) E[x] for min/max scales rounded to nearest; with other
    deployed weights the shift would be wrong, so the combination is refused before any work."""
    with pytest.raises(UsageError, match="--bias-correct corrects for min/max weights rounded to nearest"):
        ConvertOptions(mode="int8-only", bias_correct=True, **option)
    ConvertOptions(mode="int8-only", **option)  # each alone is fine
    ConvertOptions(mode="int8-only", bias_correct=True)


def test_every_mode_names_an_exporter():
    """The mode table drives the export: each row's backend is a function of EXPORTERS."""
    from edgeq.convert.options import MODES
    from edgeq.convert.run import EXPORTERS

    assert {spec.backend for spec in MODES.values()} == set(EXPORTERS)
