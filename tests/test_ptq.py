"""edgeq's own post-training ranges: methods that are not no-ops, ranges that reach the .tflite, --ptq auto."""

import json
import warnings

import numpy as np
import pytest

from edgeq.quantize.ranges import activation_range, fake_quant_asymmetric, quantization_mse, weight_ranges
from tests.conftest import assert_one_line_error


def outlier_values(seed=0):
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.normal(0.5, 0.3, 200_000), 0)  # post-ReLU activations
    x[rng.choice(x.size, 8, replace=False)] = 80.0  # a handful of outliers
    return x


@pytest.mark.parametrize("method", ["percentile", "entropy"])
def test_clipping_methods_keep_ordinary_values_precise_despite_outliers(method):
    x = outlier_values()
    minmax = activation_range(x, "minmax")
    chosen = activation_range(x, method)
    assert chosen[1] < minmax[1] / 4  # clipped well below the outliers
    assert chosen[0] <= 0 <= chosen[1]
    ordinary = x[x < 10]
    assert quantization_mse(ordinary, *chosen) < quantization_mse(ordinary, *minmax) / 10


@pytest.mark.parametrize("active", [0.5, 0.15])
def test_entropy_is_not_pulled_down_by_the_zeros_of_a_relu(active):
    """Half or more of a ReLU's outputs are exactly 0. Counted in the KL search's histogram,
    that spike made it clip 4% (9% at 15% active) of a half-normal's values, and a trained
    MobileNetV2's entropy-calibrated int8 model fell to 0 dB; zeros are exact at any range."""
    rng = np.random.default_rng(0)
    x = np.maximum(rng.normal(0, 1, 200_000), 0) * (rng.random(200_000) < active)
    lo, hi = activation_range(x, "entropy")
    assert lo == 0.0
    assert np.mean(x > hi) < 1e-3


def test_mse_search_lowers_the_total_error_of_a_heavy_tail():
    x = np.abs(np.random.default_rng(2).laplace(0, 0.2, 200_000))
    minmax = activation_range(x, "minmax")
    chosen = activation_range(x, "mse")
    assert chosen[1] < minmax[1]
    assert quantization_mse(x, *chosen) < 0.9 * quantization_mse(x, *minmax)  # a no-op gives 1.0


def test_minmax_keeps_everything_and_zero_is_exact():
    x = np.array([-1.0, 0.0, 0.3, 2.0])
    lo, hi = activation_range(x, "minmax")
    assert (lo, hi) == (-1.0, 2.0)
    assert fake_quant_asymmetric(np.array([0.0]), lo, hi)[0] == 0.0


def test_mse_weight_ranges_clip_heavy_tails_per_channel():
    rng = np.random.default_rng(1)
    kernel = rng.laplace(0, 0.05, size=(3, 3, 128, 4))
    kernel[..., 3] = rng.uniform(-0.1, 0.1, size=(3, 3, 128))  # no tail: nothing to clip
    minmax = weight_ranges(kernel, method="minmax", bits=4)
    mse = weight_ranges(kernel, method="mse", bits=4)
    assert np.all(mse[:3] < 0.8 * minmax[:3]) and mse[3] > 0.9 * minmax[3]

    def error(m):
        scale = m / 7
        return np.mean((kernel - np.clip(np.round(kernel / scale), -7, 7) * scale) ** 2)

    assert error(mse) < error(minmax)


def _sqnr_vs(reference, got):
    from edgeq.tasks.metrics import compare_outputs

    return compare_outputs(reference, got).sqnr_db


