"""What QAT bought: the PTQ int8 model of the FP32 weights beside the QAT int8 model, on val.

After ``edgeq train`` (``compare_run`` on its folder), both are converted ``--int8-only`` (the
PTQ one as ``edgeq convert fp32.keras --int8-only`` would) and kept, ``ptq_int8.tflite`` and
``qat_int8.tflite``; both are scored on the same val samples by the first output's task metric,
against the labels (or, without labels, the FP32 model's answers). The difference QAT - PTQ
comes with a paired bootstrap 95% interval over the samples, so a user sees whether the QAT
epochs paid off or whether the difference is within noise. run.json records it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from edgeq.errors import EdgeqError
from edgeq.tasks.metrics import metric as metric_row
from edgeq.tasks.verdicts import paired_interval

log = logging.getLogger(__name__)

PTQ_NAME = "ptq_int8.tflite"
QAT_INT8_NAME = "qat_int8.tflite"


def _convert(source: Path, out: Path) -> dict:
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert

    try:
        result = convert(source, out, ConvertOptions(mode="int8-only"))
    except EdgeqError as exc:
        log.warning("int8 comparison: %s did not convert (%s)", source.name, str(exc).splitlines()[0])
        return {"error": str(exc).splitlines()[0]}
    return {"path": out.name, "size_bytes": result.size_bytes, "verified_sqnr_db": result.verification.sqnr_db}


def compare_run(out_dir: str | Path) -> dict | None:
    """Compare PTQ and QAT int8 for the finished training run in ``out_dir`` and add the result to
    its run.json (``int8_comparison``, the two files' hashes under ``artifacts``).

    Returns:
        The ``int8_comparison`` record, or None where there is nothing to compare: no QAT model,
        a detector (judge each with ``edgeq eval``: mAP), or no val samples.
    """
    from edgeq.analyze.sensitivity import LABEL_FREE_KINDS, fp32_answers
    from edgeq.artifacts import sha256_file, write_json_atomic
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import keras_outputs, load_user_model, recorded_normalization
    from edgeq.tasks.table import OutputSpec
    from edgeq.train.distill import NO_LABELS

    out_dir = Path(out_dir)
    run = json.loads((out_dir / "run.json").read_text(encoding="utf-8"))
    fp32 = out_dir / "fp32.keras"
    qat = out_dir / ("qat.keras" if (run.get("quantization") or {}).get("engine") == "keras3" else "qat.h5")
    if not (fp32.is_file() and qat.is_file()) or not run.get("outputs"):
        return None
    first = run["outputs"][0]
    spec = OutputSpec(first["name"], first["task"], tuple(first["shape"]), first.get("threshold", 0.5), "recorded")
    if spec.kind.startswith("detection"):
        return None
    shape = run["input_shape"]
    shape = {k: tuple(v) for k, v in shape.items()} if isinstance(shape, dict) else tuple(shape)
    dataset = load_dataset(
        run["data"]["source"], shape, labels_required=False, normalization=recorded_normalization(fp32)
    )
    if dataset.count("val") == 0:
        return None
    x = dataset.split("val")[0]
    label_free = (run.get("distillation") or {}).get("reason") == NO_LABELS or not dataset.labelled
    if label_free:
        targets = keras_outputs(load_user_model(fp32), x)[spec.name]  # no labels: the FP32 model's answers
        if spec.kind in LABEL_FREE_KINDS:
            targets = fp32_answers(spec, targets)
    elif spec.kind == "reconstruction":
        targets = dataset.targets("val")  # normal/anomalous labels, for the AUC
    else:
        targets = dataset.targets("val", spec.name if isinstance(dataset.y_val, dict) else None)
    record = compare_int8(out_dir, fp32, qat, dataset, spec, targets)
    # scored against FP32's own answers: the share is top-1 agreement with FP32, and says so
    record["label_free"] = bool(label_free and spec.kind in LABEL_FREE_KINDS)
    run["int8_comparison"] = record
    for key in ("ptq", "qat"):
        if "path" in record[key]:
            run.setdefault("artifacts", {})[record[key]["path"]] = sha256_file(out_dir / record[key]["path"])
    write_json_atomic(out_dir / "run.json", run)
    return record


def compare_int8(out_dir: Path, fp32: Path, qat: Path, dataset, spec, targets, split: str = "val") -> dict:
    """Convert both models, score both on ``split`` by ``spec``'s primary metric against ``targets``
    (class ids or values of the first output; the FP32 model's outputs where the data has no labels),
    and name the better one. Returns run.json's ``int8_comparison`` record."""
    from edgeq.runtime.interpreter import TFLiteModel
    from edgeq.tasks.table import score, task

    record = {"split": split, "output": spec.name, "metric": task(spec.kind).primary}
    models = {"ptq": _convert(fp32, out_dir / PTQ_NAME), "qat": _convert(qat, out_dir / QAT_INT8_NAME)}
    record.update(models)
    x = dataset.split(split)[0]
    n = dataset.count(split)
    if n == 0 or targets is None or not record["metric"]:
        record["better"] = None
        return record
    metric = record["metric"]
    inputs = x if not isinstance(x, dict) else None
    targets = np.asarray(targets)
    outputs = {}
    for name, row in models.items():
        if "error" in row:
            continue
        outputs[name] = TFLiteModel(out_dir / row["path"]).predict_outputs(x, batch_size=64)[spec.name]
        row["value"] = float(score(spec, outputs[name], targets, inputs).get(metric, float("nan")))
    record["samples"] = n
    if len(outputs) < 2:
        record["better"] = next(iter(outputs), None)
        return record

    def at(out, idx):
        return score(spec, out[idx], targets[idx], inputs[idx] if inputs is not None else None).get(metric, math.nan)

    row = metric_row(metric)
    ptq, qat = models["ptq"]["value"], models["qat"]["value"]
    # how much better QAT is than PTQ, in the metric's change unit, over paired resamples of the same samples
    gain = row.worse_by(qat, ptq)

    def gain_at(idx):
        got = row.worse_by(at(outputs["qat"], idx), at(outputs["ptq"], idx))
        return math.nan if got is None else got

    (low, high), undefined = paired_interval(gain_at, n)
    record["qat_gain"] = gain
    record["change_unit"] = row.change
    record["interval95"] = [low, high]
    record["undefined_resamples"] = undefined
    record["within_noise"] = bool(math.isfinite(low) and low <= 0.0 <= high) or not math.isfinite(low)
    record["better"] = None if gain is None else "qat" if gain > 0 else "ptq" if gain < 0 else "tie"
    return record


def summary(record: dict) -> str:
    """One line for the terminal: both values, QAT's gain with n and its interval, the better one."""
    row = metric_row("agreement" if record.get("label_free") else record.get("metric") or "")
    parts = []
    for name, label in (("ptq", "PTQ of fp32"), ("qat", "QAT")):
        got = record.get(name, {})
        parts.append(f"{label} {'failed' if 'error' in got else row.show(got['value']) if 'value' in got else '-'}")
    n = f", n={record['samples']}" if "samples" in record else ""
    line = f"int8 on {record['split']} ({row.label}{n}): " + ", ".join(parts)
    if record.get("qat_gain") is not None:
        low, high = record["interval95"]
        unit = row.change_label
        interval = f"95% CI {low:+.2f}..{high:+.2f} {unit}" if math.isfinite(low) else "95% CI undefined"
        line += f"; QAT better by {record['qat_gain']:+.2f} {unit} ({interval})"
        if record["within_noise"]:
            line += ": within noise"
        elif record.get("better"):
            line += f": {record['better'].upper()} is better"
    elif record.get("better"):
        line += f": {record['better'].upper()}"
    return line
