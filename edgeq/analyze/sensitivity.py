"""Per-layer quantization sensitivity, two ways, from one calibration.

fast:  one pass of TFLite's QuantizationDebugger: each quantized op against its float
       twin on the same inputs (MSE, RMSE/scale, max abs error, and the median (ranked by),
       mean and worst SQNR of the op's output channels, which catches a layer whose small channels are crushed by
       one large one even when the whole-tensor error looks small).
exact: for each layer, the model quantized everywhere but there, and quantized only
       there; accuracy and output MSE against FP32 on real data.

The calibrated model is made once; every variant is a re-quantization of it
(``edgeq.quantize.calibration``), as the debugger itself does.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import asdict, dataclass

import numpy as np

from edgeq.errors import UsageError
from edgeq.models.spec import ModelSpec
from edgeq.quantize.calibration import Calibrated, calibrate, predict
from edgeq.shims.tflite import native_output_silenced
from edgeq.tasks.table import OutputSpec, predicted, score, task, worse_by

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastSensitivity:
    layer: str
    node: str
    mean_squared_error: float
    rmse_over_scale: float
    max_abs_error: float
    channel_sqnr_db: float  # median over the op's output channels: the ranking
    mean_channel_sqnr_db: float
    worst_channel_sqnr_db: float


@dataclass(frozen=True)
class ExactSensitivity:
    layer: str
    nodes: int
    value_all_but_this: float  # everything quantized except this layer
    value_only_this: float  # only this layer quantized
    mse_only_this: float  # output MSE vs FP32 with only this layer quantized
    gain: float  # accuracy regained by keeping this layer float (vs full INT8), in points
    loss: float  # accuracy lost by quantizing only this layer (vs FP32), in points
    seconds: float


@dataclass(frozen=True)
class SensitivityReport:
    model: str
    data: str
    samples: int
    fp32_value: float
    int8_value: float
    fast: tuple[FastSensitivity, ...]
    exact: tuple[ExactSensitivity, ...]
    seconds_fast: float
    seconds_exact: float
    ranges: str = "minmax"  # activation range method (edgeq.quantize.ranges); minmax is the converter's own
    metric: str = "accuracy"  # what fp32/int8_value and the exact ranking measure: the output's task metric

    def to_dict(self) -> dict:
        d = {"kind": "edgeq.analyze.sensitivity", **asdict(self)}
        return _finite(d)


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _node_for_debug_tensor(name: str, nodes: list[str]) -> str | None:
    """'NumericVerify/<node><uniquifying digits>:<index>' -> <node>."""
    base = re.sub(r":\d+$", "", name[len("NumericVerify/") :] if name.startswith("NumericVerify/") else name)
    candidates = [n for n in nodes if base.startswith(n) and base[len(n) :].isdigit() and len(base) - len(n) <= 2]
    if base in nodes:
        return base
    return max(candidates, key=len) if candidates else None


def fast_sensitivity(cal: Calibrated) -> list[FastSensitivity]:
    with native_output_silenced():  # the interpreter's XNNPACK notice, numpy's cast warnings
        cal.debugger.run()
    stats = cal.debugger.layer_statistics
    by_layer: dict[str, FastSensitivity] = {}
    for key, metrics in stats.items():
        node = _node_for_debug_tensor(key, cal.nodes)
        if node is None:
            continue
        layer = cal.layer_of[node]
        entry = FastSensitivity(
            layer,
            node,
            float(metrics["mean_squared_error"]),
            float(metrics["rmse_over_scale"]),
            float(metrics["max_abs_error"]),
            float(metrics["channel_sqnr_db"]),
            float(metrics["mean_channel_sqnr_db"]),
            float(metrics["worst_channel_sqnr_db"]),
        )
        # A layer with several quantized ops is as sensitive as its worst op.
        if layer not in by_layer or entry.channel_sqnr_db < by_layer[layer].channel_sqnr_db:
            by_layer[layer] = entry
    return sorted(by_layer.values(), key=lambda s: s.channel_sqnr_db)


@dataclass(frozen=True)
class Quality:
    """What analyze measures a model by: its output's task's primary metric on labelled data.

    A classifier's accuracy; a regressor's RMSE; an autoencoder's anomaly AUC. ``points(ref, q)``
    is how much worse ``q`` is, in the task's unit (points, or percent of an error).
    """

    metric: str
    spec: OutputSpec
    targets: np.ndarray | None
    inputs: np.ndarray | None
    label_free: bool = False  # no labels: the targets are the FP32 model's own answers (agreement)

    def value(self, outputs: np.ndarray) -> float:
        return float(score(self.spec, outputs, self.targets, self.inputs)[self.metric])

    def points(self, reference: float, quantized: float) -> float:
        got = worse_by(self.spec, {self.metric: reference}, {self.metric: quantized})
        return float("nan") if got is None else got


def quality_of(model, described: ModelSpec, dataset, split: str, declared: str | None = None) -> Quality:
    """The Quality of the model's one output on ``split``; refused where its task has nothing to score."""
    from edgeq.models.load import task_targets

    spec = described.tasks(declared, task_targets(dataset, described.output_names))[0]
    metric = task(spec.kind).primary
    x, _ = dataset.split(split)
    targets = dataset.targets(split)
    label_free = targets is None and spec.kind in LABEL_FREE_KINDS
    if label_free:  # unlabelled data: how often the quantized model answers as FP32 does
        targets = fp32_answers(spec, model.predict(x, batch_size=64, verbose=0))
    if not metric or (targets is None and spec.kind != "reconstruction"):
        raise UsageError(
            f"{described.name}: its output {spec.name!r} is {spec.kind}: analyze ranks layers by a task metric on "
            "labelled data (class ids, 0/1 labels or float targets in 'y'), or for a classifier on any samples by "
            "agreement with FP32; declare the task with --task if it is inferred wrong"
        )
    return Quality(metric, spec, targets, x, label_free)


