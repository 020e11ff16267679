"""Bad input: one line that names the problem and the fix, a non-zero exit, nothing half-written."""

import numpy as np
import pytest

from tests.conftest import assert_one_line_error


def _listing(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) if folder.exists() else []


def test_missing_model_file(cli, tmp_path):
    for args in (
        ("train", tmp_path / "nope.keras", "--data", "digits", "--out", tmp_path / "o"),
        ("convert", tmp_path / "nope.keras", "--int8-only", "--calib", "digits"),
        ("eval", tmp_path / "nope.tflite", "--reference", tmp_path / "nope.keras", "--data", "digits"),
    ):
        assert_one_line_error(cli(*args), "nope")
    assert not (tmp_path / "o").exists()


def test_file_that_is_not_a_model(cli, tmp_path):
    junk = tmp_path / "junk.keras"
    junk.write_bytes(b"this is not a model")
    out = tmp_path / "junk.tflite"
    assert_one_line_error(
        cli("convert", junk, "--int8-only", "--calib", "digits", "--out", out), "junk.keras", "not a Keras file"
    )
    assert not out.exists()
    assert_one_line_error(cli("train", junk, "--data", "digits", "--out", tmp_path / "t"), "junk.keras")


def test_data_whose_shape_does_not_fit_the_model(cli, digits_run, tmp_path):
    out = tmp_path / "t"
    result = cli("train", digits_run.fp32_model, "--data", "synthetic:16x16x3:10", "--epochs", "1", "--out", out)
    assert_one_line_error(result, "(16, 16, 3)", "(8, 8, 1)")
    assert _listing(out) == []
    conv_out = tmp_path / "c.tflite"
    result = cli("convert", digits_run.fp32_model, "--int8-only", "--calib", "synthetic:16x16x3:10", "--out", conv_out)
    assert_one_line_error(result, "(16, 16, 3)", "(8, 8, 1)")
    assert not conv_out.exists()


def test_empty_dataset(cli, digits_run, tmp_path):
    empty = tmp_path / "empty.npz"
    np.savez(empty, x=np.zeros((0, 8, 8, 1), np.float32), y=np.zeros(0, np.int64))
    out = tmp_path / "t"
    assert_one_line_error(cli("train", digits_run.fp32_model, "--data", f"npz:{empty}", "--out", out), "empty")
    assert _listing(out) == []
    assert_one_line_error(cli("convert", digits_run.fp32_model, "--int8-only", "--calib", f"npz:{empty}"), "empty")


def test_nan_in_the_data_is_named_not_a_dtype_mismatch(cli, digits_run, tmp_path):
    x = np.random.default_rng(0).uniform(0, 1, size=(60, 8, 8, 1)).astype(np.float32)
    x[7, 2, 3, 0] = np.nan
    bad = tmp_path / "nan.npz"
    np.savez(bad, x=x, y=np.arange(60) % 10)
    out = tmp_path / "nan.tflite"
    result = cli("convert", digits_run.fp32_model, "--int8-only", "--calib", f"npz:{bad}", "--out", out)
    assert_one_line_error(result, "NaN or infinity", "split")
    assert not out.exists()
    result = cli("train", digits_run.fp32_model, "--data", f"npz:{bad}", "--out", tmp_path / "t")
    assert_one_line_error(result, "NaN or infinity")
    assert _listing(tmp_path / "t") == []


def test_wrong_number_of_classes(cli, digits_run, tmp_path):
    result = cli("train", digits_run.fp32_model, "--data", "synthetic:8x8x1:4", "--out", tmp_path / "t")
    assert_one_line_error(result, "4 classes", "outputs 10")


def test_unknown_reference_model_lists_the_known_ones(cli, tmp_path):
    assert_one_line_error(cli("train", "resnet50", "--out", tmp_path / "t"), "digits-cnn", "mobilenetv2")


def test_finished_run_is_not_overwritten_without_force(cli, digits_run):
    result = cli("train", "digits-cnn", "--out", digits_run.out_dir)
    assert_one_line_error(result, "--force")
    assert digits_run.qat_model.is_file()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--weight-bits", "9"), "--weight-bits"),
        (("--schedule", "nosuch.json"), "nosuch.json"),
    ],
)
def test_bad_options(cli, tmp_path, args, fragment):
    result = cli("train", "digits-cnn", "--out", tmp_path / "t", *args)
    assert result.exit_code != 0
    assert fragment in result.output
