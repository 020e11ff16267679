"""The main job, digits-cnn end to end, against the numbers the project promises."""

import json

import numpy as np

from edgeq.data.sources import load_dataset
from edgeq.evaluate.run import evaluate
from edgeq.models.load import load_keras_model
from edgeq.runtime.interpreter import TFLiteModel


def test_fp32_model_reaches_97_percent(digits_run):
    fp32 = digits_run.stages[0]
    assert fp32.kind == "fp32"
    assert fp32.test_value >= 0.97


def test_int8_only_tflite_is_within_half_a_point_of_fp32_and_under_30_percent_size(digits_run, digits_int8):
    result = evaluate(digits_int8.path, digits_run.fp32_model, "digits")
    assert result.reference_value >= 0.97
    assert result.worse_by <= 0.5
    assert result.size_ratio <= 0.30
    assert result.model_dtype == "int8"


def test_qat_keras_model_and_its_int8_tflite_agree_on_99_percent(digits_run, digits_int8):
    d = load_dataset("digits")
    qat = load_keras_model(digits_run.qat_model)  # loads back with quantize_scope
    keras_top1 = qat.predict(d.x_test, verbose=0).argmax(1)
    tflite_top1 = TFLiteModel(digits_int8.path).predict(d.x_test).argmax(1)
    assert np.mean(keras_top1 == tflite_top1) >= 0.99


def test_int8_only_model_is_integer_end_to_end_with_batch_norm_folded(digits_int8):
    model = TFLiteModel(digits_int8.path, use_default_delegates=False)
    assert model.input.dtype == "int8" and model.output.dtype == "int8"
    ops = [op.op_name for op in model.ops()]
    # BN folded into the convolutions: no separate MUL/ADD (or BN) op is left.
    assert not {"MUL", "ADD", "SUB", "BATCH_NORMALIZATION"} & set(ops), ops
    assert ops.count("CONV_2D") == 3
    for op in model.ops():
        assert not {"float32", "float16"} & (set(op.input_dtypes) | set(op.output_dtypes)), op


def test_training_folder_holds_models_history_and_run_record(digits_run):
    out = digits_run.out_dir
    assert (out / "fp32.keras").is_file() and (out / "qat.h5").is_file()
    assert not (out / "checkpoint").exists()  # cleaned up after a complete run
    history = json.loads((out / "history.json").read_text())
    assert [s["name"] for s in history["stages"]] == ["fp32", "qat-w8a8"]
    assert all(len(s["epochs"]) == s["epochs"][-1]["epoch"] for s in history["stages"])
    assert {"loss", "accuracy", "val_accuracy", "seconds"} <= set(history["stages"][1]["epochs"][0])
    run = json.loads((out / "run.json").read_text())
    assert run["complete"] and run["data"]["source"] == "digits" and len(run["data"]["sha256"]) == 64
    assert run["provenance"]["versions"]["tensorflow-model-optimization"] == "0.8.1"
    assert run["normalization"]["scale"] == 1 / 16


def test_manifest_records_mode_io_hashes_and_verification(digits_run, digits_int8):
    manifest = json.loads(digits_int8.manifest.read_text())
    assert manifest["mode"] == "int8-only"
    assert manifest["input"]["dtype"] == "int8" and manifest["input"]["scale"] > 0
    assert manifest["output"]["dtype"] == "int8"
    import hashlib

    assert manifest["sha256"] == hashlib.sha256(digits_int8.path.read_bytes()).hexdigest()
    assert manifest["source"]["qat"] is True and len(manifest["source"]["sha256"]) == 64
    assert manifest["verification"]["passed"] and manifest["verification"]["integer_only"]
    assert manifest["verification"]["agreement"] >= 0.99
    assert "ai-edge-litert" in manifest["provenance"]["versions"]


def test_eval_cli_table_json_and_max_drop_gate(cli, digits_run, digits_int8, tmp_path):
    out = tmp_path / "eval.json"
    ok = cli(
        "eval",
        digits_int8.path,
        "--reference",
        digits_run.fp32_model,
        "--data",
        "digits",
        "--json",
        out,
        "--max-drop",
        "0.5",
    )
    assert ok.exit_code == 0, ok.output
    assert "top-1 agreement" in ok.stdout and "SQNR" in ok.stdout
    data = json.loads(out.read_text())
    for key in (
        "value",
        "reference_value",
        "worse_by",
        "agreement",
        "mae",
        "mse",
        "sqnr_db",
        "cosine",
        "size_ratio",
    ):
        assert key in data
    # A gate that the model cannot meet: a negative budget demands the int8 model beat FP32 by 5 points.
    gated = cli("eval", digits_int8.path, "--reference", digits_run.fp32_model, "--data", "digits", "--max-drop", "-5")
    assert gated.exit_code == 4
    assert "over --max-drop -5" in gated.stderr and "n=359, 95% CI" in gated.stderr and "FAIL" in gated.stderr
