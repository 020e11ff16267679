"""`edgeq optimize`: the ladder (PTQ, target plan, QAT, QAT with the plan's islands), each candidate chosen on
val and confirmed once on test.

The models are small and built here: a digits MLP whose int8 XNNPACK kernels run about 3x faster than its
float ones (its two 1024-wide layers are weight-bound at batch 1), so "faster than FP32 beyond a median's
noise" holds by a wide margin on a loaded machine; and test_target_plans' outlier CNN, which full int8 with
min/max ranges cannot quantize and QAT can.
"""

import json

import numpy as np
import pytest

from edgeq.analyze.plan import PlanPoint
from edgeq.analyze.speed import _as_fast, _choose, _unresolved_faster, in_disguise
from edgeq.data.sources import load_dataset
from edgeq.data.splits import stratified_split
from edgeq.models.compat import keras
from edgeq.optimize.ladder import refusal, resolvable_agreement
from edgeq.train.stages import _compile
from tests.conftest import assert_one_line_error


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    keras.utils.set_random_seed(0)
    d = load_dataset("digits")
    L = keras.layers
    inputs = L.Input((8, 8, 1), name="input")
    h = L.Flatten(name="flat")(inputs)
    h = L.Dense(1024, activation="relu", name="fc1")(h)
    h = L.Dense(1024, activation="relu", name="fc2")(h)
    model = keras.Model(inputs, L.Dense(10, activation="softmax", name="head")(h))
    _compile(model, 1e-3)
    model.fit(d.x_train, d.y_train, epochs=8, batch_size=32, verbose=0)
    path = tmp_path_factory.mktemp("mlp") / "mlp.keras"
    model.save(path)
    return path


def _optimize(cli, model, out, *extra):
    result = cli("optimize", model, "--max-drop", "2", "--out", out, "--runs", "30", "--calib-samples", "64", *extra)
    record = json.loads((out / "optimize.json").read_text()) if (out / "optimize.json").exists() else None
    return result, record


def test_ptq_that_meets_the_budget_stops_the_ladder_at_rung_1(cli, mlp, tmp_path):
    out = tmp_path / "opt"
    result, record = _optimize(cli, mlp, out, "--data", "digits")
    assert result.exit_code == 0, result.output
    assert record["chosen"] == 1 and record["passed"] and [r["number"] for r in record["rungs"]] == [1, 2]
    ptq, plan = record["rungs"]
    assert ptq["outcome"] == "chosen" and plan["outcome"] == "skipped" and "not searched" in plan["why"]
    assert {c["way"] for c in ptq["candidates"]} == {"int8"} and len(ptq["candidates"]) == 4  # every range method
    assert ptq["latency_ms"] < 0.95 * record["fp32"]["latency_ms"] and ptq["partitions"] >= 1
    test = ptq["test"]
    assert test["n"] == record["splits"]["test"] == 359 and test["interval95"][1] <= 2 and test["passed"]
    # one folder to ship: the chosen file and its manifest, the plan, the record and the report
    assert sorted(p.name for p in out.iterdir()) == [
        "candidates", "optimize.json", "plan.json", "ptq.manifest.json", "ptq.tflite", "report.html"
    ]  # fmt: skip
    assert sorted(p.name for p in (out / "candidates").iterdir()) == ["fp32.manifest.json", "fp32.tflite"]
    fp32 = record["fp32"]
    assert fp32["latency_ms"] == min(fp32["timings_ms"]) and fp32["final_ms"] > 0
    assert json.loads((out / "ptq.manifest.json").read_text())["mode"] == "int8-only"
    page = (out / "report.html").read_text()
    assert "Optimize: the ladder" in page and "ladder frontier" in page
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("digits: val n=179 chooses, test n=359 confirms")
    assert lines[-1] == record["line"] and "(PTQ)" in lines[-1] and "n=359): pass (this host stood in" in lines[-1]
    assert any(line.startswith("rung 1 (PTQ") for line in lines) and not any("rung 3" in line for line in lines)
    # a folder that holds a run is never written over
    again = cli("optimize", mlp, "--data", "digits", "--max-drop", "2", "--out", out)
    assert_one_line_error(again, "--out", "not empty")
    assert json.loads((out / "optimize.json").read_text()) == record
    # a model that cannot be read: one line, and no folder left behind
    missing = cli("optimize", tmp_path / "none.keras", "--data", "digits", "--max-drop", "2", "--out", tmp_path / "x")
    assert_one_line_error(missing, "none.keras")
    assert not (tmp_path / "x").exists()


def test_the_outlier_cnn_that_ptq_cannot_quantize_reaches_qat_and_meets_the_budget(cli, outlier16, tmp_path):
    out = tmp_path / "opt"
    result, record = _optimize(cli, outlier16, out, "--data", "digits", "--target", "edgetpu", "--ranges", "minmax")
    assert result.exit_code == 0, result.output
    ptq, plan, qat = record["rungs"]
    assert ptq["outcome"] == "passed over" and "misses the budget on val" in ptq["why"]
    assert plan["outcome"] == "skipped" and "int8 only" in plan["why"]
    assert qat["outcome"] == "chosen" and qat["way"] == "int8 (QAT, labels)" and record["chosen"] == 3
    assert qat["val"]["interval95"][1] <= 2 and qat["test"]["interval95"][1] <= 2  # chosen on val, confirmed on test
    assert (out / "qat" / "run.json").exists() and (out / "qat.tflite").exists()
    manifest = json.loads((out / "qat.manifest.json").read_text())
    assert manifest["mode"] == "int8-only" and manifest["edgetpu"] is not None
    assert "FP32 does not run on edgetpu" in record["line"]
    assert record["line"].endswith("(this host stood in for the target)")


