"""What a model's output means: one table of tasks that every stage asks.

Each output of a model has a kind (a row of ``TASKS``): what its targets are, the loss it
trains with, the metrics that judge it, and which of them a budget (``--max-drop``) reads.
Data loading, training, verification, ``eval``, ``profile`` on a device, ``verify``,
``analyze`` and ``report`` all score outputs through ``score`` and ``compare`` here, so a
1-unit sigmoid is never scored by the argmax of one column, and a box head is never given
an accuracy.

numpy only: the device side (``profile``) scores with it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeq.errors import DataError, UsageError
from edgeq.tasks.metrics import Metric, OutputComparison, class_scores, compare_outputs, metric


@dataclass(frozen=True)
class Task:
    """One row of the task table."""

    kind: str
    help: str
    targets: str  # what the data gives for this output
    loss: str  # Keras loss for training (edgeq train)
    metrics: tuple[str, ...]  # what ``score`` reports
    primary: str  # the metric a budget (--max-drop) reads: its row of edgeq.tasks.metrics.METRICS says its unit,
    # direction and how a change in it is written
    classes: bool  # outputs are class scores: top-1 agreement is meaningful
    keras_metric: str | None = None  # what Keras shows while edgeq train fits it

    @property
    def metric(self) -> Metric | None:
        """The primary metric's row; None for a task judged only by output error (other, detection heads)."""
        return metric(self.primary) if self.primary else None


TASKS: dict[str, Task] = {
    "classification": Task(
        "classification",
        "K-way class scores (softmax or logits)",
        "class ids (N,) or one-hot rows",
        "sparse_categorical_crossentropy",
        ("accuracy", "top5"),
        "accuracy",
        True,
        "accuracy",
    ),
    "binary": Task(
        "binary",
        "one sigmoid unit: the probability of class 1 (threshold 0.5)",
        "0/1 labels",
        "binary_crossentropy",
        ("accuracy", "auc"),
        "accuracy",
        True,
        "binary_accuracy",
    ),
    "multilabel": Task(
        "multilabel",
        "K independent sigmoid units (threshold 0.5 each)",
        "0/1 rows (N, K)",
        "binary_crossentropy",
        ("accuracy", "exact_match", "auc"),
        "accuracy",
        False,
        "binary_accuracy",
    ),
    "regression": Task(
        "regression",
        "values (a linear output; whole-numbered targets too, such as ages or counts)",
        "values of the output's shape, float or whole numbers",
        "mse",
        ("mae", "rmse", "max_error", "r2"),
        "rmse",
        False,
        "mae",
    ),
    "reconstruction": Task(
        "reconstruction",
        "an autoencoder's copy of its input: the per-sample error is the anomaly score",
        "none (the input is the target); 0 normal / 1 anomalous labels give the AUC",
        "mse",
        ("reconstruction_mse", "auc", "pauc"),
        "auc",
        False,
        "mse",
    ),
    "segmentation": Task(
        "segmentation",
        "a per-pixel mask: (H, W, 1) probabilities (threshold 0.5) or (H, W, C) class scores",
        "masks (N, H, W): 0/1, or class ids",
        "binary_crossentropy",
        ("iou", "pixel_accuracy"),
        "iou",
        False,
    ),
    "landmarks": Task(
        "landmarks",
        "points in input pixels: (K, D) or (K * D) values, D = 3 (x, y, z) where K * D divides by 3, else 2; "
        "judged by the mean (x, y) distance in pixels",
        "the points, in the output's layout",
        "mse",
        ("point_error", "max_point_error"),
        "point_error",
        False,
    ),
    "detection_boxes": Task(
        "detection_boxes",
        "a detector's box head (edgeq.tasks.detection decodes it with the score head; judged together by mAP)",
        "gt_boxes and gt_classes (the detection's ground truth)",
        "masked_l1",
        (),
        "",
        False,
    ),
    "detection_scores": Task(
        "detection_scores",
        "a detector's class-score head (per-class sigmoid; judged with the box head by mAP)",
        "gt_boxes and gt_classes (the detection's ground truth)",
        "focal",
        (),
        "",
        False,
    ),
    "other": Task(
        "other",
        "any other output: compared with the reference by SQNR, cosine and max abs error",
        "none",
        "mse",
        (),
        "",
        False,
        "mse",
    ),
}

