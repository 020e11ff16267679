"""Accuracy-budgeted layer-wise precision: full INT8, then the most sensitive layers float.

Layers are ranked by exact sensitivity (accuracy regained by keeping each one float),
then kept float one by one in that order until the accuracy drop against FP32 is within
the budget. Every plan tried is a point of the size/accuracy frontier. The plan file is
a layer-config ({"layers": {name: "float"}}): `edgeq convert --plan` and
`edgeq train --layer-config` both read it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from edgeq.analyze.sensitivity import exact_sensitivity, load_fp32_with_data, quality_of
from edgeq.artifacts import write_json_atomic
from edgeq.calibration import calibrate, predict
from edgeq.errors import UsageError
from edgeq.transforms.int4 import int4_weight_copy


@dataclass(frozen=True)
class PlanPoint:
    float_layers: tuple[str, ...]
    accuracy: float
    drop_pp: float
    size_bytes: int  # with INT4 layers: the INT8 file minus half of their weight bytes (two per byte)
    int4_layers: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlanResult:
    path: Path
    met: bool
    max_drop_pp: float
    fp32_accuracy: float
    int8_accuracy: float
    best: PlanPoint
    frontier: tuple[PlanPoint, ...]
    ranking: tuple[str, ...]  # most sensitive first; empty when full INT8 met the budget (and no --int4)
    data: str
    seconds: float


def _weight_count(model, layers) -> int:
    return sum(int(model.get_layer(name).get_weights()[0].size) for name in layers)


def make_plan(
    model_path,
    data: str,
    max_drop_pp: float,
    out: str | Path,
    samples: int = 200,
    split: str = "val",
    per_tensor: bool = False,
    progress=None,
    int4: bool = False,
    ranges: str = "minmax",
    task_spec: str | None = None,
) -> PlanResult:
    start = time.perf_counter()
    model, dataset = load_fp32_with_data(model_path, data, "plan from")
    x, _ = dataset.split(split)
    if len(x) == 0:
        raise UsageError(f"data {data!r} has no {split} samples to measure plans on; use --split test")
    cal = calibrate(model, dataset, samples, per_tensor, ranges)
    if not cal.nodes:
        raise UsageError(f"{model_path}: the converter quantized no layer: there is nothing to plan")
    quality = quality_of(model, model_path, dataset, split, task_spec)
    fp32_acc = quality.value(predict(cal.float_model, x))

    def measure(float_layers: list[str]) -> PlanPoint:
        model_bytes = cal.quantize(cal.nodes_of_layers(float_layers))
        acc = quality.value(predict(model_bytes, x))
        return PlanPoint(tuple(float_layers), acc, round(quality.points(fp32_acc, acc), 4), len(model_bytes))

    frontier = [measure([])]
    int8_acc = frontier[0].accuracy
    # The per-layer ranking costs two quantizations and two passes per layer (a trained
    # EfficientNetB0's plan took 7.5 minutes with it, 40 s without); it is only needed when
    # full INT8 misses the budget, or to order the layers that --int4 tries.
    ranked = []
    if frontier[0].drop_pp > max_drop_pp or int4:
        _, _, ranked = exact_sensitivity(cal, x, quality, progress)
    # Keep float first the layers whose float-ness buys back the most accuracy.
    ranked.sort(key=lambda r: (-r.gain_pp, -r.loss_pp, -r.mse_only_this))
    ranking = [r.layer for r in ranked]
    chosen: list[str] = []
    for layer in ranking:
        if frontier[-1].drop_pp <= max_drop_pp:
            break
        chosen.append(layer)
        frontier.append(measure(chosen))
    if len(chosen) > 1 and frontier[-1].drop_pp <= max_drop_pp:
        # Each layer's own gain misses interactions (two layers that are only good float together
        # each gain nothing alone), so the greedy pass may keep layers float that the budget does
        # not need: give back, last kept first, every one whose return to int8 still meets it.
        for layer in reversed(chosen[:-1]):
            trial = [name for name in chosen if name != layer]
            point = measure(trial)
            frontier.append(point)
            if point.drop_pp <= max_drop_pp:
                chosen = trial
    meeting = sorted((p for p in frontier if p.drop_pp <= max_drop_pp), key=lambda p: (len(p.float_layers), p.drop_pp))
    best = meeting[0] if meeting else max(frontier, key=lambda p: (p.accuracy, -len(p.float_layers)))
    if int4 and meeting:
        # INT4 weights wherever the budget still holds, least sensitive layers first.
        weighted = {la.name for la in model.layers if type(la).__name__ in ("Conv2D", "DepthwiseConv2D", "Dense")}
        candidates = sorted(
            (r for r in ranked if r.layer in weighted and r.layer not in best.float_layers),
            key=lambda r: (r.loss_pp, r.mse_only_this),
        )
        accepted: list[str] = []
        for candidate in candidates:
            trial = [*accepted, candidate.layer]
            trial_cal = calibrate(int4_weight_copy(model, trial), dataset, samples, per_tensor, ranges)
            model_bytes = trial_cal.quantize(trial_cal.nodes_of_layers(best.float_layers))
            acc = quality.value(predict(model_bytes, x))
            point = PlanPoint(
                best.float_layers,
                acc,
                round(quality.points(fp32_acc, acc), 4),
                len(model_bytes) - _weight_count(model, trial) // 2,
                tuple(trial),
            )
            frontier.append(point)
            if point.drop_pp <= max_drop_pp:
                accepted = trial
                best = point
    out = Path(out)
    write_json_atomic(
        out,
        {
            "kind": "edgeq.plan",
            "model": str(model_path),
            "data": f"{data} ({split})",
            "max_drop_pp": max_drop_pp,
            "met": bool(meeting),
            "fp32_accuracy": fp32_acc,
            "int8_accuracy": int8_acc,
            "accuracy": best.accuracy,
            "drop_pp": best.drop_pp,
            "size_bytes": best.size_bytes,
            "granularity": "per-tensor" if per_tensor else "per-channel",
            "ranges": ranges,
            "layers": {
                **{name: "float" for name in best.float_layers},
                **{name: {"weight_bits": 4} for name in best.int4_layers},
            },
            "ranking": ranking,
            "frontier": [asdict(p) for p in frontier],
        },
    )
    return PlanResult(
        out,
        bool(meeting),
        max_drop_pp,
        fp32_acc,
        int8_acc,
        best,
        tuple(frontier),
        tuple(ranking),
        f"{data} ({split})",
        round(time.perf_counter() - start, 3),
    )


def save_frontier_chart(result: PlanResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeq.artifacts import atomic_path

    fig, ax = plt.subplots(figsize=(6, 3.5))
    sizes = [p.size_bytes / 1024 for p in result.frontier]
    accs = [p.accuracy * 100 for p in result.frontier]
    ax.plot(sizes, accs, "o-", color="#4062bb")
    for p, s, a in zip(result.frontier, sizes, accs):
        ax.annotate(str(len(p.float_layers)), (s, a), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(result.fp32_accuracy * 100 - result.max_drop_pp, color="#c33", lw=0.8, ls="--", label="budget")
    ax.set_xlabel("model size (KiB)")
    ax.set_ylabel(f"accuracy on {result.data} (%)")
    ax.set_title("plans tried (label: layers kept float)")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