def test_a_candidate_chosen_on_val_that_fails_on_test_makes_the_ladder_go_on(cli, mlp, tmp_path):
    """The test split's inputs are 4x brighter than any the calibration saw: int8 clips them, FP32 does not.
    Val is as the training data, so PTQ meets the budget there; test refuses it, and QAT (whose ranges come
    from the same training data) after it: the ladder ends in one line, with every rung recorded."""
    d = load_dataset("digits")
    x = np.concatenate([d.x_train, d.x_val, d.x_test])
    y = np.concatenate([d.y_train, d.y_val, d.y_test])
    _, _, _, _, test_rows, _ = stratified_split(np.arange(len(x)), y)
    x = x.copy()
    x[test_rows] *= 4.0
    data = tmp_path / "shifted.npz"
    np.savez(data, x=x, y=y)
    out = tmp_path / "opt"
    result, record = _optimize(cli, mlp, out, "--data", f"npz:{data}")
    assert_one_line_error(result, "no rung of the ladder", "1 PTQ: failed on test", "3 QAT:")
    ptq = record["rungs"][0]
    assert ptq["outcome"] == "failed on test" and ptq["test"]["interval95"][1] > 2 and not ptq["test"]["passed"]
    assert [r["number"] for r in record["rungs"]] == [1, 2, 3, 4] and record["rungs"][2]["outcome"] != "skipped"
    assert not record["passed"] and record["chosen"] is None and "FAIL" in record["line"]
    assert not list(out.glob("*.tflite")) and (out / "candidates" / "ptq.tflite").exists()  # nothing to ship
    assert (out / "report.html").exists()


def _point(way, layers=(), size=1000, latency=1.0, worse=0.0, high=0.5):
    return PlanPoint(tuple(layers), 0.9, worse, size, latency_ms=latency, ranges="minmax", way=way, worse_by_high=high)


def test_an_fp32_model_in_disguise_never_ends_the_ladder():
    fp32 = {"size_bytes": 1000, "latency_ms": 2.0, "value": 0.9}
    mostly = _point("float islands", ["a", "b", "c"], size=400)
    heavy = _point("float islands", ["a"], size=950)
    real = _point("float islands", ["a"], size=300, latency=1.5)
    assert in_disguise(mostly, 4, 1000) == "float islands: 3 of 4 layers float, 40% of FP32's size"
    assert in_disguise(heavy, 4, 1000).startswith("float islands: 1 of 4") and in_disguise(real, 4, 1000) is None
    for disguised in (mostly, heavy):  # as fast as it may be, and within the budget: never the ladder's end
        assert "FP32 model in disguise" in refusal(disguised, fp32, 1.0, True, 4, None)
    assert refusal(real, fp32, 1.0, True, 4, None) is None
    # the plan keeps a real quantized model before a faster disguised one; with none, it names the disguise
    best, _, meeting = _choose([mostly, real], lambda p: True, None, lambda p: in_disguise(p, 4, 1000))
    assert best is real and meeting == [real]
    best, _, _ = _choose([mostly], lambda p: True, None, lambda p: in_disguise(p, 4, 1000))
    assert best is mostly
    assert "not faster than FP32" in refusal(_point("int8", latency=1.95), fp32, 1.0, True, 4, None)
    assert refusal(_point("int8", latency=1.95), fp32, 1.0, False, 4, None) is None  # an int8-only target
    assert "--max-size" in refusal(_point("int8", size=5000), fp32, 1.0, True, 4, 2048)
    assert "misses the budget" in refusal(_point("int8", high=1.2), fp32, 1.0, True, 4, None)


def test_a_faster_candidate_within_the_budget_by_its_interval_is_not_called_point_estimate_only():
    """EfficientNetB0's plan said "within the budget by its point estimate only ... at most +0.83" of a
    candidate whose upper end was within a 1 pp budget: the same-speed rule had passed it over."""
    best = _point("int8", latency=1.00, worse=0.1, high=0.6)
    tied = _point("int8", latency=0.97, worse=0.3, high=0.83)
    unsure = _point("int8", latency=0.90, worse=0.4, high=1.4)
    assert _unresolved_faster([best, tied], best, 1.0, None) is None
    assert _as_fast([best, tied], best, [best, tied]) == [1]
    assert _unresolved_faster([best, tied, unsure], best, 1.0, None) == 2  # within it by its point estimate only


def test_what_an_interval_can_resolve_at_n():
    assert resolvable_agreement(600, 1.0) == pytest.approx(0.9844, abs=1e-4)
    assert resolvable_agreement(1199, 1.0) == pytest.approx(0.9688, abs=1e-4)
    assert resolvable_agreement(10, 100.0) == 0.0