# numpy 2 renamed trapz; devices with tflite-runtime run numpy 1.x
_trapezoid = getattr(np, "trapezoid", None) or np.trapz

# MLPerf Tiny's anomaly-detection metric: the ROC AUC up to this false-positive rate (McClish-standardized,
# as scikit-learn's roc_auc_score(max_fpr=0.1) reports it).
PAUC_MAX_FPR = 0.1


def task(kind: str) -> Task:
    try:
        return TASKS[kind]
    except KeyError:
        kinds = "; ".join(f"{k} ({row.help})" for k, row in TASKS.items())
        raise UsageError(f"unknown task {kind!r}; choose one of: {kinds}") from None


@dataclass(frozen=True)
class OutputSpec:
    """One model output: its name (the Keras output name = the .tflite signature name) and task."""

    name: str
    kind: str
    shape: tuple[int, ...] = ()  # without the batch axis
    threshold: float = 0.5  # binary/multilabel: where class 1 begins (0.0 for logits)
    source: str = "inferred"  # "inferred" | "declared" | "recorded"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "task": self.kind,
            "task_source": self.source,
            "shape": list(self.shape),
            "threshold": self.threshold,
        }


def detection_pair(names: list[str]) -> dict[str, str]:
    """``--task detection``: which of two outputs is the box head (its name says box) and which the scores."""
    boxes = [n for n in names if "box" in n.lower()]
    if len(names) != 2 or len(boxes) != 1:
        raise UsageError(
            f"--task detection takes a model with two outputs, a box head (a name with 'box') and a score head; "
            f"this one has {', '.join(names)}: name them with --task BOXES=detection_boxes,SCORES=detection_scores"
        )
    return {n: ("detection_boxes" if n == boxes[0] else "detection_scores") for n in names}


