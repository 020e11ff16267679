"""Quantized vs FP32: each output judged by its task, and how far the outputs differ.

``evaluate`` loads the models, and needs TensorFlow only when the reference is a Keras
model; outputs are matched by name (the .tflite signature names them as the Keras model
does), and scored by ``edgeq.tasks.table`` (numpy only): accuracy for classifiers, MAE/RMSE/R²
for regression, AUC for an anomaly-detection autoencoder, SQNR for everything.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from edgeq.errors import DataError, ModelLoadError, QualityGateError
from edgeq.models.spec import ModelSpec, describe_tflite
from edgeq.tasks.metrics import metric
from edgeq.tasks.table import OutputSpec, compare, score, task, worse_by
from edgeq.tasks.verdicts import NothingJudged, Verdict, judge, verdict_of


@dataclass(frozen=True)
class EvalResult:
    model: str
    reference: str
    data: str
    samples: int
    # the first output with a primary metric (the only one of a classifier; a detector's mAP@0.5):
    # its value for both models (``metric`` names it, ``unit`` is its unit) and how much worse the
    # model is, in ``change_unit`` (negative: better); None where nothing scores it
    value: float | None
    reference_value: float | None
    worse_by: float | None
    agreement: float | None
    mae: float
    mse: float
    max_abs_error: float
    sqnr_db: float  # the lowest over the outputs
    cosine: float
    size_bytes: int
    reference_size_bytes: int  # the FP32 TFLite size (converted in memory for a Keras reference)
    size_ratio: float
    model_dtype: str
    budget: float | None = None  # --max-drop, in each judged output's change unit
    passed: bool = True
    outputs: tuple[dict, ...] = ()  # each output: name, task, metrics of both models, worse_by, comparison
    labelled: bool = True
    detection: dict | None = None  # a detector's mAP@0.5 and mAP@0.5:0.95, both models (pycocotools)
    # each judged output: metric, unit, both values, worse_by with n and its paired 95% interval, pass/fail
    verdicts: tuple[dict, ...] = ()
    metric: str | None = None  # what value, reference_value and worse_by measure (edgeq.tasks.metrics.METRICS)
    unit: str | None = None  # of value: "%" for a share (stored as a fraction), "" for the target's units
    change_unit: str | None = None  # of worse_by: "pp", "%" (of an error), "points"
    matching: str | None = None  # how outputs were matched with the reference's when names differ (None: by name)

    def to_dict(self) -> dict:
        return {"kind": "edgeq.eval", **_json_safe(asdict(self))}


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _reference_outputs(reference: Path, x) -> tuple[dict, int, ModelSpec]:
    """Every output of the reference by name, the size of its FP32 TFLite form, and its ModelSpec."""
    from edgeq.runtime.interpreter import TFLiteModel

    if reference.suffix == ".tflite":
        from edgeq.quantize.float_model import prepared_float_model

        # a float file runs as convert read it (MediaPipe's custom transposed conv as TRANSPOSE_CONV, float16
        # constants as float32): the same outputs within float error, and it loads where LiteRT lacks its ops
        content = reference.read_bytes()
        if _is_float(content, reference):
            content = prepared_float_model(content, str(reference)).content
        ref = TFLiteModel(model_content=content)
        return ref.predict_outputs(x, batch_size=1), reference.stat().st_size, describe_tflite(ref, reference)
    from edgeq.models.load import describe, keras_outputs, load_user_model
    from edgeq.shims.tflite import keras_converter, native_output_silenced

    model = load_user_model(reference)
    converter = keras_converter(model)
    with native_output_silenced():
        fp32_size = len(converter.convert())
    return keras_outputs(model, x, batch_size=256), fp32_size, describe(model, reference)


def _is_float(content: bytes, where: Path) -> bool:
    """A float file (float inputs and outputs, no int8 activations): what convert's passes read."""
    from edgeq.runtime.flatbuffer import verify_tflite

    main = verify_tflite(content, str(where)).main
    io = [main.tensors[i] for i in (*main.inputs, *main.outputs)]
    return all(t.dtype == "float32" for t in io) and not any(t.dtype == "int8" for t in main.tensors)


def _targets(dataset, names: list[str]) -> dict:
    """Each output's targets on val (test without val): what an undeclared task is inferred from."""
    if dataset is None or not dataset.labelled:
        return {}
    split = "val" if dataset.count("val") else "test"
    return {name: dataset.targets(split, name if len(names) > 1 else None) for name in names}


