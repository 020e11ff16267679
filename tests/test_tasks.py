"""Every model a user brings: several inputs and outputs matched by name, each output judged by its task.

Tiny Keras 3 and tf_keras models with set or briefly trained weights: what is tested is how
edgeq names, verifies, scores and trains their outputs, with the real converter and LiteRT.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgeq.tasks.table import OutputSpec, infer_kind, roc_auc, score
from tests.conftest import assert_one_line_error

MODES = ("fp32", "fp16", "dynamic", "int8", "int8-only", "int16x8")


def test_auc_and_partial_auc_equal_scikit_learns():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    for n, ties in ((50, False), (400, True)):
        labels = rng.integers(0, 2, n)
        scores = rng.normal(labels * 0.8, 1.0)
        if ties:
            scores = np.round(scores, 1)
        assert roc_auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
        assert roc_auc(labels, scores, 0.1) == pytest.approx(roc_auc_score(labels, scores, max_fpr=0.1), abs=1e-12)
    assert np.isnan(roc_auc(np.zeros(5), np.arange(5)))  # one class: no AUC, not a made-up 0.5


def test_the_task_of_an_output_comes_from_its_activation_shape_and_targets():
    assert infer_kind((10,), "softmax") == "classification"
    assert infer_kind((1,), "sigmoid") == "binary"
    assert infer_kind((5,), "sigmoid") == "multilabel"
    assert infer_kind((10,), "linear", np.array([1, 2, 3])) == "classification"  # logits
    assert infer_kind((1,), "linear", np.array([[1.5], [2.0]], np.float32)) == "regression"
    assert infer_kind((4,), "linear") == "other"  # a box head with no targets: compared, never given an accuracy
    assert infer_kind((640,), None, None, input_shape=(640,)) == "reconstruction"
    assert infer_kind((123, 123, 2), "softmax") == "other"  # a score map is no class-score vector
    spec = OutputSpec("price", "regression", (1,))
    got = score(spec, np.array([[1.0], [2.0], [4.0]]), np.array([[1.0], [3.0], [3.0]]))
    assert got["mae"] == pytest.approx(2 / 3) and got["max_error"] == 1.0
    assert got["rmse"] == pytest.approx(np.sqrt(2 / 3)) and got["r2"] == pytest.approx(1 - 2 / (8 / 3))


def _face_model(path, three: bool):
    """A Keras 3 face-detector refinement stage: box offsets (linear), a face probability
    (softmax), and with ``three`` ten landmark coordinates (linear): as MTCNN's RNet and ONet."""
    import keras

    rng = np.random.default_rng(3)
    inputs = keras.Input((12, 12, 3), name="image")
    h = keras.layers.Conv2D(8, 3, activation="relu", name="conv")(inputs)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    h = keras.layers.Dense(16, activation="relu", name="fc")(h)
    outputs = [keras.layers.Dense(4, name="bbox_reg")(h)]
    if three:
        outputs.append(keras.layers.Dense(10, name="landmarks")(h))
    outputs.append(keras.layers.Dense(2, activation="softmax", name="face_prob")(h))
    model = keras.Model(inputs, outputs)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(np.float32) for w in model.get_weights()])
    model.save(path)
    return model


def _face_data(path, model, n=400):
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 1, (n, 12, 12, 3)).astype(np.float32)
    outputs = model.predict(x, verbose=0)
    box, face = outputs[0], outputs[-1]
    arrays = {"x": x, "y_face_prob": face.argmax(1), "y_bbox_reg": box + rng.normal(0, 0.05, box.shape).astype("f4")}
    np.savez(path, **arrays)
    return arrays


@pytest.fixture(scope="module")
def face(tmp_path_factory):
    folder = tmp_path_factory.mktemp("face")
    model = _face_model(folder / "onet.keras", three=True)
    _face_data(folder / "faces.npz", model)
    return folder