def infer_kind(
    shape: tuple[int, ...],
    activation: str | None = None,
    targets: np.ndarray | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> str:
    """The task of an output from its shape (no batch axis), final activation and the data's targets.

    softmax: classification; sigmoid: binary (1 unit) or multilabel; class-id targets (integers,
    one per sample) with K > 1 scores: classification; float targets: regression; an output
    of the input's shape with no targets: reconstruction; anything else: other.
    """
    units = int(np.prod(shape)) if len(shape) else 1
    scores_like = len([d for d in shape if d != 1]) <= 1
    by_head = _head_kind("classification" if activation == "softmax" else activation, shape)
    if by_head is not None:
        return by_head
    spatial = input_shape is not None and len(shape) == 3 and len(input_shape) == 3 and shape[:2] == input_shape[:2]
    if activation in ("sigmoid", "softmax") and spatial and tuple(shape) != tuple(input_shape):
        return "segmentation"  # a score per input pixel, not a copy of the input
    if targets is not None:
        t = np.asarray(targets)
        ids = t.ndim == 1 or (t.ndim == 2 and t.shape[1] == 1)
        if ids and np.issubdtype(t.dtype, np.integer) and scores_like:
            if units > 1:
                return "classification"
            return "binary" if np.all((t == 0) | (t == 1)) else "regression"
        if np.issubdtype(t.dtype, np.floating) or not ids:
            return "regression"
    if input_shape is not None and tuple(shape) == tuple(input_shape) and targets is None:
        return "reconstruction"
    return "other"


def task_file(spec: str | None) -> dict | None:
    """A --task JSON file's object ({"NAME": "KIND", "detection": {...}}); None where --task is no file."""
    if not spec:
        return None
    text = str(spec).strip()
    if not (text.endswith(".json") or Path(text).is_file()):
        return None
    try:
        data = json.loads(Path(text).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f'{text}: not a readable task file ({exc}); write {{"output name": "kind"}}') from exc
    if not isinstance(data, dict):
        raise UsageError(f'{text}: a task file maps output names to kinds, e.g. {{"scores": "binary"}}')
    return data


def _declared_heads(detection) -> dict[str, str]:
    """The kinds a task file's "detection" object gives its heads (a YOLO tensor is its own score head)."""
    if not isinstance(detection, dict):
        return {}
    boxes = str(detection.get("boxes", "boxes"))
    scores = detection.get("scores")
    if scores is None or str(scores) == boxes:
        return {boxes: "detection_boxes"}
    return {boxes: "detection_boxes", str(scores): "detection_scores"}


def load_task_spec(spec: str | None, output_names: list[str]) -> dict[str, str]:
    """``--task``: one kind for a one-output model, ``NAME=KIND,...``, or a JSON file ``{"NAME": "KIND"}``
    (with ``"detection": {...}``, a detector's heads, layout and decoder: edgeq.tasks.detection)."""
    if not spec:
        return {}
    text = str(spec).strip()
    data = task_file(text)
    if data is not None:
        pairs = {str(k): str(v) for k, v in data.items() if k != "detection"}
        pairs = {**_declared_heads(data.get("detection")), **pairs}
    elif text == "detection":
        pairs = detection_pair(output_names)
    elif "=" in text:
        pairs = {}
        for item in text.split(","):
            name, _, kind = item.partition("=")
            pairs[name.strip()] = kind.strip()
    else:
        if len(output_names) != 1:
            raise UsageError(
                f"--task {text}: the model has {len(output_names)} outputs ({', '.join(output_names)}); "
                "give one kind per output: --task NAME=KIND,NAME=KIND or a JSON file"
            )
        pairs = {output_names[0]: text}
    for name, kind in pairs.items():
        task(kind)
        if name not in output_names:
            raise UsageError(f"--task names output {name!r}, but the model's outputs are {', '.join(output_names)}")
    return pairs


# ------------------------------------------------------------------------- metrics


def roc_auc(labels: np.ndarray, scores: np.ndarray, max_fpr: float | None = None) -> float:
    """Area under the ROC curve of ``scores`` for 0/1 ``labels`` (ties count half).

    ``max_fpr``: the partial AUC up to that false-positive rate, McClish-standardized to
    [0.5, 1] as scikit-learn's ``roc_auc_score(max_fpr=...)`` gives it. NaN without both classes.
    """
    y = np.asarray(labels).reshape(-1).astype(bool)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    positives, negatives = int(y.sum()), int((~y).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    distinct = np.flatnonzero(np.diff(s)) if len(s) > 1 else np.zeros(0, dtype=np.int64)
    ends = np.concatenate([distinct, [len(s) - 1]])
    tps = np.cumsum(y)[ends]
    fps = ends + 1 - tps
    tpr = np.concatenate([[0.0], tps / positives])
    fpr = np.concatenate([[0.0], fps / negatives])
    if max_fpr is None or max_fpr >= 1:
        return float(_trapezoid(tpr, fpr))
    stop = np.searchsorted(fpr, max_fpr, side="right")
    x_interp = [fpr[stop - 1], fpr[stop]] if stop < len(fpr) else [fpr[-1], fpr[-1]]
    y_interp = [tpr[stop - 1], tpr[stop]] if stop < len(tpr) else [tpr[-1], tpr[-1]]
    tpr = np.append(tpr[:stop], np.interp(max_fpr, x_interp, y_interp))
    fpr = np.append(fpr[:stop], max_fpr)
    partial = float(_trapezoid(tpr, fpr))
    min_area = 0.5 * max_fpr**2
    return 0.5 * (1 + (partial - min_area) / (max_fpr - min_area))


def anomaly_scores(outputs: np.ndarray, inputs: np.ndarray) -> np.ndarray:
    """Per-sample mean squared reconstruction error: an autoencoder's anomaly score."""
    out = np.asarray(outputs, dtype=np.float64).reshape(len(outputs), -1)
    x = np.asarray(inputs, dtype=np.float64).reshape(len(inputs), -1)
    if out.shape != x.shape:
        raise DataError(f"a reconstruction output of {out.shape[1]} values per sample for inputs of {x.shape[1]}")
    return np.mean((out - x) ** 2, axis=1)


def _probabilities_to_classes(scores: np.ndarray, threshold: float) -> np.ndarray:
    return (scores >= threshold).astype(np.int64)


def predicted(spec: OutputSpec, outputs: np.ndarray) -> np.ndarray:
    """What a classifier output says for each sample: class ids (N,), or 0/1 rows for multilabel."""
    if spec.kind == "classification":
        scores = class_scores(outputs)
        if scores is None:
            raise DataError(f"output {spec.name!r} of shape {tuple(np.shape(outputs))[1:]} is not one score per class")
        return np.argmax(scores, axis=1)
    if spec.kind == "binary":
        return _probabilities_to_classes(np.asarray(outputs).reshape(len(outputs)), spec.threshold)
    if spec.kind == "multilabel":
        return _probabilities_to_classes(np.asarray(outputs).reshape(len(outputs), -1), spec.threshold)
    raise DataError(f"output {spec.name!r} ({spec.kind}) gives no classes")


def score(spec: OutputSpec, outputs: np.ndarray, targets: np.ndarray | None, inputs: np.ndarray | None = None) -> dict:
    """The task's metrics of ``outputs`` against ``targets`` (None: nothing to score against).

    Reconstruction needs ``inputs`` (its target) and scores AUC from 0/1 ``targets`` when given.
    """
    out = np.asarray(outputs)
    kind = spec.kind
    if kind == "reconstruction":
        if inputs is None:
            return {}
        errors = anomaly_scores(out, inputs)
        result: dict[str, Any] = {"reconstruction_mse": float(np.mean(errors))}
        if targets is not None:
            labels = np.asarray(targets).reshape(-1)
            result["auc"] = roc_auc(labels, errors)
            result["pauc"] = roc_auc(labels, errors, PAUC_MAX_FPR)
        return result
    if targets is None or kind == "other":
        return {}
    if kind in ("segmentation", "landmarks"):
        return (_mask_scores if kind == "segmentation" else _point_scores)(spec, out, np.asarray(targets))
    t = np.asarray(targets)
    if len(t) != len(out):
        raise DataError(f"output {spec.name!r}: {len(t)} targets for {len(out)} samples")
    if kind == "classification":
        scores = class_scores(out)
        if scores is None:
            raise DataError(f"output {spec.name!r} of shape {tuple(out.shape)[1:]} is not one score per class")
        ids = t.reshape(len(t))
        result = {"accuracy": float(np.mean(np.argmax(scores, axis=1) == ids))}
        if scores.shape[1] > 5:
            top5 = np.argsort(-scores, axis=1)[:, :5]
            result["top5"] = float(np.mean(np.any(top5 == ids[:, None], axis=1)))
        return result
    if kind == "binary":
        labels = t.reshape(len(t))
        probs = out.reshape(len(out))
        return {
            "accuracy": float(np.mean(_probabilities_to_classes(probs, spec.threshold) == labels)),
            "auc": roc_auc(labels, probs),
        }
    if kind == "multilabel":
        labels = t.reshape(len(t), -1)
        probs = out.reshape(len(out), -1)
        hits = _probabilities_to_classes(probs, spec.threshold) == labels
        aucs = [roc_auc(labels[:, k], probs[:, k]) for k in range(labels.shape[1])]
        finite = [a for a in aucs if math.isfinite(a)]
        return {
            "accuracy": float(np.mean(hits)),
            "exact_match": float(np.mean(np.all(hits, axis=1))),
            "auc": float(np.mean(finite)) if finite else float("nan"),
        }
    # regression
    y = t.reshape(len(t), -1).astype(np.float64)
    p = out.reshape(len(out), -1).astype(np.float64)
    if y.shape != p.shape:
        raise DataError(f"output {spec.name!r}: targets of {y.shape[1]} values per sample for {p.shape[1]} outputs")
    err = p - y
    total = float(np.sum((y - y.mean(axis=0)) ** 2))
    return {
        "mae": float(np.mean(np.abs(err))),
        "rmse": float(np.sqrt(np.mean(err**2))),
        "max_error": float(np.max(np.abs(err))) if err.size else 0.0,
        "r2": 1.0 - float(np.sum(err**2)) / total if total > 0 else float("nan"),
    }


def _mask(spec: OutputSpec, values: np.ndarray) -> np.ndarray:
    """An (N, H, W) mask: a 1-channel output thresholded, class scores by argmax, labels as they are."""
    v = np.asarray(values)
    if v.ndim == 4 and v.shape[-1] > 1:
        return np.argmax(v, axis=-1)
    v = v.reshape(v.shape[:3]) if v.ndim == 4 else v
    return (v >= spec.threshold).astype(np.int64) if np.issubdtype(v.dtype, np.floating) else v.astype(np.int64)


def _mask_scores(spec: OutputSpec, out: np.ndarray, targets: np.ndarray) -> dict:
    """Mean IoU over the classes present (a 1-channel mask: of the foreground) and pixel accuracy."""
    got = _mask(spec, out)
    want = _mask(spec, targets.astype(np.float32) if targets.ndim == 4 and targets.shape[-1] == 1 else targets)
    if got.shape != want.shape:
        raise DataError(f"output {spec.name!r}: masks of {want.shape[1:]} for its {got.shape[1:]} pixels")
    if out.ndim == 4 and out.shape[-1] > 1:  # class scores: the mean over the classes either mask holds
        classes = np.union1d(np.unique(got), np.unique(want))
    else:  # one probability per pixel: the foreground's IoU
        classes = np.asarray([1])
    ious = []
    for c in classes:
        union = np.logical_or(got == c, want == c).sum()
        ious.append(np.logical_and(got == c, want == c).sum() / union if union else 1.0)
    return {"iou": float(np.mean(ious)), "pixel_accuracy": float(np.mean(got == want))}


def _points(values: np.ndarray) -> np.ndarray:
    """(N, K, D) points of a (N, K, D) or flat (N, K * D) output (D = 3 where it divides, else 2)."""
    v = np.asarray(values, np.float64)
    if v.ndim == 3:
        return v
    flat = v.reshape(len(v), -1)
    dims = 3 if flat.shape[1] % 3 == 0 else 2
    return flat.reshape(len(v), -1, dims)


def _point_scores(spec: OutputSpec, out: np.ndarray, targets: np.ndarray) -> dict:
    got, want = _points(out), _points(targets)
    if got.shape != want.shape:
        raise DataError(f"output {spec.name!r}: targets of {want.shape[1:]} points for its {got.shape[1:]}")
    distance = np.linalg.norm(got[..., :2] - want[..., :2], axis=-1)
    return {"point_error": float(np.mean(distance)), "max_point_error": float(np.max(distance))}


# Outputs a float .tflite's conversion judges against the float file's own answers where the data has no
# labels, and the budget it gives them (worse by, in the metric's change unit); landmarks: 1% of the input
# width, in pixels (edgeq.convert.verify).
AGAINST_FLOAT = {"binary": 1.0, "segmentation": 5.0, "landmarks": 0.01}


def worse_by(spec: OutputSpec, reference: dict, quantized: dict) -> float | None:
    """How much worse the primary metric got, in its change unit (points of accuracy or AUC, percent
    of an error such as RMSE); None when the task has no primary metric or it was not measured."""
    row = task(spec.kind).metric
    if row is None or row.name not in reference or row.name not in quantized:
        return None
    return row.worse_by(reference[row.name], quantized[row.name])


def compare(spec: OutputSpec, reference: np.ndarray, quantized: np.ndarray) -> OutputComparison:
    """Quantized vs reference outputs; agreement only where the outputs are classes."""
    cmp = compare_outputs(reference, quantized)
    if spec.kind in ("binary", "multilabel"):
        agree = float(np.mean(np.all(
            np.reshape(predicted(spec, reference), (len(reference), -1))
            == np.reshape(predicted(spec, quantized), (len(quantized), -1)), axis=1
        )))  # fmt: skip
        return _with_agreement(cmp, agree)
    if spec.kind == "classification":
        return _with_agreement(cmp, float(np.mean(predicted(spec, reference) == predicted(spec, quantized))))
    return _with_agreement(cmp, float("nan"))


def _with_agreement(cmp: OutputComparison, agreement: float) -> OutputComparison:
    from dataclasses import replace

    return replace(cmp, agreement=agreement)


def _head_kind(head: str | None, shape: tuple[int, ...]) -> str | None:
    """The task a class head makes of an output of ``shape``: "classification" (softmax, or a cross-entropy
    on logits) of K > 1 scores, "sigmoid" of one unit (binary) or K (multilabel); None otherwise."""
    units = int(np.prod(shape)) if len(shape) else 1
    if len([d for d in shape if d != 1]) > 1:
        return None  # a score map is no class-score vector
    if head == "classification" and units > 1:
        return "classification"
    if head == "sigmoid":
        return "binary" if units == 1 else "multilabel"
    return None


def _compiled_kind(family: str, shape: tuple[int, ...], input_shape) -> str | None:
    """The task a compile config's loss family gives an output of ``shape`` (None: let the rest decide)."""
    if family == "regression":  # trained to give back its input: an autoencoder
        return "reconstruction" if input_shape is not None and tuple(shape) == tuple(input_shape) else "regression"
    return _head_kind(family, shape)


def specs_for(
    names: list[str],
    shapes: Mapping[str, tuple[int, ...]],
    declared: Mapping[str, str] | None = None,
    recorded: Mapping[str, dict] | None = None,
    activations: Mapping[str, str | None] | None = None,
    targets: Mapping[str, np.ndarray | None] | None = None,
    input_shape: tuple[int, ...] | None = None,
    compiled: Mapping[str, tuple[str, bool]] | None = None,
) -> list[OutputSpec]:
    """Each output's OutputSpec: declared (--task) wins, then what a run or manifest recorded as declared,
    then the model file's compile config (its loss: a from_logits cross-entropy is a logits classifier),
    then an inference recorded, then what the output's activation, shape and the data's targets say."""
    specs = []
    for name in names:
        shape = tuple(int(d) for d in shapes.get(name, ()))
        rec = (recorded or {}).get(name) or {}
        family, logits = (compiled or {}).get(name) or (None, False)
        from_compile = _compiled_kind(family, shape, input_shape) if family else None
        if declared and name in declared:
            kind, source = declared[name], "declared"
        elif rec.get("task") and rec.get("task_source") in ("declared", "compiled"):
            kind, source = str(rec["task"]), "recorded"  # what the user or the file said when it was trained
        elif from_compile is not None:
            kind, source = from_compile, "compiled"
        elif rec.get("task") and not (rec.get("task_source") == "inferred" and (targets or {}).get(name) is not None):
            kind, source = str(rec["task"]), "recorded"  # an inference without targets yields to one with them
        else:
            activation = (activations or {}).get(name)
            kind = infer_kind(shape, activation, (targets or {}).get(name), input_shape)
            source = "inferred"
        task(kind)
        threshold = float(rec.get("threshold", 0.5))
        activation = (activations or {}).get(name)
        if kind in ("binary", "multilabel") and (logits or activation not in (None, "sigmoid")):
            threshold = 0.0  # logits: class 1 from 0
        specs.append(OutputSpec(name, kind, shape, threshold, source))
    return specs