def evaluate(
    model: str | Path,
    reference: str | Path,
    data: str,
    split: str = "test",
    max_drop_pp: float | None = None,
    task_spec: str | None = None,
) -> EvalResult:
    """Every output of both models on a data split, each scored by its task, and how far they differ.

    ``max_drop_pp`` is the budget for every output's primary metric, in its task's unit.
    """
    from edgeq.data.sources import load_dataset

    model, reference = Path(model), Path(reference)
    for path in (model, reference):
        if not path.exists():
            raise ModelLoadError(f"{path}: no such model file")
    if model.suffix != ".tflite":
        raise ModelLoadError(f"{model}: edgeq eval compares a .tflite model; convert it first (edgeq convert)")
    from edgeq.runtime.interpreter import TFLiteModel, with_joins

    quantized = with_joins(TFLiteModel(model))  # outputs convert split, read as the file's one output
    described = describe_tflite(quantized, model)
    input_shape = described.input_shape
    inp = quantized.input
    # raw files in the model's units (its manifest), float files checked against them
    dataset = load_dataset(
        data,
        input_shape=input_shape,
        labels_required=False,
        normalization=described.normalization,
        int8_input=(inp.scale, inp.zero_point) if inp.dtype == "int8" and len(described.inputs) == 1 else None,
    )
    dataset.check_fits(input_shape, where=f"model {model}")
    x, _ = dataset.split(split)
    got = quantized.predict_outputs(x, batch_size=1)
    ref, ref_size, reference_spec = _reference_outputs(reference, x)
    names = described.output_names
    parts = _split_reference(reference, x, names) if not all(n in ref for n in names) else None
    ref = parts or ref
    ref, matching = _matched(names, got, ref, reference)
    if parts:
        matching = "the reference's concatenated output(s) split into their parts, as convert --split-outputs did"
    specs = described.judged_with(reference_spec).tasks(task_spec, _targets(dataset, names))
    rows, primary, verdicts = _scored(specs, ref, got, dataset, split, x, max_drop_pp, model)
    detection = _detection(specs, ref, got, dataset, split, model, max_drop_pp, task_spec)
    if detection is not None:  # a detector is judged by its mAP@0.5, both heads together
        primary = {
            "worse_by": detection["worse_by"],
            "primary": "map50",
            "metrics": {"map50": detection["map50"]},
            "reference_metrics": {"map50": detection["reference_map50"]},
        }
    if max_drop_pp is not None and not verdicts and detection is None:
        raise NothingJudged(
            f"--max-drop {max_drop_pp:g}: nothing in {data} ({split}) scores {model.name}'s outputs "
            f"({', '.join(f'{s.name}: {s.kind}' for s in specs)}), so there is nothing to judge; give labels "
            "('y', or 'y_<output>' for each output) or declare the tasks with --task"
        )
    result = _result(model, reference, f"{data} ({split})", x, rows, primary, verdicts, detection, ref_size,
                     quantized.input.dtype, max_drop_pp, dataset.labelled)  # fmt: skip
    return replace(result, matching=matching)


def _split_reference(reference: Path, x, names: list[str]) -> dict | None:
    """A float .tflite reference's outputs with each concatenated output split into its parts (what
    ``convert --split-outputs`` made of it), when that gives the model's output names; else None."""
    if reference.suffix != ".tflite":
        return None
    from edgeq.quantize.float_model import prepared_float_model
    from edgeq.runtime.interpreter import TFLiteModel

    prepared = prepared_float_model(reference.read_bytes(), str(reference), split_outputs=True)
    if not prepared.split:
        return None
    outputs = TFLiteModel(model_content=prepared.content).predict_outputs(x, batch_size=1)
    return outputs if all(n in outputs for n in names) else None


def _matched(names: list[str], got: dict, ref: dict, reference: Path) -> tuple[dict, str | None]:
    """The reference's outputs under the model's names, and how they were matched (None: by name).

    A .tflite edgeq converted names its outputs as the Keras model does; one converted by hand
    names them as its converter did (``output_0``). One output each matches trivially; several by
    shape, where each shape is one output's in both models; anything else is refused in one line."""
    if all(n in ref for n in names):
        return ref, None
    theirs = list(ref)
    if len(names) == 1 and len(theirs) == 1:
        return {names[0]: ref[theirs[0]]}, f"the one output {names[0]!r} against the reference's {theirs[0]!r}"
    shape_of = {n: tuple(np.shape(got[n])[1:]) for n in names}
    by_shape = {}
    for name, shape in shape_of.items():
        same = [t for t in theirs if tuple(np.shape(ref[t])[1:]) == shape]
        if len(same) != 1 or list(shape_of.values()).count(shape) != 1:
            raise DataError(
                f"{reference} has no output named {name!r} (its outputs: {', '.join(theirs)}), and its shape "
                f"{shape} does not name one either; give the model this .tflite was converted from"
            )
        by_shape[name] = same[0]
    pairs = ", ".join(f"{n} = {t}" for n, t in by_shape.items())
    return {n: ref[t] for n, t in by_shape.items()}, f"outputs matched by shape: {pairs}"


