"""Accuracy-budgeted layer-wise precision: full INT8, then the most sensitive layers float
or (``fallback="int16"``) at 16-bit activations.

Layers are ranked by exact sensitivity (accuracy regained by keeping each one float),
then kept float one by one in that order until the accuracy drop against FP32 is within
the budget. Every plan tried is a point of the size/accuracy frontier. The plan file is
a layer-config ({"layers": {name: "float"}}): `edgeq convert --plan` and
`edgeq train --layer-config` both read it.

With the int16 fallback the model stays integer-only: each plan is a LiteRT Quantizer
model (edgeq.quantize.mixed) with the chosen layers at 16x8 and the rest int8, and the
layers are ranked by what each one alone at 16-bit buys back, then by how much of the
output error it removes per activation value it widens (the cost of 16 bits: memory
traffic and the slower 16x8 kernels). The plan names them {"activation_bits": 16}.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgeq.analyze.sensitivity import exact_sensitivity, load_fp32_with_data, quality_of
from edgeq.artifacts import write_json_atomic
from edgeq.errors import UsageError
from edgeq.quantize.calibration import calibrate, predict
from edgeq.tasks.metrics import metric
from edgeq.tasks.verdicts import judge
from edgeq.transforms.int4 import int4_weight_copy

FALLBACKS = ("float", "int16")  # what a layer that int8 hurts becomes
# Up to this many layers, the int16 plan tries each layer alone at 16-bit to rank them (a
# quantization and a pass each); past it, ranking is by each op's own int8 error, one pass.
EXACT_LAYERS = 32


@dataclass(frozen=True)
class PlanPoint:
    float_layers: tuple[str, ...]
    value: float  # the task metric (PlanResult.metric) of the model with these layers moved
    worse_by: float
    size_bytes: int  # with INT4 layers: the INT8 file minus half of their weight bytes (two per byte)
    int4_layers: tuple[str, ...] = ()
    wide_layers: tuple[str, ...] = ()  # at 16-bit activations (fallback int16)
    latency_ms: float | None = None  # median of one thread's runs where the plan timed it (--target)
    ranges: str | None = None  # the activation range method it was quantized with (--target tries several)
    way: str | None = None  # how it left int8 (--target): "int8", "float islands", "int16 islands"
    worse_by_high: float | None = None  # the paired 95% interval's upper end of worse_by (--target judges by it)
    partitions: int | None = None  # XNNPACK's partitions of it where the plan timed it: one runs whole in XNNPACK

    @property
    def changed(self) -> tuple[str, ...]:
        """The layers moved off int8 to meet the budget."""
        return self.float_layers + self.wide_layers


@dataclass(frozen=True)
class PlanResult:
    path: Path
    met: bool
    budget: float  # --max-drop, in the metric's change unit
    fp32_value: float
    int8_value: float
    best: PlanPoint
    frontier: tuple[PlanPoint, ...]
    ranking: tuple[str, ...]  # most sensitive first; empty when full INT8 met the budget (and no --int4)
    data: str
    seconds: float
    fallback: str = "float"  # what a sensitive layer becomes: float | int16
    label_free: bool = False  # measured as agreement with FP32 (the data has no labels)
    # what every value above measures (the output's task metric: accuracy, RMSE, AUC...) and on how many
    metric: str = "accuracy"
    samples: int = 0
    verdict: dict | None = None  # the chosen plan vs FP32: change, n, paired 95% interval (edgeq.tasks.table.Verdict)


def _weight_count(model, layers) -> int:
    return sum(int(model.get_layer(name).get_weights()[0].size) for name in layers)


def _point_meets(max_drop_pp: float):
    return lambda point: point.worse_by <= max_drop_pp


def _greedy(ranking: list[str], measure, max_drop_pp: float, frontier: list[PlanPoint], meets=None) -> None:
    """Move layers off int8 in ranking order until the budget holds, then give back what it does not need.

    Each layer's own gain misses interactions (two layers that are only good float together
    each gain nothing alone), so the greedy pass may move layers the budget does not need:
    give back, last moved first, every one whose return to int8 still meets it. ``meets(point)``:
    whether a plan meets the budget (its point estimate by default).
    """
    meets = meets or _point_meets(max_drop_pp)
    chosen: list[str] = []
    for layer in ranking:
        if meets(frontier[-1]):
            break
        chosen.append(layer)
        frontier.append(measure(chosen))
    if len(chosen) > 1 and meets(frontier[-1]):
        for layer in reversed(chosen[:-1]):
            trial = [name for name in chosen if name != layer]
            point = measure(trial)
            frontier.append(point)
            if meets(point):
                chosen = trial


def _prefix_search(ranking: list[str], measure, max_drop_pp: float, frontier: list[PlanPoint], meets=None) -> None:
    """The shortest prefix of ``ranking`` that meets the budget, in O(log n) measurements: prefixes of
    1, 2, 4, ... layers until one meets it, then bisection between the last two (a model of hundreds
    of layers cannot afford a measurement per layer)."""
    meets = meets or _point_meets(max_drop_pp)
    low, size = 0, 1
    while True:
        size = min(size, len(ranking))
        point = measure(ranking[:size])
        frontier.append(point)
        if meets(point) or size == len(ranking):
            break
        low, size = size, size * 2
    if not meets(point):
        return
    high = size
    while high - low > 1:
        middle = (low + high) // 2
        point = measure(ranking[:middle])
        frontier.append(point)
        if meets(point):
            high = middle
        else:
            low = middle


def _fast_wide_ranking(model, dataset, samples: int, layers: list[str], cal=None) -> list[str]:
    """Layers by their worst op's own int8 error (the debugger's per-op channel SQNR, each op on float
    inputs), worst first: one calibration pass (``cal``'s, when given), however many layers."""
    from edgeq.analyze.sensitivity import fast_sensitivity

    cal = cal or calibrate(model, dataset, samples)
    ranked = [s.layer for s in fast_sensitivity(cal) if s.layer in layers]
    return ranked + [name for name in layers if name not in ranked]


def _wide_ranking(model, mixed, x, quality, int8_value: float, reference, progress=None, cost_of=None) -> list[str]:
    """Layers by what 16-bit activations on that layer alone buy back, then by output error removed per
    activation value widened (``cost_of(layer)``: the values; a Keras layer's output size by default)."""
    int8_out = predict(mixed.quantize(), x)
    int8_mse = float(np.mean((int8_out - reference) ** 2))
    rows = []
    for layer in mixed.layers:
        out = predict(mixed.quantize([layer]), x)
        gain = quality.points(quality.value(out), int8_value)
        removed = int8_mse - float(np.mean((out - reference) ** 2))
        if cost_of is not None:
            cost = max(1, int(cost_of(layer)))
        else:
            cost = max(1, int(np.prod([d for d in model.get_layer(layer).output.shape[1:] if d])))
        rows.append((layer, round(gain, 4), removed / cost))
        if progress is not None:
            progress(layer)
    rows.sort(key=lambda r: (-r[1], -r[2]))
    return [r[0] for r in rows]


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
    fallback: str = "float",
) -> PlanResult:
    start = time.perf_counter()
    if fallback not in FALLBACKS:
        raise UsageError(f"--fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    if fallback == "int16" and (int4 or per_tensor):
        raise UsageError(
            "--fallback int16 plans LiteRT Quantizer's per-channel models: drop --int4 and --granularity per-tensor"
        )
    model, dataset, described = load_fp32_with_data(model_path, data, "plan from")
    x, _ = dataset.split(split)
    if len(x) == 0:
        raise UsageError(f"data {data!r} has no {split} samples to measure plans on; use --split test")
    quality = quality_of(model, described, dataset, split, task_spec)
    calibration = (samples, per_tensor, ranges)
    cal, reference, measure, seen = _measurer(model, dataset, x, quality, fallback, calibration, model_path)
    fp32_acc = quality.value(reference)
    frontier = [measure([])]
    int8_acc = frontier[0].value
    ranked, ranking = _ranked_layers(
        model, dataset, cal, x, quality, (fallback, max_drop_pp, int4, samples), frontier, reference, progress, measure
    )
    if fallback == "float" or len(cal.layers) <= EXACT_LAYERS:
        _greedy(ranking, measure, max_drop_pp, frontier)
    meeting = sorted((p for p in frontier if p.worse_by <= max_drop_pp), key=lambda p: (len(p.changed), p.worse_by))
    # none meets the budget: the least worse plan (worse_by is "worse by" whatever the metric's direction)
    best = meeting[0] if meeting else min(frontier, key=lambda p: (p.worse_by, len(p.changed)))
    if int4 and meeting:
        best = _int4_layers(
            model, dataset, samples, per_tensor, ranges, ranked, best, x, quality, fp32_acc, frontier, max_drop_pp
        )
    _check_layer_names(model, model_path, best)
    out = Path(out)
    verdict = None
    if best.changed in seen and not best.int4_layers:
        verdict = judge(
            quality.spec, reference, seen[best.changed], quality.targets, quality.inputs, max_drop_pp, quality.metric
        ).to_dict()
    record = _plan_record(
        model_path, f"{data} ({split})", max_drop_pp, fallback, quality, (fp32_acc, int8_acc), best, bool(meeting),
        per_tensor, ranges, ranking, frontier,
    )  # fmt: skip
    record.update(verdict=verdict, samples=len(x), **_metric_fields(quality.metric))
    write_json_atomic(out, record)
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
        fallback,
        quality.label_free,
        quality.metric,
        len(x),
        verdict,
    )