def _int8_only_with_ranges(model, x_cal, ranges, method):
    """``model`` converted int8-only by the TFLite converter, calibrated on ``x_cal``, its
    activation ranges re-chosen by ``method`` through ``ranges`` (an ActivationRanges; None:
    the converter's own), and no edgeq pass after."""
    import contextlib

    from edgeq.models.compat import tf
    from edgeq.shims.tflite import keras_converter, native_output_silenced

    converter = keras_converter(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([x_cal[i : i + 1]] for i in range(len(x_cal)))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = converter.inference_output_type = tf.int8
    with ranges.ranged(method) if ranges else contextlib.nullcontext(), native_output_silenced():
        return converter.convert()


def test_clipping_methods_beat_minmax_on_a_model_calibrated_with_an_outlier(digits_run):
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import load_keras_model
    from edgeq.quantize.calibration import ActivationRanges
    from edgeq.runtime.interpreter import TFLiteModel

    d = load_dataset("digits")
    model = load_keras_model(digits_run.fp32_model)
    x_cal = d.calibration_samples(128).copy()
    x_cal[0, 4, 4, 0] = 40.0  # one hot pixel (the rest are in [0, 1]) blows the min/max ranges up
    ranges = ActivationRanges(x_cal)  # one calibration, observed once, serves every method
    reference = model.predict(d.x_test, verbose=0)
    sqnr = {}
    for method in ("minmax", "percentile", "mse", "entropy"):
        flatbuffer = _int8_only_with_ranges(model, x_cal, ranges, method)
        sqnr[method] = _sqnr_vs(reference, TFLiteModel(model_content=flatbuffer).predict(d.x_test, batch_size=1))
    # Percentile and entropy clip the lone hot pixel. MSE keeps it, by its own measure rightly: one
    # value off by 39 costs more squared error than the coarser grid does on 8,192 others; it
    # clips heavy tails (test_mse_search_lowers_the_total_error_of_a_heavy_tail), not lone outliers.
    assert all(sqnr[m] > sqnr["minmax"] + 1.0 for m in ("percentile", "entropy")), sqnr
    assert sqnr["mse"] >= sqnr["minmax"] - 0.5, sqnr


def test_the_chosen_ranges_are_the_ranges_in_the_tflite(digits_run):
    from edgeq.data.sources import load_dataset
    from edgeq.models.compat import tf
    from edgeq.models.load import load_keras_model
    from edgeq.quantize.calibration import ActivationRanges
    from edgeq.runtime.interpreter import TFLiteModel

    d = load_dataset("digits")
    model = load_keras_model(digits_run.fp32_model)
    x_cal = d.calibration_samples(64)
    ranges = ActivationRanges(x_cal)
    tensor = TFLiteModel(model_content=_int8_only_with_ranges(model, x_cal, ranges, "percentile")).input
    (detail,) = tf.lite.Interpreter(model_content=ranges.calibrated).get_input_details()
    lo, hi = activation_range(ranges.observers[detail["index"]].values(), "percentile")
    scale = (hi - lo) / 255.0
    assert tensor.scale == pytest.approx(scale, rel=1e-5)
    assert tensor.zero_point == int(np.round(-128 - lo / scale))


def test_ptq_auto_keeps_the_best_candidate_and_records_every_one(cli, digits_run, tmp_path):
    out = tmp_path / "auto.tflite"
    model = digits_run.fp32_model
    result = cli("convert", model, "--int8-only", "--calib", "digits", "--ptq-target", "200", "--out", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads(out.with_name("auto.manifest.json").read_text())
    record = manifest["ptq"]
    candidates = record["candidates"]
    assert [c["method"] for c in candidates] == ["converter", "minmax", "percentile", "mse", "entropy"]
    # every candidate is a conversion measured in LiteRT; digits-cnn has no tensor an in-place op
    # consumes, so there edgeq's minmax and the converter's calibration record the same ranges
    assert all(c["sqnr_db"] > 30 for c in candidates), candidates
    assert candidates[1]["sqnr_db"] == pytest.approx(candidates[0]["sqnr_db"], abs=1e-6)
    best = max(candidates, key=lambda c: c["sqnr_db"])
    assert record["chosen"] == best["method"]
    assert "val samples" in manifest["verification"]["data"]  # checked on data calibration never saw
    assert manifest["verification"]["integer_only"]
    # The choice is made on one half of val, verification gates and records on the other: the
    # winner's SQNR on the samples that chose it is not what the manifest reports as verified.
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import load_keras_model
    from edgeq.runtime.interpreter import TFLiteModel
    from edgeq.tasks.metrics import compare_outputs

    held = load_dataset("digits").held_out(200, select=200)
    keras_model, tflite = load_keras_model(model), TFLiteModel(out)  # as convert measures: XNNPACK, as eval runs it

    def sqnr(x):
        return compare_outputs(keras_model.predict(x, verbose=0), tflite.predict(x)).sqnr_db

    assert record["checked_on"] == f"{len(held.x_select)} val samples" and (len(held.x), len(held.x_select)) == (90, 89)
    assert best["sqnr_db"] == pytest.approx(sqnr(held.x_select), abs=1e-3)
    verification = manifest["verification"]
    assert verification["samples"] == 90 and verification["sqnr_db"] == pytest.approx(sqnr(held.x), abs=1e-6)
    assert verification["classes"] == record["checked_on_classes"] == 10
    assert manifest["calibration_samples"] == {
        "split": "train", "samples": 200, "classes": 10, "draw": "stratified by class, seed 0"
    }  # fmt: skip

    # By default auto stops at the first candidate that passes verification: here the converter's.
    out = tmp_path / "quick.tflite"
    assert cli("convert", model, "--int8-only", "--calib", "digits", "--out", out).exit_code == 0
    record = json.loads(out.with_name("quick.manifest.json").read_text())["ptq"]
    assert [c["method"] for c in record["candidates"]] == ["converter"] and record["target_db"] == 10.0


def test_ptq_method_is_a_choice(cli, digits_run, tmp_path):
    result = cli("convert", digits_run.fp32_model, "--int8-only", "--ptq", "magic", "--out", tmp_path / "x.tflite")
    assert result.exit_code != 0 and "magic" in result.output


def test_equalization_across_relu6_in_a_mobilenetv2_block_is_exact_on_its_data():
    """Depthwise -> ReLU6 -> pointwise, as in MobileNetV2: CLE narrows the channel ranges, FP32 outputs stay."""
    from edgeq.models.compat import keras
    from edgeq.transforms.equalize import equalized_copy

    L = keras.layers
    keras.utils.set_random_seed(3)
    inputs = keras.Input((12, 12, 8))
    x = L.Conv2D(16, 1, use_bias=False, name="expand")(inputs)
    x = L.BatchNormalization(name="expand_bn")(x)
    x = L.ReLU(6.0, name="expand_relu")(x)
    x = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    x = L.BatchNormalization(name="dw_bn")(x)
    x = L.ReLU(6.0, name="dw_relu")(x)
    x = L.Conv2D(8, 1, use_bias=False, name="project")(x)
    model = keras.Model(inputs, L.BatchNormalization(name="project_bn")(x))
    dw = model.get_layer("dw")
    kernel = dw.get_weights()[0]
    kernel[..., 5, 0] *= 30.0  # one depthwise channel with a far wider range than the rest
    dw.set_weights([kernel])
    for bn in ("expand_bn", "dw_bn", "project_bn"):
        layer = model.get_layer(bn)
        gamma, beta, mean, var = layer.get_weights()
        layer.set_weights([gamma, beta, mean, var * 30.0])  # keep activations mostly under the clip
    x = np.random.default_rng(0).uniform(0, 1, size=(64, 12, 12, 8)).astype("float32")
    equalized, pairs = equalized_copy(model, x)
    by_first = {p.first: p for p in pairs}
    assert "dw" in by_first and by_first["dw"].range_spread_after < 0.75 * by_first["dw"].range_spread_before
    np.testing.assert_allclose(equalized.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-5)
    _, without_data = equalized_copy(model)
    assert "dw" not in {p.first for p in without_data}  # no data: the clip cannot be re-checked


def test_stochastic_rounding_is_seeded_unbiased_and_not_nearest():
    from edgeq.quantize.numerics import weight_codes as codes

    rng = np.random.default_rng(0)
    kernel = rng.normal(0, 0.05, size=(3, 3, 16, 8))
    scale = np.max(np.abs(kernel), axis=(0, 1, 2)) / 127
    first, again, other = (codes(kernel, scale, "stochastic", seed=s) for s in (3, 3, 4))
    nearest = codes(kernel, scale, "nearest")
    np.testing.assert_array_equal(first, again)
    assert np.mean(first != other) > 0.2 and np.mean(first != nearest) > 0.2
    assert np.all(np.abs(first - kernel / scale) < 1.0)  # the floor or the ceiling, never further
    assert abs(np.mean(first - kernel / scale)) < 0.01  # unbiased: errors cancel on average


def _int8_kernels(path):
    """The int8 filter of every CONV_2D / DEPTHWISE / FULLY_CONNECTED op, in Keras layout order."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    found = []
    for op in interpreter._get_ops_details():  # test-only: which tensor is each op's filter
        if op["op_name"] in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"):
            found.append((op["op_name"], interpreter.get_tensor(int(op["inputs"][1]))))
    return found


def test_chosen_rounding_reaches_the_tflite_as_those_int8_values(digits_run, tmp_path):
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import load_keras_model
    from edgeq.quantize.ptq import choose_weights

    d = load_dataset("digits")
    model = load_keras_model(digits_run.fp32_model)
    x_cal = d.calibration_samples(64)
    seed3 = [k.codes for k in choose_weights(model, x_cal, rounding="stochastic", seed=3).kernels]
    seed4 = [k.codes for k in choose_weights(model, x_cal, rounding="stochastic", seed=4).kernels]
    assert any(np.any(a != b) for a, b in zip(seed3, seed4))
    nearest = choose_weights(model, x_cal)
    assert any(np.any(a != k.codes) for a, k in zip(seed3, nearest.kernels))
    out = tmp_path / "stochastic.tflite"
    options = ConvertOptions(
        mode="int8-only", calib="digits", calib_samples=64, ptq="minmax", rounding="stochastic", seed=3
    )
    convert(model, out, options)
    in_tflite = _int8_kernels(out)
    assert len(in_tflite) == len(seed3)
    for (op, q), want in zip(in_tflite, seed3):
        keras_layout = np.transpose(q, (1, 2, 3, 0)) if op == "CONV_2D" else q.T if q.ndim == 2 else q[0]
        np.testing.assert_array_equal(keras_layout.reshape(want.shape), want)
    manifest = json.loads(out.with_name("stochastic.manifest.json").read_text())
    assert manifest["ptq"]["rounding"]["method"] == "stochastic" and manifest["ptq"]["rounding"]["seed"] == 3
    np.testing.assert_array_equal(model.get_weights()[0], load_keras_model(digits_run.fp32_model).get_weights()[0])


def test_adaround_lowers_the_layers_output_error_against_nearest():
    from edgeq.models.compat import keras
    from edgeq.transforms.adaround import adaround

    rng = np.random.default_rng(0)
    layer = keras.layers.Conv2D(16, 3, padding="same", kernel_initializer=keras.initializers.GlorotUniform(seed=0))
    x = np.maximum(rng.normal(0.3, 1.0, size=(64, 8, 8, 8)), 0).astype("float32")
    layer(x[:1])
    kernel = layer.kernel.numpy()
    scale = np.max(np.abs(kernel), axis=(0, 1, 2)) / 127 * 8  # coarse (4-bit-like) steps: rounding matters
    q, result = adaround(layer, x, scale, iterations=300)
    assert result.output_mse < 0.85 * result.output_mse_nearest, result  # measured: 0.71
    assert 0 < result.flipped < 0.5
    assert np.all(np.abs(q - kernel / scale) < 1.0)  # each weight went down or up, no further


def test_convert_rounding_adaround_records_each_layer(cli, digits_run, tmp_path):
    out = tmp_path / "ada.tflite"
    result = cli(
        "convert", digits_run.fp32_model, "--int8-only", "--calib", "digits", "--rounding", "adaround", "--out", out
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads(out.with_name("ada.manifest.json").read_text())
    rounding = manifest["ptq"]["rounding"]
    assert rounding["method"] == "adaround" and rounding["seed"] == 0
    assert "converter" not in [c["method"] for c in manifest["ptq"]["candidates"]]  # it rounds to nearest
    assert rounding["layers"] and all(la["output_mse"] <= la["output_mse_nearest"] for la in rounding["layers"])
    assert manifest["verification"]["integer_only"] and manifest["verification"]["passed"]


def test_rounding_needs_edgeqs_ranges(cli, digits_run, tmp_path):
    result = cli("convert", digits_run.fp32_model, "--ptq", "converter", "--rounding", "stochastic")
    assert result.exit_code != 0 and "--rounding stochastic" in result.output


def test_qat_starts_from_calibrated_activation_ranges_not_tfmots_default():
    from edgeq.models.compat import keras
    from edgeq.train.observe import activation_points, initialize_ranges
    from edgeq.train.schemes import QuantSettings, build_qat_model

    L = keras.layers
    inputs = keras.Input((8, 8, 1))
    x = L.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    x = L.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, L.Dense(10)(x))
    qat = build_qat_model(model, QuantSettings())
    points = activation_points(model, qat)
    assert 6.0 in {round(float(high.numpy()), 3) for _, high, _, _ in points}  # TF-MOT starts at [-6, 6]
    data = np.random.default_rng(0).uniform(0, 0.5, size=(64, 8, 8, 1)).astype("float32")
    assert initialize_ranges(qat, model, data, "minmax") == len(points) >= 3
    probe = keras.Model(model.inputs, [tensor for _, _, tensor, _ in points])
    for (low, high, _, layer), seen in zip(points, probe.predict(data, verbose=0)):
        assert float(high.numpy()) == pytest.approx(max(float(seen.max()), 0.0), rel=1e-5), layer
        assert float(low.numpy()) == pytest.approx(min(float(seen.min()), 0.0), rel=1e-5), layer


def test_qat_starts_with_one_range_per_concatenation_chain():
    """QAT's calibrated start (--init-ranges) gives a concatenation and its inputs one range, as
    PTQ does, so the QAT model does not start with a requantization at each concatenation."""
    from edgeq.models.compat import keras
    from edgeq.train.observe import activation_points, initialize_ranges
    from edgeq.train.schemes import QuantSettings, build_qat_model

    L = keras.layers
    inputs = keras.Input((8, 8, 1))
    a = L.Conv2D(4, 3, padding="same", name="a")(inputs)
    b = L.Conv2D(4, 3, padding="same", name="b")(L.ReLU()(a))
    x = L.Concatenate(name="cat")([a, b])
    model = keras.Model(inputs, L.Dense(3, name="head")(L.GlobalAveragePooling2D()(x)))
    qat = build_qat_model(model, QuantSettings())
    data = np.random.default_rng(0).uniform(0, 1, size=(64, 8, 8, 1)).astype("float32")
    initialize_ranges(qat, model, data, "minmax")
    ranges = {layer: (float(lo.numpy()), float(hi.numpy())) for lo, hi, _, layer in activation_points(model, qat)}
    chain = [ranges[name] for name in ("a", "b", "cat") if name in ranges]
    assert len(chain) == 3 and len(set(chain)) == 1, ranges
    assert ranges["head"] != chain[0]


def _hot_pixel_digits(samples=128):
    """digits where one of the ``samples`` calibration samples has a hot pixel (the rest are in [0, 1])."""
    from dataclasses import replace

    from edgeq.data.sources import load_dataset

    d = load_dataset("digits")
    x = d.x_train.copy()
    first = int(d.calibration_indices(samples)[0])
    x[first, 4, 4, 0] = 40.0  # Dataset.calibration_samples(samples) draws this one
    hot = replace(d, x_train=x)
    assert hot.calibration_samples(samples).max() == 40.0
    return hot


def test_analyze_calibration_takes_edgeqs_range_methods(digits_run):
    """sensitivity/plan quantize from one calibration: an entropy-ranged one beats min/max on an outlier."""
    from edgeq.models.load import load_keras_model
    from edgeq.quantize.calibration import calibrate, predict
    from edgeq.shims.tflite import tensor_ranges

    d = _hot_pixel_digits()
    model = load_keras_model(digits_run.fp32_model)
    minmax, mse = calibrate(model, d, 128), calibrate(model, d, 128, ranges="entropy")
    assert mse.ranges == "entropy" and mse.nodes == minmax.nodes
    input_range = {c.ranges: tensor_ranges(c.calibrated)[0] for c in (minmax, mse)}
    assert input_range["minmax"][1] == pytest.approx(40.0) and input_range["entropy"][1] < 10.0, input_range
    reference = predict(minmax.float_model, d.x_test)
    sqnr = {c.ranges: _sqnr_vs(reference, predict(c.quantize(), d.x_test)) for c in (minmax, mse)}
    assert sqnr["entropy"] > sqnr["minmax"] + 3.0, sqnr
    # the debugger's per-layer statistics come from the same recalibrated model
    # read from each op's own tensors: before, most held what later ops wrote, NaN among it
    # (numpy's "invalid value encountered in cast", then averaged away by nanmean)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        mse.debugger.run()
    stats = mse.debugger.layer_statistics
    assert stats and not any(np.isnan([v["rmse_over_scale"], v["channel_sqnr_db"]]).any() for v in stats.values())


def test_plan_records_its_ranges_and_convert_plan_uses_them(cli, digits_run, tmp_path):
    plan = tmp_path / "plan.json"
    args = ("--data", "digits", "--max-drop", "5", "--out", plan, "--calib-samples", "64", "--ranges", "percentile")
    result = cli("analyze", "plan", digits_run.fp32_model, *args)
    assert result.exit_code == 0, result.output
    saved = json.loads(plan.read_text())
    assert saved["ranges"] == "percentile"
    # full INT8 is within 5 pp on digits: no layer needs ranking, and none was ranked
    assert saved["met"] and saved["layers"] == {} and saved["ranking"] == [] and len(saved["frontier"]) == 1, saved
    out = tmp_path / "planned.tflite"
    args = ("--int8", "--plan", plan, "--calib", "digits", "--calib-samples", "64", "--out", out)
    result = cli("convert", digits_run.fp32_model, *args)
    assert result.exit_code == 0, result.output
    manifest = json.loads(out.with_name("planned.manifest.json").read_text())
    assert manifest["ptq"]["chosen"] == "percentile" and manifest["ptq"]["plan"] == str(plan)
    assert any("percentile activation ranges" in n for n in manifest["notes"])


def test_concatenations_get_one_range_so_the_converter_adds_no_requantization(tmp_path):
    """A DenseNet-like chain (PAD -> MAX_POOL -> CONCATENATION -> ... -> CONCATENATION): TFLite's
    int8 kernels of these want one scale on all their tensors. edgeq's ranges (here percentile)
    replace the converter's calibrated min/max tensor by tensor, and the converter's quantizer
    then gives the chain one scale as it does for its own: no QUANTIZE op (a second rounding)."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.models.compat import keras
    from edgeq.runtime.flatbuffer import read_tflite

    layers = keras.layers
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 16, 3))
    stem = layers.Conv2D(8, 3, padding="same", activation="relu")
    x = layers.MaxPooling2D(3, strides=2)(layers.ZeroPadding2D(1)(stem(inp)))
    for i in range(3):
        conv = layers.Conv2D(8 * (i + 1), 3, padding="same")
        x = layers.Concatenate()([x, conv(layers.ReLU()(layers.BatchNormalization()(x)))])
    model = keras.Model(inp, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))
    rng = np.random.default_rng(0)
    samples = rng.random((64, 16, 16, 3)).astype(np.float32)
    model(samples, training=True)  # BN statistics of a sort, not their initial 0 and 1

    calib = tmp_path / "calib.npz"
    np.savez(calib, x=samples, y=np.zeros(len(samples), np.int64))
    out = tmp_path / "dense.tflite"
    convert(model, out, ConvertOptions(mode="int8-only", calib=f"npz:{calib}", ptq="percentile", min_sqnr_db=-100.0))
    graph = read_tflite(out).subgraphs[0]
    ops = [op.op_type for op in graph.operators]
    assert ops.count("CONCATENATION") == 3 and "QUANTIZE" not in ops, ops
    concat_scales = {
        graph.tensors[t].scale
        for op in graph.operators
        if op.op_type == "CONCATENATION"
        for t in (*op.inputs, *op.outputs)
    }
    assert len(concat_scales) == 1, concat_scales