def _scored(specs, ref: dict, got: dict, dataset, split: str, x, max_drop_pp, model: Path):
    """Each output's row (its task's metrics on both models, the comparison) and verdict; the first
    row with a change is the primary one. Labels that score no output are refused in one line."""
    rows, primary, verdicts = [], None, []
    for spec in specs:
        row = _score_output(spec, ref[spec.name], got[spec.name], dataset, split, x, len(specs))
        rows.append(row)
        if primary is None and row["worse_by"] is not None:
            primary = row
        verdict = _verdict(spec, ref[spec.name], got[spec.name], dataset, split, x, len(specs), max_drop_pp)
        if verdict is not None:
            row["verdict"] = verdict.to_dict()
            verdicts.append(verdict)
    unscored = [spec for spec, row in zip(specs, rows) if spec.kind == "other"]
    if dataset.labelled and unscored and not any(row["metrics"] for row in rows):
        spec = unscored[0]
        raise DataError(
            f"{model}: the data has labels, but output {spec.name!r} of shape {(_count(x), *spec.shape)} is not one "
            "score per class (or a declared task), so it has no accuracy; compare it by output error (SQNR, MAE) "
            "without labels, or declare what it is with --task"
        )
    return rows, primary, verdicts


def _result(model: Path, reference: Path, data: str, x, rows, primary, verdicts, detection, ref_size, dtype,
            max_drop_pp, labelled: bool) -> EvalResult:  # fmt: skip
    """The EvalResult: the primary row's metric in its unit, every output's comparison, the verdicts."""
    first = rows[0]["comparison"]
    agreements = [r["comparison"]["agreement"] for r in rows if r["comparison"]["agreement"] is not None]
    size = model.stat().st_size
    return EvalResult(
        model=str(model),
        reference=str(reference),
        data=data,
        samples=_count(x),
        value=_metric(primary, "metrics"),
        reference_value=_metric(primary, "reference_metrics"),
        worse_by=primary["worse_by"] if primary else None,
        agreement=agreements[0] if agreements else None,
        mae=first["mae"],
        mse=first["mse"],
        max_abs_error=max(r["comparison"]["max_abs_error"] for r in rows),
        sqnr_db=min(r["comparison"]["sqnr_db"] for r in rows),
        cosine=first["cosine"],
        size_bytes=size,
        reference_size_bytes=ref_size,
        size_ratio=size / ref_size if ref_size else float("nan"),
        model_dtype=dtype,
        budget=max_drop_pp,
        # every judged output within the budget (and a detector's mAP); nothing judged was refused above
        passed=max_drop_pp is None
        or (all(v.passed for v in verdicts) and (detection is None or detection["verdict"]["passed"])),
        outputs=tuple(rows),
        labelled=labelled,
        detection=detection,
        verdicts=tuple(v.to_dict() for v in verdicts) + ((detection["verdict"],) if detection else ()),
        metric=primary["primary"] if primary else None,
        unit=metric(primary["primary"]).unit if primary else None,
        change_unit=metric(primary["primary"]).change if primary else None,
    )


def _verdict(spec: OutputSpec, ref, got, dataset, split: str, x, outputs: int, budget: float | None):
    """The output's Verdict (n, change, paired interval, pass/fail); None where it has nothing to be
    judged by and no budget asks for one. With a budget, an output whose task has a metric but whose
    data cannot score it is refused (NothingJudged): a gate never passes what it did not judge."""
    if spec.kind.startswith("detection"):
        return None  # judged together with the other head, by mAP (_detection)
    has_metric = bool(task(spec.kind).primary)
    targets = dataset.targets(split, spec.name if outputs > 1 else None)
    inputs = x if not isinstance(x, dict) else None
    try:
        return judge(spec, ref, got, targets, inputs, budget)
    except NothingJudged as exc:
        if budget is None or (not has_metric and outputs > 1):
            return None
        raise NothingJudged(f"--max-drop {budget:g}: {exc}") from None


