"""What an output's accuracy means: a 1-unit sigmoid, a (N, 1, 1, K) head, an output with no classes.

Small models with set weights (no training): the point is how edgeq scores their outputs,
the same way in eval, profile and analyze.
"""

from __future__ import annotations

import json

import numpy as np

from tests.conftest import assert_one_line_error


def _binary_data(path, n=400):
    """x in [0, 1]; y = 1 where the sample's mean is above 0.5 (label 0 for most samples)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, (n, 4, 4, 1)).astype(np.float32)
    x += np.where(rng.random(n) < 0.3, 0.15, -0.15)[:, None, None, None].astype(np.float32)
    x = np.clip(x, 0.0, 1.0)
    y = (x.reshape(n, -1).mean(axis=1) > 0.5).astype(np.int64)
    np.savez(path, x=x, y=y)
    return path, y


def _sigmoid_model(sign: float):
    """Flatten -> Dense(1, sigmoid) that answers mean > 0.5 (sign +1) or its opposite (sign -1)."""
    from edgeq.models.compat import keras

    inputs = keras.Input((4, 4, 1))
    dense = keras.layers.Dense(1, activation="sigmoid", name="score")
    model = keras.Model(inputs, dense(keras.layers.Flatten()(inputs)))
    dense.set_weights([np.full((16, 1), sign * 4.0, np.float32), np.array([-sign * 32.0], np.float32)])
    return model


def test_a_sigmoid_classifier_that_answers_the_opposite_fails_max_drop(cli, tmp_path):
    """The quantized stand-in answers the opposite class every time: eval must see a drop of
    about 100 points (before, argmax of one column read 0 for both, and the gate passed),
    and profile on the device side reads the same accuracy."""
    data, y = _binary_data(tmp_path / "binary.npz")
    _sigmoid_model(+1.0).save(tmp_path / "good.keras")
    _sigmoid_model(-1.0).save(tmp_path / "opposite.keras")
    for name in ("good", "opposite"):
        result = cli("convert", tmp_path / f"{name}.keras", "--fp32", "--calib", f"npz:{data}")
        assert result.exit_code == 0, result.output
    opposite = tmp_path / "opposite_fp32.tflite"
    result = cli(
        "eval", opposite, "--reference", tmp_path / "good.keras", "--data", f"npz:{data}", "--max-drop", "1",
        "--json", tmp_path / "eval.json",
    )  # fmt: skip
    assert result.exit_code == 4, result.output
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["reference_value"] == 1.0 and report["value"] == 0.0, report
    assert report["agreement"] == 0.0
    same = cli("eval", tmp_path / "good_fp32.tflite", "--reference", tmp_path / "good.keras", "--data", f"npz:{data}")
    assert same.exit_code == 0, same.output
    # profile (device side, no TensorFlow) scores the same output the same way
    profiled = cli("profile", opposite, "--data", data, "--runs", "2", "--json", tmp_path / "p.json")
    assert profiled.exit_code == 0, profiled.output
    assert json.loads((tmp_path / "p.json").read_text())["model"]["scores"]["value"] == 0.0


def test_a_head_of_shape_1x1xk_is_scored_per_sample_and_an_image_output_is_refused(cli, tmp_path):
    """(N, 1, 1, K) scores: argmax over K per sample (before, (N, 1, 1) broadcast against y gave a
    mean over N x N pairs); an output with no class axis has no accuracy: one line, not a number."""
    from edgeq.data.sources import load_dataset
    from edgeq.evaluate.run import evaluate
    from edgeq.models.compat import keras

    rng = np.random.default_rng(1)
    x = rng.uniform(0, 1, (300, 4, 4, 1)).astype(np.float32)
    inputs = keras.Input((4, 4, 1))
    conv = keras.layers.Conv2D(3, 4, padding="valid", name="head")
    model = keras.Model(inputs, conv(inputs))
    conv.set_weights([rng.normal(0, 1, (4, 4, 1, 3)).astype(np.float32), np.zeros(3, np.float32)])
    scores = model.predict(x, verbose=0)
    assert scores.shape == (300, 1, 1, 3)
    y = scores.reshape(300, 3).argmax(1)
    y[:30] = (y[:30] + 1) % 3  # 10% wrong labels: accuracy 0.9 exactly
    np.savez(tmp_path / "d.npz", x=x, y=y)
    model.save(tmp_path / "head.keras")
    assert cli("convert", tmp_path / "head.keras", "--fp32", "--calib", f"npz:{tmp_path / 'd.npz'}").exit_code == 0
    result = evaluate(tmp_path / "head_fp32.tflite", tmp_path / "head.keras", f"npz:{tmp_path / 'd.npz'}")
    test = load_dataset(f"npz:{tmp_path / 'd.npz'}")
    at = [{row.tobytes(): i for i, row in enumerate(x)}[row.tobytes()] for row in test.x_test]
    expected = float(np.mean(scores.reshape(300, 3).argmax(1)[at] == test.y_test))
    assert 0.8 < expected < 1.0
    assert result.reference_value == result.value == expected

    image = keras.Model(inputs, keras.layers.Conv2D(2, 1, name="mask")(inputs))
    image.save(tmp_path / "mask.keras")
    assert cli("convert", tmp_path / "mask.keras", "--fp32", "--calib", f"npz:{tmp_path / 'd.npz'}").exit_code == 0
    refused = cli(
        "eval",
        tmp_path / "mask_fp32.tflite",
        "--reference",
        tmp_path / "mask.keras",
        "--data",
        f"npz:{tmp_path / 'd.npz'}",
    )
    assert_one_line_error(refused, "4, 4, 2)", "not one score per class")
