"""How far a quantized model's outputs are from the reference's: agreement, MAE, MSE, SQNR, cosine;
and what each task metric is to a person (``METRICS``: name, unit, direction, how a change is written).

numpy only: ``evaluate`` (host), ``convert``'s verification and ``profile --compare``
(device side) all measure with these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgeq.errors import DataError
from edgeq.quantize.numerics import sqnr_db


@dataclass(frozen=True)
class OutputComparison:
    samples: int
    agreement: float  # top-1 agreement
    mae: float
    mse: float
    max_abs_error: float
    sqnr_db: float  # 10 log10(sum ref^2 / sum (ref - q)^2); inf when identical
    cosine: float  # mean cosine similarity per sample


def class_scores(outputs: np.ndarray) -> np.ndarray | None:
    """A classifier's output as (N, K) scores, its size-1 axes dropped; None when it is not one.

    (N, K), (N, 1, 1, K) and (N, 1) are classifier outputs; (N, H, W, C) or (N, T, K) are not.
    """
    out = np.asarray(outputs)
    if out.ndim < 1 or len(out) == 0:
        return None
    axes = [d for d in out.shape[1:] if d != 1]
    if len(axes) > 1:
        return None
    return out.reshape(len(out), axes[0] if axes else 1)


def predicted_classes(outputs: np.ndarray, where: str = "the model") -> np.ndarray:
    """The class each sample is given: argmax of K > 1 scores; a 1-unit output is a sigmoid
    probability, thresholded at 0.5 (class 1 at or above it).

    An output that is no class-score vector is refused: its accuracy would mean nothing.
    """
    scores = class_scores(outputs)
    if scores is None:
        raise DataError(
            f"{where}: its output of shape {tuple(np.shape(outputs))} is not one score per class, so it has no "
            "accuracy; compare it by output error (SQNR, MAE) instead, or give a classifier"
        )
    if scores.shape[1] == 1:
        return (scores[:, 0] >= 0.5).astype(np.int64)
    return np.argmax(scores, axis=1)


def accuracy(outputs: np.ndarray, labels: np.ndarray, where: str = "the model") -> float:
    """Share of samples whose predicted class (``predicted_classes``) is their label."""
    predicted = predicted_classes(outputs, where)
    y = np.asarray(labels).reshape(-1)
    if len(y) != len(predicted):
        raise DataError(f"{where}: {len(y)} labels for {len(predicted)} outputs")
    return float(np.mean(predicted == y)) if len(y) else float("nan")


def compare_outputs(reference: np.ndarray, quantized: np.ndarray) -> OutputComparison:
    ref = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    q = np.asarray(quantized, dtype=np.float64).reshape(len(quantized), -1)
    if ref.shape != q.shape:
        raise ValueError(f"output shapes differ: {ref.shape} vs {q.shape}")
    if len(ref) == 0:
        raise ValueError("no samples to compare")
    err = ref - q
    sqnr = sqnr_db(ref, q)  # the one definition convert, eval, profile and analyze weights report
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(q, axis=1)
    # both all zero: the same output (1); one all zero: nothing in common (0), never a perfect 1
    both_zero = (np.linalg.norm(ref, axis=1) == 0) & (np.linalg.norm(q, axis=1) == 0)
    cos = np.where(norms > 0, np.sum(ref * q, axis=1) / np.where(norms > 0, norms, 1), np.where(both_zero, 1.0, 0.0))
    return OutputComparison(
        samples=len(ref),
        agreement=top1_agreement(reference, quantized),
        mae=float(np.mean(np.abs(err))),
        mse=float(np.mean(err**2)),
        max_abs_error=float(np.max(np.abs(err))),
        sqnr_db=float(sqnr),
        cosine=float(np.mean(cos)),
    )


def top1_agreement(reference: np.ndarray, quantized: np.ndarray) -> float:
    """Top-1 agreement: the same predicted class (a 1-unit output: the same side of 0.5).

    An output that is no class-score vector is compared by the argmax of its flattened values.
    """
    if class_scores(reference) is not None:
        return float(np.mean(predicted_classes(reference) == predicted_classes(quantized)))
    flat = (len(reference), -1)
    return float(np.mean(np.reshape(reference, flat).argmax(1) == np.reshape(quantized, flat).argmax(1)))


# ------------------------------------------------------------------------- what a metric is


@dataclass(frozen=True)
class Metric:
    """One metric as a person reads it: its name, unit, direction and how a change in it is written.

    ``share``: a fraction of samples (accuracy), shown in % and changed in percentage points.
    ``change``: the unit of a change (of ``worse_by``): "pp" (points of a share), "%" (relative to
    the reference: an error such as RMSE), "points" (x100 of a 0..1 score: AUC, mAP), "" (absolute).
    """

    name: str
    label: str
    share: bool
    higher_is_better: bool
    change: str

    @property
    def unit(self) -> str:
        """The unit of a value: "%" for a share, "" for a score or an error in the target's own units."""
        return "%" if self.share else ""

    def show(self, value: float | None) -> str:
        if value is None or not math.isfinite(value):
            return "-" if value is None else str(value)
        return f"{value:.2%}" if self.share else f"{value:.4g}"

    def worse_by(self, reference: float, value: float) -> float | None:
        """How much worse ``value`` is than ``reference`` in ``change`` units (negative: better);
        None when either is undefined."""
        if not (math.isfinite(reference) and math.isfinite(value)):
            return None
        worse = reference - value if self.higher_is_better else value - reference
        if self.change in ("pp", "points"):
            return round(worse * 100.0, 4)
        if self.change == "%":
            return round(worse / abs(reference) * 100.0, 4) if reference else (0.0 if worse == 0 else math.inf)
        return round(worse, 6)

    def show_change(self, worse: float | None) -> str:
        """A change as words: "0.83 pp worse", "12.10 % RMSE worse", "2.00 points better"."""
        if worse is None or not math.isfinite(worse):
            return "-" if worse is None else str(worse)
        side = "worse" if worse > 0 else "better" if worse < 0 else "no change"
        return f"{abs(worse):.2f} {self.change_label} {side}" if worse else f"0 {self.change_label} (no change)"

    @property
    def change_label(self) -> str:
        return {"pp": "pp", "points": "points", "%": f"% {self.label}"}.get(self.change, self.label)


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("accuracy", "accuracy", True, True, "pp"),
        Metric("top5", "top-5 accuracy", True, True, "pp"),
        Metric("exact_match", "exact match", True, True, "pp"),
        Metric("agreement", "top-1 agreement with FP32", True, True, "pp"),
        Metric("auc", "AUC", False, True, "points"),
        Metric("pauc", "pAUC", False, True, "points"),
        Metric("map50", "mAP@0.5", False, True, "points"),
        Metric("map", "mAP@0.5:0.95", False, True, "points"),
        Metric("mae", "MAE", False, False, "%"),
        Metric("rmse", "RMSE", False, False, "%"),
        Metric("max_error", "max error", False, False, "%"),
        Metric("reconstruction_mse", "reconstruction MSE", False, False, "%"),
        Metric("r2", "R\u00b2", False, True, ""),
        Metric("iou", "mask IoU", False, True, "points"),
        Metric("pixel_accuracy", "pixel accuracy", True, True, "pp"),
        Metric("point_error", "mean point error (px)", False, False, ""),
        Metric("max_point_error", "max point error (px)", False, False, ""),
    )
}


def metric(name: str) -> Metric:
    """The Metric row of ``name`` (an unknown name reads as an error in the target's units, lower better)."""
    return METRICS.get(name) or Metric(name, name, False, False, "%")
