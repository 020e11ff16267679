"""Label-free QAT by distillation, and what QAT bought over PTQ of the same FP32 weights.

Real training (tf_keras + TF-MOT), the real converter and LiteRT: a trained digits model is
the pretrained model a user brings, its samples without labels the data they have.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import assert_one_line_error


@pytest.fixture(scope="module")
def unlabelled(tmp_path_factory):
    """The digits samples as a user without labels holds them: an .npz of x only."""
    from edgeq.data.sources import load_dataset

    d = load_dataset("digits")
    path = tmp_path_factory.mktemp("unlabelled") / "x.npz"
    np.savez(path, x=np.concatenate([d.x_train, d.x_val, d.x_test]).astype(np.float32))
    return path, d


def test_qat_learns_the_fp32_models_outputs_when_the_data_has_no_labels(digits_run, unlabelled, tmp_path, cli):
    npz, digits = unlabelled
    out = tmp_path / "run"
    result = cli(
        "train", digits_run.fp32_model, "--data", f"npz:{npz}", "--qat-epochs", "1", "--out", out, "--compare-int8"
    )
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["distillation"]["reason"] == "the data has no labels"
    assert list(run["distillation"]["losses"].values()) == ["KLDivergence"]  # a softmax head
    assert [s["kind"] for s in run["results"]] == ["qat"]  # no labels: no FP32 epochs
    assert run["results"][0]["metric"] == "agreement"
    assert run["results"][0]["val_value"] > 0.9

    # The QAT int8 model, judged against the true labels the training never saw.
    from edgeq.runtime.interpreter import TFLiteModel

    got = TFLiteModel(out / "qat_int8.tflite").predict_outputs(digits.x_test)
    accuracy = float(np.mean(np.argmax(next(iter(got.values())), axis=1) == digits.y_test))
    fp32 = digits_run.stages[0].test_value
    assert accuracy > fp32 - 0.03, (accuracy, fp32)
    comparison = run["int8_comparison"]
    assert comparison["metric"] == "accuracy" and comparison["qat"]["value"] > 0.9  # agreement with FP32's classes
    assert "QAT" in result.output and "int8 on val" in result.output

    # QAT fine-tuned in inference mode: every BatchNormalization still holds the FP32 model's moving statistics
    from edgeq.models.load import load_user_model

    assert run["quantization"]["batchnorm_during_qat"] == "frozen"
    fp32_model, tuned = load_user_model(digits_run.fp32_model), load_user_model(out / "qat_float.keras")
    norms = [la.name for la in fp32_model.layers if type(la).__name__ == "BatchNormalization"]
    assert norms and all(
        np.array_equal(a, b)
        for name in norms
        for a, b in zip(fp32_model.get_layer(name).get_weights()[2:], tuned.get_layer(name).get_weights()[2:])
    )
    # judged on val before and after each epoch (agreement with the teacher); the best epoch is kept
    (stage,) = json.loads((out / "history.json").read_text())["stages"]
    judged = [e["val_judged"] for e in stage["epochs"]]
    assert len(judged) == 1 and stage["kept_epoch"] in (0, 1) and 0.9 < judged[0] <= 1.0


def test_no_labels_refuses_fp32_epochs_and_reference_models(digits_run, unlabelled, tmp_path, cli):
    npz, _ = unlabelled
    result = cli("train", digits_run.fp32_model, "--data", f"npz:{npz}", "--epochs", "2", "--out", tmp_path / "a")
    assert_one_line_error(result, "no labels", "--epochs 0")
    result = cli("train", "digits-cnn", "--data", f"npz:{npz}", "--out", tmp_path / "b")
    assert_one_line_error(result, "no labels", "'y'")  # a reference model learns from labels
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_distill_with_labels_gives_each_output_its_loss(tmp_path, cli):
    """A two-output model (class + value): --distill trains each head on the teacher's outputs."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 16)).astype(np.float32)
    y_cls = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1).astype(np.int64)
    y_val = (x[:, :4].sum(axis=1, keepdims=True)).astype(np.float32)
    inputs = keras.Input((16,), name="features")
    h = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    model = keras.Model(
        inputs,
        [keras.layers.Dense(3, activation="softmax", name="kind")(h), keras.layers.Dense(1, name="size")(h)],
    )
    model.compile("adam", ["sparse_categorical_crossentropy", "mse"])
    model.fit(x, [y_cls, y_val], epochs=20, verbose=0)
    model.save(tmp_path / "two.keras")
    np.savez(tmp_path / "d.npz", x=x, y_kind=y_cls, y_size=y_val)
    out = tmp_path / "run"
    result = cli(
        "train", tmp_path / "two.keras", "--data", f"npz:{tmp_path / 'd.npz'}", "--epochs", "0",
        "--qat-epochs", "2", "--distill", "--out", out, "--compare-int8",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["distillation"] == {
        "teacher": "fp32.keras",
        "reason": "--distill",
        "losses": {"kind": "KLDivergence", "size": "mse"},
    }
    assert run["results"][0]["metric"] == "accuracy"  # with labels: still judged against them
    comparison = run["int8_comparison"]
    assert comparison["output"] == "kind" and comparison["better"] in ("qat", "ptq", "tie", None)


def test_qat_says_what_it_bought_over_ptq_of_the_same_weights(digits_run, tmp_path):
    """Both int8 models are kept; each value equals edgeq eval's on the same val split, and the
    interval is a paired one around the difference."""
    import shutil

    from edgeq.analyze.qat_gain import compare_run, summary
    from edgeq.evaluate.run import evaluate

    out = tmp_path / "run"
    shutil.copytree(digits_run.out_dir, out)
    comparison = compare_run(out)
    assert comparison["metric"] == "accuracy" and comparison["samples"] > 0
    for key in ("ptq", "qat"):
        path = out / comparison[key]["path"]
        assert path.is_file()
        judged = evaluate(path, out / "fp32.keras", "digits", split="val")
        assert comparison[key]["value"] == pytest.approx(judged.value, abs=1e-9)
    low, high = comparison["interval95"]
    gain = comparison["qat_gain"]  # points of accuracy QAT is better by
    assert gain == pytest.approx((comparison["qat"]["value"] - comparison["ptq"]["value"]) * 100, abs=1e-3)
    assert low <= gain <= high and comparison["change_unit"] == "pp"
    assert comparison["within_noise"] == (low <= 0 <= high)
    line = summary(comparison)
    assert "PTQ of fp32" in line and "95% CI" in line and f"n={comparison['samples']}" in line
    run = json.loads((out / "run.json").read_text())
    assert run["int8_comparison"] == json.loads(json.dumps(comparison))
    assert set(run["artifacts"]) >= {"ptq_int8.tflite", "qat_int8.tflite"}


def test_paired_interval_sees_a_real_difference_and_none_where_there_is_none():
    from edgeq.tasks.verdicts import paired_interval

    rng = np.random.default_rng(1)
    truth = rng.integers(0, 2, 2000)
    a = truth.copy()
    a[:100] = 1 - a[:100]  # 95% right
    b = truth.copy()
    b[1900:] = 1 - b[1900:]  # also 95% right, different samples

    def gain(pred):
        return lambda idx: float(np.mean(pred[idx] == truth[idx]) - np.mean(a[idx] == truth[idx]))

    (low, high), undefined = paired_interval(gain(b), len(truth))
    assert low < 0 < high and undefined == 0  # equal accuracy: the interval holds 0
    c = truth.copy()
    c[:20] = 1 - c[:20]  # 99% right, its errors a subset of a's
    (low, high), _ = paired_interval(gain(c), len(truth))
    assert 0 < low < 0.04 < high < 0.06  # +4 points, told apart from noise