def _detection(
    specs, ref: dict, got: dict, dataset, split: str, model: Path, budget: float | None, task_spec: str | None = None
) -> dict | None:
    """mAP@0.5 and mAP@0.5:0.95 of both models' decoded detections (pycocotools), and the verdict on
    mAP@0.5 (points worse, n images, paired bootstrap interval over images); None when the model is no
    detector or the data has no boxes."""
    from edgeq.runtime.inputs import detection_beside
    from edgeq.tasks.detection import (
        DetectionSpec,
        ResampledMap50,
        declared_detection,
        decode,
        detection_spec_of,
        mean_average_precision,
    )

    # the task file's declaration, else what the conversion recorded, else the heads' shapes
    spec = declared_detection(task_spec)
    recorded = detection_beside(model)
    if spec is None and recorded is not None:
        spec = DetectionSpec.from_dict(recorded, f"{model}'s manifest")
    spec = spec or detection_spec_of(specs)
    if spec is None:
        return None
    truth = dataset.targets(split, "gt_boxes"), dataset.targets(split, "gt_classes")
    if truth[0] is None or truth[1] is None:
        return None
    size = tuple(dataset.input_shape[:2])
    decoded = decode(spec, ref), decode(spec, got)
    theirs = mean_average_precision(decoded[0], *truth, size, spec.classes)
    ours = mean_average_precision(decoded[1], *truth, size, spec.classes)
    on_reference, on_model = (ResampledMap50(d, *truth, size, spec.classes) for d in decoded)
    images = int(len(truth[0]))
    verdict = verdict_of(
        "detection", "map50", on_reference, on_model, images, budget, values=(theirs["map50"], ours["map50"])
    )
    return {
        **spec.to_dict(),
        "images": images,
        "objects": int((np.asarray(truth[1]) >= 0).sum()),
        "map50": ours["map50"],
        "map": ours["map"],
        "reference_map50": theirs["map50"],
        "reference_map": theirs["map"],
        "detections": ours["detections"],
        "reference_detections": theirs["detections"],
        "worse_by": verdict.worse_by,
        "verdict": verdict.to_dict(),
    }


def _score_output(spec: OutputSpec, ref: np.ndarray, got: np.ndarray, dataset, split, x, outputs: int) -> dict:
    targets = dataset.targets(split, spec.name if outputs > 1 else None)
    if spec.kind in ("classification", "binary") and targets is not None:
        targets = np.asarray(targets)
        if not np.issubdtype(targets.dtype, np.integer):
            raise DataError(
                f"output {spec.name!r} is a {spec.kind} output, but its targets are float values; give class ids"
            )
        classes = int(np.prod(spec.shape)) if spec.kind == "classification" else 2
        if targets.size and (targets.min() < 0 or targets.max() >= classes):
            raise DataError(
                f"output {spec.name!r}: labels run from {int(targets.min())} to {int(targets.max())} "
                f"but it has {classes} classes"
            )
    inputs = x if not isinstance(x, dict) else None
    cmp = compare(spec, ref, got)
    metrics, reference_metrics = score(spec, got, targets, inputs), score(spec, ref, targets, inputs)
    return {
        "name": spec.name,
        "task": spec.kind,
        "primary": task(spec.kind).primary or None,
        "change_unit": task(spec.kind).metric.change if task(spec.kind).metric else None,
        "metrics": metrics,
        "reference_metrics": reference_metrics,
        "worse_by": worse_by(spec, reference_metrics, metrics),
        "comparison": {
            "agreement": cmp.agreement if math.isfinite(cmp.agreement) else None,
            "mae": cmp.mae,
            "mse": cmp.mse,
            "max_abs_error": cmp.max_abs_error,
            "sqnr_db": cmp.sqnr_db,
            "cosine": cmp.cosine,
        },
    }


def _metric(row: dict | None, key: str) -> float | None:
    if row is None:
        return None
    return row[key].get(row["primary"])


def _count(x) -> int:
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def check_gate(result: EvalResult) -> None:
    """Raise QualityGateError naming every output over the budget, with its n and interval."""
    if result.passed:
        return
    lines = [Verdict.from_dict(v).line() for v in result.verdicts if v["passed"] is False]
    raise QualityGateError(f"{result.model}: over --max-drop {result.budget:g}: " + "; ".join(lines))