def _ops_and_scales(path):
    from edgeq.runtime.flatbuffer import read_tflite

    graph = read_tflite(path).subgraphs[0]
    return graph, [op.op_type for op in graph.operators]


def test_an_average_pooling_into_a_concatenation_gets_the_converters_ranges(tmp_path):
    """A DenseNet transition (BN-ReLU-1x1 conv-AveragePooling2D) feeding the next block's
    concatenations. TF-MOT leaves that pooling without a fake-quant; edgeq observes its output,
    gives the chain one range and the conv before the pooling the pooling's narrower range,
    as the converter's own calibration does: no QUANTIZE op, and the same scales as the
    converter's minmax (before, the conv's own wider range widened the chain by 19%)."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.models.compat import keras

    layers = keras.layers
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 16, 3))
    x = layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    x = layers.Conv2D(8, 1, use_bias=False, name="transition_conv")(x)
    x = layers.AveragePooling2D(2, name="transition_pool")(x)
    for _ in range(2):
        y = layers.Conv2D(8, 3, padding="same", use_bias=False)(layers.ReLU()(layers.BatchNormalization()(x)))
        x = layers.Concatenate()([x, y])
    model = keras.Model(inp, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))
    samples = np.random.default_rng(0).random((300, 16, 16, 3)).astype(np.float32)
    model(samples[:64], training=True)
    path = tmp_path / "transition.keras"
    model.save(path)
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=samples, y=np.zeros(len(samples), np.int64))
    scales = {}
    for ptq in ("converter", "minmax"):
        out = tmp_path / f"{ptq}.tflite"
        convert(path, out, ConvertOptions(mode="int8-only", calib=f"npz:{calib}", ptq=ptq, min_sqnr_db=-100.0))
        graph, ops = _ops_and_scales(out)
        assert "QUANTIZE" not in ops, (ptq, ops)
        scales[ptq] = [
            graph.tensors[op.outputs[0]].scale
            for op in graph.operators
            if op.op_type in ("AVERAGE_POOL_2D", "CONCATENATION")
        ]
        assert len(set(scales[ptq])) == 1, (ptq, scales[ptq])  # the chain has one scale
    assert scales["minmax"][0] == pytest.approx(scales["converter"][0], rel=0.02)


def _mobilenet_v3_like():
    """tf_keras' MobileNetV3 way: hard-swish and the SE gate's hard-sigmoid built of TF ops."""
    from edgeq.models.compat import keras

    layers = keras.layers
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 16, 3))
    y = layers.Conv2D(8, 3, padding="same")(inp)
    y = layers.Multiply()([y, layers.ReLU(6.0)(y + 3.0) * (1.0 / 6.0)])  # hard-swish
    gate = layers.GlobalAveragePooling2D(keepdims=True)(y)
    gate = layers.Conv2D(4, 1, activation="relu")(gate)
    gate = layers.ReLU(6.0)(layers.Conv2D(8, 1)(gate) + 3.0) * (1.0 / 6.0)  # hard-sigmoid
    y = layers.Multiply()([y, gate])
    y = layers.Conv2D(8, 1)(y)
    y = layers.Multiply()([y, layers.ReLU(6.0)(y + 3.0) * (1.0 / 6.0)])
    return keras.Model(inp, layers.Dense(10)(layers.GlobalAveragePooling2D()(y)))


def test_hard_swish_becomes_add_mul_so_xnnpack_runs_the_model_in_one_partition(tmp_path):
    """The converter fuses hard-swish into HARD_SWISH, which this LiteRT's XNNPACK has no int8
    kernel for: its MobileNetV3Small runs in 20 delegate partitions, 1.6x slower than as
    ADD/MUL, all in one. edgeq's pass writes each int8 HARD_SWISH as ADD(x, 3)+RELU6, MUL by x,
    MUL by 1/6, for every range method (the converter's included), and the outputs stay
    within 2 output steps of the fused op's. A conversion that keeps HARD_SWISH fails here."""
    from ai_edge_litert.interpreter import Interpreter

    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.quantize.passes import unfuse_hard_swish

    model = _mobilenet_v3_like()
    samples = np.random.default_rng(0).normal(0, 1, (300, 16, 16, 3)).astype(np.float32)
    path = tmp_path / "mnv3_like.keras"
    model.save(path)
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=samples, y=np.zeros(len(samples), np.int64))

    def partitions(content):
        interpreter = Interpreter(model_content=content)  # LiteRT's default CPU delegate, XNNPACK
        interpreter.allocate_tensors()
        return [op["op_name"] for op in interpreter._get_ops_details()].count("DELEGATE")  # noqa: SLF001

    for ptq in ("converter", "mse"):
        out = tmp_path / f"{ptq}.tflite"
        convert(path, out, ConvertOptions(mode="int8-only", calib=f"npz:{calib}", ptq=ptq, min_sqnr_db=-100.0))
        ops = _ops_and_scales(out)[1]
        assert "HARD_SWISH" not in ops and ops.count("MUL") >= 6, (ptq, ops)
        assert partitions(out.read_bytes()) == 1
    fused = _int8_only_with_ranges(model, samples[:100], None, "converter")
    unfused, count = unfuse_hard_swish(fused)
    assert count == 2 and partitions(fused) > 1 == partitions(unfused)

    def run(content):
        from edgeq.runtime.interpreter import TFLiteModel

        return TFLiteModel(model_content=content, use_default_delegates=False).predict(samples[200:], batch_size=1)

    step = Interpreter(model_content=fused).get_output_details()[0]["quantization"][0]
    assert np.max(np.abs(run(unfused) - run(fused))) <= 2.01 * step