@pytest.mark.parametrize("mode", MODES)
def test_a_three_output_keras3_model_converts_in_every_mode_each_output_verified(cli, face, tmp_path, mode):
    out = tmp_path / f"onet_{mode}.tflite"
    result = cli("convert", face / "onet.keras", f"--{mode}", "--calib", f"npz:{face / 'faces.npz'}", "--out", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads(out.with_name(f"onet_{mode}.manifest.json").read_text())
    assert [o["name"] for o in manifest["outputs"]] == ["bbox_reg", "landmarks", "face_prob"]  # the model's order
    tasks = {o["name"]: o["task"] for o in manifest["outputs"]}
    assert tasks == {"bbox_reg": "regression", "landmarks": "other", "face_prob": "classification"}
    verified = {o["name"]: o for o in manifest["verification"]["outputs"]}
    assert set(verified) == {"bbox_reg", "landmarks", "face_prob"} and all(o["passed"] for o in verified.values())
    assert verified["face_prob"]["agreement"] is not None and verified["bbox_reg"]["agreement"] is None
    if mode == "int8-only":
        assert manifest["verification"]["integer_only"]
        assert {o["dtype"] for o in manifest["outputs"]} == {"int8"}  # every output tensor, not the first


def test_edgeqs_range_methods_and_weight_rounding_take_a_three_output_model(cli, face, tmp_path):
    """--ptq auto scores every candidate by its worst output (as verification gates), and an
    edgeq method with chosen weight rounding converts the Keras 3 three-head model too."""
    data = f"npz:{face / 'faces.npz'}"
    out = tmp_path / "auto.tflite"
    result = cli("convert", face / "onet.keras", "--int8-only", "--calib", data, "--ptq-target", "200", "--out", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads(out.with_name("auto.manifest.json").read_text())
    candidates = manifest["ptq"]["candidates"]
    assert [c["method"] for c in candidates] == ["converter", "minmax", "percentile", "mse", "entropy"]
    assert manifest["ptq"]["chosen"] == max(candidates, key=lambda c: c["sqnr_db"])["method"]
    out = tmp_path / "rounded.tflite"
    args = ("--int8-only", "--calib", data, "--ptq", "percentile", "--rounding", "stochastic", "--seed", "1")
    result = cli("convert", face / "onet.keras", *args, "--out", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads(out.with_name("rounded.manifest.json").read_text())
    assert manifest["ptq"]["chosen"] == "percentile" and manifest["ptq"]["rounding"]["method"] == "stochastic"
    assert len(manifest["ptq"]["rounding"]["layers"]) == 5  # conv, fc and the three heads
    assert all(o["passed"] for o in manifest["verification"]["outputs"]) and manifest["verification"]["integer_only"]


def test_outputs_the_converter_reorders_are_matched_by_name(tmp_path):
    """tf_keras model with three heads of one shape: the .tflite lists its output tensors in another
    order than the model (checked), yet each is read and verified as the Keras output of its name
    (matched by position, each would carry another head's values)."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.models.compat import keras
    from edgeq.models.load import keras_outputs
    from edgeq.runtime.interpreter import TFLiteModel

    inputs = keras.Input((6,), name="features")
    h = keras.layers.Dense(8, activation="relu", name="trunk")(inputs)
    heads = [keras.layers.Dense(3, name=name)(h) for name in ("zeta", "alpha")]
    heads.append(keras.layers.Dense(3, name="mid", activation="softmax")(h))
    model = keras.Model(inputs, heads)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (300, 6)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    for mode in ("fp32", "int8-only"):
        options = ConvertOptions(mode=mode, calib=f"npz:{tmp_path / 'd.npz'}")
        result = convert(model, tmp_path / f"m_{mode}.tflite", options)
        assert [o["name"] for o in result.verification.outputs] == ["zeta", "alpha", "mid"]
        assert all(o["passed"] for o in result.verification.outputs)
    tflite = TFLiteModel(tmp_path / "m_fp32.tflite")
    assert tflite.output_names != ["zeta", "alpha", "mid"], "the converter kept the order: this test shows nothing"
    got, want = tflite.predict_outputs(x[:50]), keras_outputs(model, x[:50])
    for name in ("zeta", "alpha", "mid"):
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)


def test_eval_profile_and_report_judge_each_output_by_its_task(cli, face, tmp_path):
    data = f"npz:{face / 'faces.npz'}"
    out = tmp_path / "onet_int8.tflite"
    assert cli("convert", face / "onet.keras", "--int8-only", "--calib", data, "--out", out).exit_code == 0
    assert (
        cli("convert", face / "onet.keras", "--fp32", "--calib", data, "--out", tmp_path / "onet_fp32.tflite").exit_code
        == 0
    )
    result = cli("eval", out, "--reference", face / "onet.keras", "--data", data, "--json", tmp_path / "eval.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "eval.json").read_text())
    rows = {o["name"]: o for o in report["outputs"]}
    assert rows["face_prob"]["task"] == "classification" and "accuracy" in rows["face_prob"]["metrics"]
    assert rows["bbox_reg"]["task"] == "regression" and {"mae", "rmse", "r2"} <= set(rows["bbox_reg"]["metrics"])
    assert rows["landmarks"]["metrics"] == {} and rows["landmarks"]["comparison"]["sqnr_db"] > 10
    assert "face_prob (classification): accuracy" in result.stdout and "bbox_reg (regression): rmse" in result.stdout
    # a budget on every output's own metric: an impossible one fails, naming the output
    gated = cli("eval", out, "--reference", face / "onet.keras", "--data", data, "--max-drop", "-50")
    assert gated.exit_code == 4 and "face_prob: accuracy 100.00% -> " in gated.stderr, gated.output
    assert "bbox_reg: RMSE" in gated.stderr and "% RMSE worse (n=80, 95% CI" in gated.stderr, gated.stderr

    np.savez(tmp_path / "device.npz", **{k: v for k, v in np.load(face / "faces.npz").items()})
    profiled = cli(
        "profile", out, "--compare", tmp_path / "onet_fp32.tflite", "--data", tmp_path / "device.npz",
        "--runs", "2", "--json", tmp_path / "profile.json",
    )  # fmt: skip
    assert profiled.exit_code == 0, profiled.output
    device = json.loads((tmp_path / "profile.json").read_text())
    measured = {o["name"]: o for o in device["model"]["scores"]["outputs"]}
    assert measured["face_prob"]["metrics"]["accuracy"] == pytest.approx(
        rows["face_prob"]["metrics"]["accuracy"], abs=0.05
    )
    assert {o["name"] for o in device["agreement"]["outputs"]} == {"bbox_reg", "landmarks", "face_prob"}
    page = tmp_path / "report.html"
    assert cli("report", tmp_path / "eval.json", tmp_path / "profile.json", out, "--out", page).exit_code == 0
    html = page.read_text()
    assert 'id="outputs"' in html and 'data-output="landmarks"' in html and "face_prob" in html


def test_a_two_input_model_reads_one_array_per_input_name(cli, tmp_path):
    import keras

    image, meta = keras.Input((6, 6, 1), name="image"), keras.Input((3,), name="meta")
    h = keras.layers.Concatenate(name="cat")([keras.layers.Flatten(name="flat")(image), meta])
    model = keras.Model([image, meta], keras.layers.Dense(4, activation="softmax", name="label")(h))
    rng = np.random.default_rng(2)
    xi, xm = rng.uniform(0, 1, (300, 6, 6, 1)).astype("f4"), rng.uniform(0, 1, (300, 3)).astype("f4")
    y = model.predict([xi, xm], verbose=0).argmax(1)
    np.savez(tmp_path / "two.npz", x_image=xi, x_meta=xm, y=y)
    model.save(tmp_path / "two.keras")
    out = tmp_path / "two_int8.tflite"
    result = cli(
        "convert", tmp_path / "two.keras", "--int8-only", "--calib", f"npz:{tmp_path / 'two.npz'}", "--out", out
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads(out.with_name("two_int8.manifest.json").read_text())
    assert sorted(i["name"] for i in manifest["inputs"]) == ["image", "meta"]
    ranged = tmp_path / "two_mse.tflite"  # edgeq's ranges observe each input from its own array
    args = ("--int8-only", "--calib", f"npz:{tmp_path / 'two.npz'}", "--ptq", "mse", "--out", ranged)
    result = cli("convert", tmp_path / "two.keras", *args)
    assert result.exit_code == 0, result.output
    assert json.loads(ranged.with_name("two_mse.manifest.json").read_text())["ptq"]["chosen"] == "mse"
    evaluated = cli("eval", out, "--reference", tmp_path / "two.keras", "--data", f"npz:{tmp_path / 'two.npz'}")
    assert evaluated.exit_code == 0 and "accuracy" in evaluated.stdout, evaluated.output
    assert cli("profile", out, "--data", tmp_path / "two.npz", "--runs", "2").exit_code == 0
    missing = tmp_path / "one.npz"
    np.savez(missing, x_image=xi, y=y)
    assert_one_line_error(cli("profile", out, "--data", missing, "--runs", "1"), "x_meta")


def test_input_shape_fixes_a_fully_convolutional_model(cli, tmp_path):
    import keras

    inputs = keras.Input((None, None, 3), name="image")
    h = keras.layers.Conv2D(4, 3, activation="relu", name="c1")(inputs)
    model = keras.Model(inputs, [keras.layers.Conv2D(2, 1, name="heat")(h), keras.layers.Conv2D(4, 1, name="box")(h)])
    model.save(tmp_path / "fcn.keras")
    np.savez(tmp_path / "cam.npz", x=np.random.default_rng(0).uniform(0, 1, (40, 24, 32, 3)).astype("f4"))
    refused = cli("convert", tmp_path / "fcn.keras", "--int8-only", "--calib", f"npz:{tmp_path / 'cam.npz'}")
    assert_one_line_error(refused, "free dimensions", "--input-shape")
    out = tmp_path / "fcn_int8.tflite"
    fixed = cli(
        "convert", tmp_path / "fcn.keras", "--int8-only", "--calib", f"npz:{tmp_path / 'cam.npz'}",
        "--input-shape", "24x32x3", "--out", out,
    )  # fmt: skip
    assert fixed.exit_code == 0, fixed.output
    manifest = json.loads(out.with_name("fcn_int8.manifest.json").read_text())
    assert manifest["inputs"][0]["shape"] == [1, 24, 32, 3]
    assert {o["name"]: o["shape"] for o in manifest["outputs"]} == {"heat": [1, 22, 30, 2], "box": [1, 22, 30, 4]}


def test_heads_of_different_ranges_concatenated_into_one_output_are_named(cli, tmp_path):
    """Boxes in pixels beside scores in [0, 1] in one tensor share one int8 scale: convert says so."""
    import keras

    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="trunk")(inputs)
    boxes = keras.layers.Dense(4, name="boxes", kernel_initializer=keras.initializers.Constant(80.0))(h)
    scores = keras.layers.Dense(3, activation="sigmoid", name="scores")(h)
    model = keras.Model(inputs, keras.layers.Concatenate(name="detections")([boxes, scores]))
    model.save(tmp_path / "det.keras")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).uniform(0, 1, (200, 8)).astype("f4"))
    result = cli("convert", tmp_path / "det.keras", "--int8", "--calib", f"npz:{tmp_path / 'd.npz'}", "--min-sqnr", "0")
    assert result.exit_code == 0, result.output
    assert "concatenates tensors whose ranges differ" in result.output and "'detections'" in result.output


# the autoencoder's train/convert/eval path in make test: test_verdicts' AUC one; this recipe's with EDGEQ_SLOW=1
@pytest.mark.parametrize("recipe", ["diabetes-regression", pytest.param("ad-autoencoder", marks=pytest.mark.slow)])
def test_regression_and_an_anomaly_autoencoder_train_qat_convert_and_eval(cli, tmp_path, recipe):
    """Float targets and an autoencoder (no targets: its input; normal samples only for training),
    through FP32 -> QAT -> --int8-only -> eval, each by its task's metric."""
    out = tmp_path / "run"
    data = "diabetes" if recipe == "diabetes-regression" else "machine-sound:600"
    epochs = (
        ("--epochs", "40", "--qat-epochs", "2")
        if recipe == "diabetes-regression"
        else ("--epochs", "6", "--qat-epochs", "1")
    )
    compare = ("--compare-int8",) if recipe != "diabetes-regression" else ()
    trained = cli("train", recipe, "--data", data, "--out", out, *epochs, *compare)
    assert trained.exit_code == 0, trained.output
    run = json.loads((out / "run.json").read_text())
    if compare:  # PTQ vs QAT by the autoencoder's AUC on val, anomalies included
        gain = run["int8_comparison"]
        assert gain["metric"] == "auc" and all(0.6 < gain[k]["value"] <= 1.0 for k in ("ptq", "qat")), gain
        assert "int8 on val (AUC, n=" in trained.output
    task = "regression" if recipe == "diabetes-regression" else "reconstruction"
    assert [o["task"] for o in run["outputs"]] == [task]
    assert run["results"][0]["metric"] == ("rmse" if task == "regression" else "auc")
    tflite = out / "int8.tflite"
    converted = cli("convert", out / "qat.h5", "--int8-only", "--out", tflite)
    assert converted.exit_code == 0, converted.output
    result = cli("eval", tflite, "--reference", out / "fp32.keras", "--data", data, "--json", tmp_path / "e.json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "e.json").read_text())["outputs"]
    assert row["task"] == task
    if task == "regression":
        assert row["metrics"]["rmse"] < 100 and row["reference_metrics"]["rmse"] < 100  # the targets' std is 77
    else:
        assert {"auc", "pauc", "reconstruction_mse"} <= set(row["metrics"]) and row["reference_metrics"]["auc"] > 0.6


def test_a_multi_output_savedmodel_converts_with_its_outputs_named(cli, tmp_path):
    """A tf_keras model saved as a SavedModel folder with three sigmoid heads (as an audio model
    with contour, note and onset posteriorgrams): --fp32 and --int8, each output verified by name."""
    from edgeq.models.compat import keras

    inputs = keras.Input((32, 1), name="audio")
    h = keras.layers.Conv1D(4, 5, activation="relu", name="c1")(inputs)
    h = keras.layers.Flatten(name="flat")(h)
    heads = [keras.layers.Dense(6, activation="sigmoid", name=n)(h) for n in ("contour", "note", "onset")]
    keras.Model(inputs, heads).save(tmp_path / "saved", save_format="tf")
    np.savez(tmp_path / "a.npz", x=np.random.default_rng(0).uniform(-1, 1, (120, 32, 1)).astype("f4"))
    for mode in ("fp32", "int8"):
        out = tmp_path / f"sm_{mode}.tflite"
        result = cli("convert", tmp_path / "saved", f"--{mode}", "--calib", f"npz:{tmp_path / 'a.npz'}", "--out", out)
        assert result.exit_code == 0, result.output
        manifest = json.loads(out.with_name(f"sm_{mode}.manifest.json").read_text())
        assert [o["name"] for o in manifest["verification"]["outputs"]] == ["contour", "note", "onset"]
        assert {o["task"] for o in manifest["outputs"]} == {"multilabel"}