# Tasks whose primary metric is a fraction of answers, so FP32's own answers can be the labels
# (FP32 then scores 100%, and a drop is the share of answers int8 changes). An error metric
# (RMSE) against FP32's values would be 0 for FP32, and a relative budget on it meaningless.
LABEL_FREE_KINDS = ("classification", "binary", "multilabel")


def fp32_answers(spec: OutputSpec, outputs: np.ndarray) -> np.ndarray:
    """The class ids (or 0/1 labels) the FP32 model gives: the labels of unlabelled data."""
    return predicted(spec, outputs)


def exact_sensitivity(cal: Calibrated, x: np.ndarray, quality: Quality, progress=None) -> tuple[float, float, list]:
    reference = predict(cal.float_model, x)
    fp32_acc = quality.value(reference)
    int8_acc = quality.value(predict(cal.quantize(), x))
    results = []
    for layer in cal.layers:
        start = time.perf_counter()
        own = cal.nodes_of_layers([layer])
        others = [n for n in cal.nodes if n not in own]
        all_but = quality.value(predict(cal.quantize(own), x))
        only_out = predict(cal.quantize(others), x)
        only = quality.value(only_out)
        results.append(
            ExactSensitivity(
                layer,
                len(own),
                all_but,
                only,
                float(np.mean((only_out - reference) ** 2)),
                round(quality.points(all_but, int8_acc), 4),
                round(quality.points(fp32_acc, only), 4),
                round(time.perf_counter() - start, 3),
            )
        )
        if progress is not None:
            progress(layer)
    return fp32_acc, int8_acc, results


def load_fp32_with_data(model_path, data: str, verb: str):
    """The FP32 model (as tf_keras), a dataset that fits its input, and its ModelSpec; a QAT model is refused."""
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import as_tf_keras, describe, load_user_model

    model = load_user_model(model_path)
    described = describe(model, model_path)
    if described.is_qat:
        raise UsageError(f"{model_path} is a QAT model; {verb} the FP32 model it was trained from")
    if not described.single_io:
        raise UsageError(
            f"{model_path} has {len(described.inputs)} input(s) and {len(described.outputs)} output(s): analyze ranks "
            "the layers of one-input one-output models; convert and eval judge each output of this one"
        )
    input_shape = described.input_shape
    # raw files in the units the model was trained in (run.json), as convert and eval read them
    # labels are optional: without them, a classifier is measured by agreement with FP32
    dataset = load_dataset(data, input_shape=input_shape, labels_required=False, normalization=described.normalization)
    dataset.check_fits(input_shape, where=f"model {model_path}")
    return as_tf_keras(model), dataset, described


def analyze_sensitivity(
    model_path,
    data: str,
    method: str = "both",
    samples: int = 200,
    split: str = "test",
    per_tensor: bool = False,
    progress=None,
    ranges: str = "minmax",
    task_spec: str | None = None,
) -> SensitivityReport:
    model, dataset, described = load_fp32_with_data(model_path, data, "analyze")
    start = time.perf_counter()
    cal = calibrate(model, dataset, samples, per_tensor, ranges)
    if not cal.nodes:
        raise UsageError(f"{model_path}: the converter quantized no layer: nothing to analyze")
    fast = fast_sensitivity(cal) if method in ("fast", "both") else []
    seconds_fast = time.perf_counter() - start
    x, _ = dataset.split(split)
    exact: list = []
    fp32_acc = int8_acc = float("nan")
    t1 = time.perf_counter()
    quality = quality_of(model, described, dataset, split, task_spec)
    if method in ("exact", "both"):
        fp32_acc, int8_acc, exact = exact_sensitivity(cal, x, quality, progress)
        # Output error with only this layer quantized: continuous, and it attributes a crushed
        # activation to the layer that produces it (accuracy ties between producer and consumer).
        exact.sort(key=lambda r: -r.mse_only_this)
    else:
        fp32_acc = quality.value(predict(cal.float_model, x))
        int8_acc = quality.value(predict(cal.quantize(), x))
    return SensitivityReport(
        str(model_path),
        f"{data} ({split})",
        len(x),
        fp32_acc,
        int8_acc,
        tuple(fast),
        tuple(exact),
        round(seconds_fast, 3),
        round(time.perf_counter() - t1, 3),
        ranges,
        quality.metric,
    )


def save_bar_chart(report: SensitivityReport, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeq.artifacts import atomic_path

    rows = report.exact or report.fast
    labels = [r.layer for r in rows]
    if report.exact:
        values, xlabel = [r.gain for r in rows], "accuracy regained by keeping the layer float (pp)"
    else:
        values, xlabel = [-r.channel_sqnr_db for r in rows], "-(median channel SQNR, dB): higher is more sensitive"
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
    ax.barh(labels[::-1], values[::-1], color="#c0504d")
    ax.set_xlabel(xlabel)
    ax.set_title(f"Quantization sensitivity: {report.model}")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