def test_the_range_observer_keeps_a_uniform_sample_in_bounded_memory(monkeypatch):
    """Calibration adds one sample at a time: 400 adds of 1,000 values with a cap of 2,000.
    The sample stays at the cap, and each add's share of it is its share of the values seen
    (the old one grew by 1/8 of each add past the cap, and kept the first adds 8x as often)."""
    from edgeq.quantize import ranges

    monkeypatch.setattr(ranges, "_SAMPLE_CAP", 2000)
    observer = ranges.Observer(seed=0)
    for batch in range(400):
        observer.add(np.full(1000, batch, dtype=np.float32) + np.linspace(0, 0.5, 1000, dtype=np.float32))
    values = observer.values()
    assert len(values) <= 2000 + 2  # the cap, plus the exact min and max when sampled away
    assert values.min() == 0.0 and values.max() == np.float32(399.5)
    share_first = np.mean(np.floor(values) < 40)  # the first tenth of the adds
    assert 0.07 < share_first < 0.13, share_first
    # what it keeps depends on the values and their order only, not on how they were batched
    one_by_one, batched = ranges.Observer(seed=3), ranges.Observer(seed=3)
    stream = np.random.default_rng(1).normal(size=6000).astype(np.float32)
    for i in range(0, 6000, 250):
        one_by_one.add(stream[i : i + 250])
    for i in range(0, 6000, 1500):
        batched.add(stream[i : i + 1500])
    assert np.array_equal(np.sort(one_by_one.values()), np.sort(batched.values()))