def _measurer(model, dataset, x, quality, fallback: str, calibration: tuple, where):
    """The calibration a plan search quantizes from, the FP32 outputs on ``x``, and ``measure``:
    one plan (the layers it moves to 16 bits or float) quantized and scored. ``seen`` keeps each
    measured plan's outputs, by the layers it moved, for the verdict on the chosen one."""
    samples, per_tensor, ranges = calibration
    if fallback == "int16":
        from edgeq.quantize.mixed import calibrate_mixed

        cal = calibrate_mixed(model, dataset.calibration_samples(samples), ranges=ranges)
    else:
        cal = calibrate(model, dataset, samples, per_tensor, ranges)
        if not cal.nodes:
            raise UsageError(f"{where}: the converter quantized no layer: there is nothing to plan")
    return (cal, *measuring(cal, x, quality, fallback))


def _partitions(model_bytes: bytes) -> int | None:
    """XNNPACK's partitions of a candidate (the host's delegate; None where it cannot load one)."""
    from edgeq.errors import ModelLoadError
    from edgeq.runtime.delegation import structure_of

    try:
        return structure_of(model_bytes).partitions
    except ModelLoadError:
        return None


def measuring(cal, x, quality, fallback: str, timer=None, label: tuple = (None, None)):
    """The float model's outputs on ``x``, ``measure`` (one plan quantized from ``cal`` and scored),
    and ``seen``: each measured plan's outputs, by the layers it moved.

    ``timer(model_bytes) -> ms``: each plan's latency too (a plan for a --target); ``label``: the
    (range method, way) its points record."""
    seen: dict[tuple, np.ndarray] = {}
    reference = predict(cal.float_model, x)
    fp32_acc = quality.value(reference)

    def measure(layers: list[str]) -> PlanPoint:
        if fallback == "int16":
            model_bytes = cal.quantize(layers)
        else:
            model_bytes = cal.quantize(cal.nodes_of_layers(layers))
        out = predict(model_bytes, x)
        acc = quality.value(out)
        worse = round(quality.points(fp32_acc, acc), 4)
        latency = None if timer is None else timer(model_bytes)
        extra = {"latency_ms": latency, "ranges": label[0], "way": label[1], "partitions": _partitions(model_bytes)
                 if timer is not None else None}  # fmt: skip
        if fallback == "int16":
            point = PlanPoint((), acc, worse, len(model_bytes), (), tuple(layers), **extra)
        else:
            point = PlanPoint(tuple(layers), acc, worse, len(model_bytes), **extra)
        seen[point.changed] = out
        return point

    return reference, measure, seen


