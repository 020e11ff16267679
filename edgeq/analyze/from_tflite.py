"""`analyze sensitivity` and `analyze plan` of a float .tflite from any framework, op by op.

A .tflite has ops, not Keras layers: the plan names each op by its first output tensor (as
``convert X.tflite --plan`` reads it back). The file is made ready for LiteRT Quantizer and
calibrated once with edgeq's observers (as ``convert`` does), then the same search as a Keras
model's ``--fallback int16`` plan: every op int8 first; where that misses the budget, the ops
ranked by what 16 bits on each alone buys back, and the fewest that meet it. Keeping ops float
needs the Keras model (``--fallback float`` is refused in one line). Sensitivity ranks the ops the
same way: what 16 bits on this op alone buys back (gain), what int8 on this op alone costs (loss).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from edgeq.analyze.plan import (
    EXACT_LAYERS,
    PlanResult,
    _greedy,
    _metric_fields,
    _plan_record,
    _prefix_search,
    _wide_ranking,
    measuring,
)
from edgeq.analyze.sensitivity import ExactSensitivity, SensitivityReport, quality_of
from edgeq.artifacts import write_json_atomic
from edgeq.errors import UsageError
from edgeq.quantize.calibration import predict
from edgeq.tasks.verdicts import judge


class _FloatAnswers:
    """The float file as ``quality_of`` asks a model for its answers (unlabelled data)."""

    def __init__(self, model) -> None:
        self.model = model

    def predict(self, x, batch_size: int = 64, verbose: int = 0):
        return self.model.predict(x, batch_size=1)


def _op_sizes(content: bytes) -> dict[str, int]:
    """Each op (by its plan name) and how many values its output holds: what 16 bits widen."""
    from edgeq.runtime.flatbuffer import verify_tflite

    desc = verify_tflite(content, "the float model")
    sizes = {}
    for op in desc.main.operators:
        named = [desc.main.tensors[i] for i in op.outputs if i >= 0 and desc.main.tensors[i].name]
        if named:
            sizes.setdefault(named[0].name.split(";")[0], int(np.prod([max(1, d) for d in named[0].shape])))
    return sizes


def _checked(path: Path, int4: bool, per_tensor: bool, fallback: str) -> None:
    if fallback != "int16":
        raise UsageError(
            f"{path}: a .tflite's plan moves ops to 16-bit activations (LiteRT Quantizer's per-op recipes): give "
            "--fallback int16; keeping ops float needs the Keras model"
        )
    if int4 or per_tensor:
        raise UsageError(f"{path}: --int4 and --granularity per-tensor plan Keras layers; give --fallback int16 alone")


def _loaded(path: Path, data: str, split: str, samples: int, ranges: str, task_spec: str | None):
    """The file made ready for LiteRT Quantizer, its ModelSpec, the data, the split's samples, the
    quality that scores them, and the file calibrated once (as convert calibrates it)."""
    from edgeq.data.sources import load_dataset
    from edgeq.models.spec import describe_tflite
    from edgeq.quantize.float_model import prepared_float_model
    from edgeq.quantize.mixed import calibrate_float, op_names
    from edgeq.runtime.interpreter import TFLiteModel

    prepared = prepared_float_model(path.read_bytes(), str(path))
    float_model = TFLiteModel(model_content=prepared.content)
    described = describe_tflite(float_model, path)
    if not described.single_io:
        raise UsageError(
            f"{path} has {len(described.inputs)} input(s) and {len(described.outputs)} output(s): analyze ranks the "
            "ops of one-input one-output models; convert and eval judge each output of this one"
        )
    dataset = load_dataset(data, described.input_shape, labels_required=False)
    dataset.check_fits(described.input_shape, where=f"model {path}")
    x, _ = dataset.split(split)
    if len(x) == 0:
        raise UsageError(f"data {data!r} has no {split} samples to measure on; use another --split")
    quality = quality_of(_FloatAnswers(float_model), described, dataset, split, task_spec)
    cal = calibrate_float(prepared.content, dataset.calibration_samples(samples), op_names(prepared.content), ranges)
    return prepared, described, dataset, x, quality, cal


def analyze_tflite_sensitivity(
    model_path, data: str, method: str = "both", samples: int = 200, split: str = "test", per_tensor: bool = False,
    progress=None, ranges: str = "minmax", task_spec: str | None = None,
) -> SensitivityReport:  # fmt: skip
    """Each op of a float .tflite: its task metric with every other op int8 and it at 16 bits (gain), and
    with only it int8 and the rest at 16 bits (loss, output MSE), most output error first."""
    path = Path(model_path)
    if per_tensor:
        raise UsageError(f"{path}: --granularity per-tensor analyzes Keras layers; a .tflite's ops are per-channel")
    start = time.perf_counter()
    prepared, described, dataset, x, quality, cal = _loaded(path, data, split, samples, ranges, task_spec)
    reference = predict(cal.float_model, x)
    fp32, every = quality.value(reference), list(cal.layers)
    int8 = quality.value(predict(cal.quantize(), x))
    rows = []
    for op in every if method in ("exact", "both") else ():
        t = time.perf_counter()
        widened = quality.value(predict(cal.quantize([op]), x))
        alone = predict(cal.quantize([o for o in every if o != op]), x)
        rows.append(
            ExactSensitivity(
                op,
                1,
                widened,
                quality.value(alone),
                float(np.mean((alone - reference) ** 2)),
                round(quality.points(widened, int8), 4),
                round(quality.points(fp32, quality.value(alone)), 4),
                round(time.perf_counter() - t, 3),
            )  # fmt: skip
        )
        if progress is not None:
            progress(op)
    rows.sort(key=lambda r: -r.mse_only_this)
    return SensitivityReport(str(path), f"{data} ({split})", len(x), fp32, int8, (), tuple(rows), 0.0,
                             round(time.perf_counter() - start, 3), ranges, quality.metric)  # fmt: skip


def make_tflite_plan(
    model_path, data: str, max_drop_pp: float, out: str | Path, samples: int = 200, split: str = "val",
    per_tensor: bool = False, progress=None, int4: bool = False, ranges: str = "minmax",
    task_spec: str | None = None, fallback: str = "int16",
) -> PlanResult:  # fmt: skip
    """``make_plan`` for a float .tflite: the fewest ops at 16-bit activations that meet ``max_drop_pp``."""
    start, path = time.perf_counter(), Path(model_path)
    _checked(path, int4, per_tensor, fallback)
    prepared, described, dataset, x, quality, cal = _loaded(path, data, split, samples, ranges, task_spec)
    reference, measure, seen = measuring(cal, x, quality, "int16")
    fp32_acc = quality.value(reference)
    frontier = [measure([])]
    int8_acc, ranking = frontier[0].value, []
    if frontier[0].worse_by > max_drop_pp:
        sizes = _op_sizes(prepared.content)
        ranking = _wide_ranking(None, cal, x, quality, int8_acc, reference, progress, lambda op: sizes.get(op, 1))
        search = _greedy if len(cal.layers) <= EXACT_LAYERS else _prefix_search
        search(ranking, measure, max_drop_pp, frontier)
    meeting = sorted((p for p in frontier if p.worse_by <= max_drop_pp), key=lambda p: (len(p.changed), p.worse_by))
    best = meeting[0] if meeting else min(frontier, key=lambda p: (p.worse_by, len(p.changed)))
    verdict = judge(
        quality.spec, reference, seen[best.changed], quality.targets, quality.inputs, max_drop_pp, quality.metric
    ).to_dict()
    where = f"{data} ({split})"
    record = _plan_record(path, where, max_drop_pp, fallback, quality, (fp32_acc, int8_acc), best, bool(meeting),
                          False, ranges, ranking, frontier)  # fmt: skip
    record.update(verdict=verdict, samples=len(x), **_metric_fields(quality.metric))
    write_json_atomic(Path(out), record)
    seconds = round(time.perf_counter() - start, 3)
    return PlanResult(Path(out), bool(meeting), max_drop_pp, fp32_acc, int8_acc, best, tuple(frontier), tuple(ranking),
                      where, seconds, fallback, quality.label_free, quality.metric, len(x), verdict)  # fmt: skip