def test_w4a8_stores_4_bit_codes_in_integer_kernels_and_adaround_lowers_the_error(cli, digits_run, tmp_path):
    """--weight-bits 4: per-channel 4-bit weights inside an int8-only model, the codes read back from the
    .tflite in [-8, 7]; AdaRound's learned rounding beats nearest on each layer's output and overall."""
    from ai_edge_litert.interpreter import Interpreter

    from edgeq.runtime.flatbuffer import is_integer_only, read_tflite

    results = {}
    for rounding in ("nearest", "adaround"):
        out = tmp_path / f"w4_{rounding}.tflite"
        result = cli(
            "convert", digits_run.fp32_model, "--int8-only", "--weight-bits", "4", "--rounding", rounding,
            "--ptq", "minmax", "--calib", "digits", "--calib-samples", "64", "--out", out,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        desc = read_tflite(out)
        assert is_integer_only(desc)
        interpreter = Interpreter(model_path=str(out))
        weights = [t for t in desc.main.tensors if t.is_constant and t.dtype in ("int4", "int8") and t.scale]
        assert len(weights) == 4  # conv1, conv2, conv3, logits
        for t in weights:
            codes = interpreter.get_tensor(t.index)
            assert codes.min() >= -8 and codes.max() <= 7 and len(np.unique(codes)) <= 16, t.name
        manifest = json.loads((tmp_path / f"w4_{rounding}.manifest.json").read_text())
        assert manifest["options"]["weight_bits"] == 4 and manifest["ptq"]["rounding"]["weight_bits"] == 4
        results[rounding] = manifest
    layers = results["adaround"]["ptq"]["rounding"]["layers"]
    assert all(la["output_mse"] <= la["output_mse_nearest"] for la in layers)
    assert any(la["output_mse"] < 0.8 * la["output_mse_nearest"] for la in layers)
    sqnr = {r: m["verification"]["sqnr_db"] for r, m in results.items()}
    assert sqnr["adaround"] > sqnr["nearest"], sqnr
    eight = tmp_path / "w8.tflite"
    assert cli("convert", digits_run.fp32_model, "--int8-only", "--calib", "digits", "--out", eight).exit_code == 0
    assert (tmp_path / "w4_nearest.tflite").stat().st_size < 0.75 * eight.stat().st_size  # packed two per byte
    codes = read_tflite(tmp_path / "w4_nearest.tflite").main
    assert sum(t.dtype == "int4" for t in codes.tensors if t.is_constant) == 4
    assert_one_line_error(
        cli("convert", digits_run.fp32_model, "--weight-bits", "4", "--ptq", "converter", "--calib", "digits"),
        "--ptq converter",
    )
    assert_one_line_error(cli("convert", digits_run.qat_model, "--weight-bits", "4"), "QAT model")


def test_adaround_learns_a_strided_1x1_convolution_exactly_as_the_layer_computes_it():
    """A residual 1x1 stride-2 conv (mini-Xception, ResNet shortcuts): AdaRound's output function
    equals the layer, and learning through it completes (TF 2.21's gradient of a strided 1x1 conv
    crashed the process; edgeq convolves the subsampled input instead)."""
    from edgeq.models.compat import keras, tf
    from edgeq.transforms.adaround import _linear, adaround, kernel_scale

    keras.utils.set_random_seed(0)
    for size, padding in ((60, "same"), (61, "valid")):
        layer = keras.layers.Conv2D(16, 1, strides=2, padding=padding)
        x = np.random.default_rng(0).normal(size=(16, size, size, 8)).astype(np.float32)
        expected = layer(x).numpy()
        got = _linear(layer)(tf.constant(x), layer.kernel).numpy()
        assert got.shape == expected.shape and np.allclose(got, expected, atol=1e-5)
        codes, result = adaround(layer, x, kernel_scale(layer), iterations=20)
        assert np.abs(codes).max() <= 127 and result.output_mse <= result.output_mse_nearest


@pytest.mark.parametrize("method", ["percentile", "mse", "entropy"])
def test_analyze_ranges_and_convert_ptq_build_the_same_quantized_model(tmp_path, method):
    """One range engine: ``analyze --ranges M`` and ``convert --ptq M`` both quantize the
    converter's calibration with every min/max re-chosen by M (ActivationRanges), so every
    int8 tensor of the two models has the same scale and zero point (from the CLI also on
    keras.applications MobileNetV2 and a Keras 3 MobileNetV3Small: no scale differs). An int16
    plan's mixed model observes the same tensors with the same observers for LiteRT Quantizer."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.data.sources import load_dataset
    from edgeq.models.compat import keras
    from edgeq.quantize.calibration import calibrate
    from edgeq.runtime.flatbuffer import read_tflite

    layers = keras.layers
    keras.utils.set_random_seed(0)
    inp = keras.Input((12, 12, 3))
    x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", use_bias=False)(inp)))
    x = layers.Concatenate()([layers.Conv2D(6, 1, activation="relu")(x), layers.MaxPooling2D(1)(x)])
    x = layers.Flatten()(layers.AveragePooling2D(2)(x))
    model = keras.Model(inp, layers.Dense(5)(x))
    rng = np.random.default_rng(0)
    samples = rng.normal(0.3, 0.2, (48, 12, 12, 3))
    samples[7, 3, 5, 1] = 8.0  # one outlier
    model(samples.astype(np.float32), training=True)  # BN statistics of a sort
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=samples.astype(np.float32))
    dataset = load_dataset(f"npz:{calib}", (12, 12, 3), labels_required=False)

    analyzed = tmp_path / "analyzed.tflite"
    analyzed.write_bytes(calibrate(model, dataset, 48, ranges=method).quantize())
    converted = tmp_path / "converted.tflite"
    options = ConvertOptions(mode="int8", calib=f"npz:{calib}", calib_samples=48, ptq=method, min_sqnr_db=-100.0)
    convert(model, converted, options)

    def activations(path):
        graph = read_tflite(path).subgraphs[0]
        return [
            (op.op_type, graph.tensors[t].scale[0], graph.tensors[t].zero_point[0])
            for op in graph.operators
            for t in op.outputs
            if graph.tensors[t].dtype == "int8"
        ]

    a, c = sorted(activations(analyzed)), sorted(activations(converted))  # the two list the ops in other orders
    assert a == c
    # An int16 plan's model (LiteRT Quantizer, int8 I/O) with no layer widened has the same ranges
    # where its graph is the converter's: not here, where LiteRT Quantizer gives a concatenation's
    # inputs their own scales (the converter gives them the output's) and keeps the Flatten's
    # RESHAPE; so a chain without either (as MobileNetV2, where all 64 scales match from the CLI).
    from edgeq.quantize.mixed import calibrate_mixed

    h = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(8, 3, use_bias=False)(inp)))
    h = layers.DepthwiseConv2D(3, padding="same", activation="relu")(h)
    chain = keras.Model(inp, layers.Dense(5)(layers.GlobalAveragePooling2D()(layers.Conv2D(6, 1)(h))))
    chain(samples.astype(np.float32), training=True)
    mixed = tmp_path / "mixed.tflite"
    mixed.write_bytes(calibrate_mixed(chain, dataset.calibration_samples(48), ranges=method).quantize([]))
    integer = tmp_path / "integer.tflite"
    convert(chain, integer, ConvertOptions(**{**options.__dict__, "mode": "int8-only"}))
    assert sorted(activations(mixed)) == sorted(activations(integer))
    minmax = tmp_path / "minmax.tflite"  # and M is not min/max by another name: some range is clipped
    minmax.write_bytes(calibrate(model, dataset, 48).quantize())
    narrower = [op for (op, s_m, _), (_, s_a, _) in zip(sorted(activations(minmax)), a) if s_a < 0.99 * s_m]
    assert narrower, (a, activations(minmax))


def test_w4a8_names_the_kernels_it_leaves_to_the_converter(tmp_path):
    """edgeq chooses the codes of Conv2D, DepthwiseConv2D and Dense kernels; any other kernel (here a
    Conv1D's) keeps the converter's 8-bit min/max weights, and the manifest and note say which."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.models.compat import keras
    from edgeq.runtime.flatbuffer import read_tflite

    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 3))
    x = keras.layers.Conv1D(4, 3, activation="relu", name="conv1d")(inp)
    model = keras.Model(inp, keras.layers.Dense(5, name="head")(keras.layers.Flatten()(x)))
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.random.default_rng(0).normal(size=(120, 16, 3)).astype(np.float32))
    out = tmp_path / "w4.tflite"
    options = ConvertOptions(mode="int8-only", calib=f"npz:{calib}", ptq="minmax", weight_bits=4, min_sqnr_db=-100.0)
    result = convert(model, out, options)
    manifest = json.loads(out.with_name("w4.manifest.json").read_text())
    rounding = manifest["ptq"]["rounding"]
    assert rounding["converter_weights"] == ["conv1d"] and [la["layer"] for la in rounding["layers"]] == ["head"]
    assert any("left to the converter" in n and "conv1d" in n for n in result.notes), result.notes
    weights = sorted(t.dtype for t in read_tflite(out).main.tensors if t.is_constant and t.dtype in ("int4", "int8"))
    assert weights == ["int4", "int8"], weights