def _ranked_layers(model, dataset, cal, x, quality, search: tuple, frontier, reference, progress, measure):
    """The layers in the order the search tries them (and the sensitivity rows behind it, for --int4).

    The per-layer ranking costs two quantizations and two passes per layer (a trained
    EfficientNetB0's plan took 7.5 minutes with it, 40 s without); it is only needed when
    full INT8 misses the budget, or to order the layers that --int4 tries."""
    fallback, max_drop_pp, int4, samples = search
    int8_acc = frontier[0].value
    ranked, ranking = [], []
    if fallback == "int16":
        if frontier[0].worse_by > max_drop_pp and len(cal.layers) <= EXACT_LAYERS:
            ranking = _wide_ranking(model, cal, x, quality, int8_acc, reference, progress)
        elif frontier[0].worse_by > max_drop_pp:
            ranking = _fast_wide_ranking(model, dataset, samples, cal.layers)
            _prefix_search(ranking, measure, max_drop_pp, frontier)
    elif frontier[0].worse_by > max_drop_pp or int4:
        _, _, ranked = exact_sensitivity(cal, x, quality, progress)
        # Keep float first the layers whose float-ness buys back the most accuracy.
        ranked.sort(key=lambda r: (-r.gain, -r.loss, -r.mse_only_this))
        ranking = [r.layer for r in ranked]
    return ranked, ranking


def _check_layer_names(model, model_path, best: PlanPoint) -> None:
    """A plan names layers of the model it was made for, or it is not written: ``convert --plan`` of it
    would refuse a name that is a converter tensor rather than a layer."""
    layers = {layer.name for layer in model.layers}
    strangers = [n for n in (*best.float_layers, *best.int4_layers, *best.wide_layers) if n not in layers]
    if strangers:
        raise UsageError(
            f"{model_path}: the plan would name {', '.join(strangers[:3])}, which edgeq could not map to a layer of "
            "the model (a tensor of the converted graph); the plan is not written: please report this model"
        )