def test_the_converters_calibration_records_a_residual_branch_with_the_sums_range_and_minmax_does_not(tmp_path):
    """TFLite's calibrator logs an op's inputs after the op ran. An ADD that writes its output over
    one input (here the small branch b of a + b) has by then replaced b's values with the sum's, so
    the converter records b with the sum's range: +-48.5 for values within +-8.8, a 5.6x coarser
    int8 step in the converted model. edgeq observes every tensor in an interpreter that keeps each
    one: --ptq minmax gives b its own range. (Here b's step barely matters next to the sum's: the
    two models' SQNR is the same; on a trained MobileNetV3Small too, 13.8 dB on 1199 test samples.)"""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.models.compat import keras
    from edgeq.quantize.calibration import ActivationRanges
    from edgeq.runtime.flatbuffer import read_tflite
    from edgeq.shims.tflite import tensor_ranges

    layers = keras.layers
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 4))
    a = layers.Conv2D(8, 3, padding="same", kernel_initializer=keras.initializers.RandomNormal(0, 2.0))(inp)
    b = layers.Conv2D(8, 1, kernel_initializer=keras.initializers.RandomNormal(0, 0.05))(a)
    model = keras.Model(inp, layers.Dense(3)(layers.GlobalAveragePooling2D()(layers.Add()([a, b]))))
    x = np.random.default_rng(0).normal(0, 1, (200, 8, 8, 4)).astype(np.float32)
    ranges = ActivationRanges(x[:64])
    _int8_only_with_ranges(model, x[:64], ranges, "minmax")
    recorded, chosen = tensor_ranges(ranges.calibrated), tensor_ranges(ranges.with_ranges("minmax"))
    beyond = [
        i for i, (lo, hi) in recorded.items()
        if hi > 2 * ranges.observers[i].high or lo < 2 * ranges.observers[i].low  # values it never held
    ]  # fmt: skip
    assert len(beyond) == 1, (recorded, chosen)
    (branch,) = beyond
    assert chosen[branch][1] == pytest.approx(ranges.observers[branch].high)  # what b held
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=x)
    steps = {}
    for ptq in ("converter", "minmax"):
        options = ConvertOptions(mode="int8-only", calib=f"npz:{calib}", calib_samples=64, ptq=ptq)
        convert(model, tmp_path / f"{ptq}.tflite", options)
        graph = read_tflite(tmp_path / f"{ptq}.tflite").main
        convs = [op for op in graph.operators if op.op_type == "CONV_2D"]
        steps[ptq] = graph.tensors[convs[1].outputs[0]].scale[0]  # b's int8 step
    assert steps["converter"] > 4 * steps["minmax"], steps