def _metric_fields(name: str) -> dict:
    """What the plan file's values, worse_by and budget hold: the metric, its unit, its change unit."""
    row = metric(name)
    return {"metric": name, "unit": row.unit, "change_unit": row.change, "higher_is_better": row.higher_is_better}


def _plan_record(
    model_path, data: str, max_drop_pp, fallback, quality, accuracies, best, met: bool, per_tensor, ranges, ranking,
    frontier,
) -> dict:  # fmt: skip
    """plan.json: the budget, whether it was met, each layer's chosen precision, the frontier tried.

    ``accuracies``: (FP32, full INT8) on the split the plan measured.
    """
    return {
        "kind": "edgeq.plan",
        "model": str(model_path),
        "data": data,
        "budget": max_drop_pp,
        "met": met,
        "fallback": fallback,
        # no labels: every value here is top-1 agreement with the FP32 model's own answers
        "label_free": quality.label_free,
        "fp32_value": accuracies[0],
        "int8_value": accuracies[1],
        "value": best.value,
        "worse_by": best.worse_by,
        "size_bytes": best.size_bytes,
        "granularity": "per-tensor" if per_tensor else "per-channel",
        "ranges": ranges,
        "layers": {
            **{name: "float" for name in best.float_layers},
            **{name: {"weight_bits": 4} for name in best.int4_layers},
            **{name: {"activation_bits": 16} for name in best.wide_layers},
        },
        "ranking": ranking,
        "frontier": [asdict(p) for p in frontier],
    }


def _int4_layers(
    model, dataset, samples, per_tensor, ranges, ranked, best, x, quality, fp32_acc, frontier, max_drop_pp
):
    """INT4 weights wherever the budget still holds, least sensitive layers first."""
    weighted = {la.name for la in model.layers if type(la).__name__ in ("Conv2D", "DepthwiseConv2D", "Dense")}
    candidates = sorted(
        (r for r in ranked if r.layer in weighted and r.layer not in best.float_layers),
        key=lambda r: (r.loss, r.mse_only_this),
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
        if point.worse_by <= max_drop_pp:
            accepted = trial
            best = point
    return best


def save_frontier_chart(result: PlanResult, path, fp32: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgeq.artifacts import atomic_path

    if fp32 is not None:  # a target plan: accuracy against latency
        return _save_speed_chart(result, path, fp32)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    row = metric(result.metric)
    sizes = [p.size_bytes / 1024 for p in result.frontier]
    worse = [p.worse_by for p in result.frontier]  # in the metric's change unit, whatever its direction
    ax.plot(sizes, worse, "o-", color="#4062bb")
    for p, s, a in zip(result.frontier, sizes, worse):
        ax.annotate(str(len(p.changed)), (s, a), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(result.budget, color="#c33", lw=0.8, ls="--", label="budget")
    ax.set_xlabel("model size (KiB)")
    ax.set_ylabel(f"{row.label} worse than FP32 ({row.change_label})")
    moved = "at 16-bit" if result.fallback == "int16" else "kept float"
    ax.set_title(f"plans tried (label: layers {moved})")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)


def _save_speed_chart(result: PlanResult, path, fp32: dict) -> None:
    """A target plan's candidates: latency against the metric's change, FP32 and the chosen one marked."""
    import matplotlib.pyplot as plt

    from edgeq.artifacts import atomic_path

    fig, ax = plt.subplots(figsize=(6, 3.5))
    row = metric(result.metric)
    ways = (("int8", "#4062bb"), ("int8 (LiteRT Quantizer)", "#76b7b2"), ("float islands", "#59a14f"),
            ("int16 islands", "#e15759"))  # fmt: skip
    for way, colour in ways:
        points = [p for p in result.frontier if p.way == way]
        if points:
            ax.scatter([p.latency_ms for p in points], [p.worse_by for p in points], s=18, color=colour, label=way)
    ax.scatter([fp32["latency_ms"]], [0.0], marker="*", s=120, color="black", label="FP32")
    best = result.best
    ax.scatter([best.latency_ms], [best.worse_by], s=140, facecolors="none", edgecolors="black", label="chosen")
    ax.axhline(result.budget, color="#c33", lw=0.8, ls="--", label="budget")
    ax.set_xscale("log")
    ax.set_xlabel("latency, ms (log scale)")
    ax.set_ylabel(f"{row.label} worse than FP32 ({row.change_label})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
