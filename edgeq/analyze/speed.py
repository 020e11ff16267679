"""Plans that weigh speed on a target: the fastest model that meets the accuracy budget.

`analyze plan --target T` tries every way back from int8 that T can run (edgeq.quantize.targets):

- full int8 with each activation range method `--ptq` has (min/max, percentile, MSE, entropy);
- float islands: the most sensitive layers kept float (a CPU's XNNPACK has fast float kernels,
  but each island adds QUANTIZE/DEQUANTIZE pairs);
- int16 islands: those layers at 16-bit activations (16x8), which keeps the model integer-only
  (an NPU with 16x8 kernels; on a CPU they run on LiteRT's slow reference kernels).

Every candidate is quantized, scored on the split and timed with profile's own benchmark
(edgeq.profile.run.measure_run, one thread), on this host or, through the fleet, on a device. The
plan keeps the fastest that meets the budget (and --max-size). None meets it: QAT is needed,
and the plan says so with the best PTQ point and the command to run.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from edgeq.analyze.plan import (
    EXACT_LAYERS,
    PlanPoint,
    PlanResult,
    _check_layer_names,
    _fast_wide_ranking,
    _greedy,
    _metric_fields,
    _prefix_search,
    _wide_ranking,
    measuring,
)
from edgeq.analyze.sensitivity import exact_sensitivity, load_fp32_with_data, quality_of
from edgeq.artifacts import write_json_atomic
from edgeq.errors import UsageError
from edgeq.quantize.calibration import calibrate
from edgeq.quantize.ranges import ACTIVATION_METHODS
from edgeq.quantize.targets import load_target
from edgeq.tasks.verdicts import judge

WAYS = {"float": "float islands", "int16": "int16 islands"}
LITERT_INT8 = (
    "int8 (LiteRT Quantizer)"  # full int8 as the int16 islands' engine builds it: its own graph, its own speed
)
# Candidates this close to the fastest are as fast, within the noise of a median: the most accurate of them is kept
SAME_SPEED = 0.05
QAT_EPOCHS = 3
# Float islands that keep more than this share of the layers float, or a file this close to FP32's size, are
# the FP32 model under another name: no real gain, whatever their accuracy (a trained EfficientNetB0's plan kept
# 173 layers float at FP32's size and called it a pass)
MOSTLY_FLOAT = 0.5
FP32_SIZED = 0.9


def in_disguise(point: PlanPoint, movable: int, fp32_size: int) -> str | None:
    """What a candidate that is the FP32 model in disguise is (``float islands: 173 of 180 layers float``),
    or None when it is a real quantized model. ``movable``: the layers a plan could move."""
    if point.way != WAYS["float"] or not point.float_layers:
        return None
    share = point.size_bytes / fp32_size if fp32_size else 0.0
    if len(point.float_layers) > MOSTLY_FLOAT * movable or share >= FP32_SIZED:
        return f"float islands: {len(point.float_layers)} of {movable} layers float, {share:.0%} of FP32's size"
    return None


def host_timer(runs: int = 50, warmup: int = 5, threads: int = 1):
    """``timer(model_bytes) -> median ms`` on this host, with profile's benchmark (XNNPACK)."""
    from edgeq.profile.run import measure_run

    def timed(model_bytes: bytes) -> float:
        with tempfile.TemporaryDirectory(prefix="edgeq-plan-") as tmp:
            path = Path(tmp) / "candidate.tflite"
            path.write_bytes(model_bytes)
            result, model = measure_run(path, threads=threads, runs=runs, warmup=warmup, progress=False)
            del model
        return result.latency.median_ms

    timed.where = "this host, 1 thread"  # type: ignore[attr-defined]
    return timed


def make_target_plan(
    model_path,
    data: str,
    max_drop_pp: float,
    out: str | Path,
    target: str,
    samples: int = 200,
    split: str = "val",
    progress=None,
    ranges: str | None = None,
    task_spec: str | None = None,
    fallback: str | None = None,
    timer=None,
    max_size: int | None = None,
) -> PlanResult:
    """The fastest candidate ``target`` runs that meets ``max_drop_pp`` (and ``max_size`` bytes)."""
    start = time.perf_counter()
    tgt = load_target(target)
    ways = _ways(tgt, fallback)
    timer = timer or host_timer()
    model, dataset, described = load_fp32_with_data(model_path, data, "plan from")
    x, _ = dataset.split(split)
    if len(x) == 0:
        raise UsageError(f"data {data!r} has no {split} samples to measure plans on; use --split test")
    quality = quality_of(model, described, dataset, split, task_spec)
    outputs: dict[tuple, object] = {}
    frontier: list[PlanPoint] = []
    search = _Search(model, dataset, x, quality, samples, timer, frontier, outputs, progress)
    for method in (ranges,) if ranges else ACTIVATION_METHODS:
        search.int8(method)
    fp32 = search.fp32
    meets = _meets(max_drop_pp)
    base = min(frontier, key=lambda p: (_high(p), p.worse_by, p.latency_ms))  # the ranges the islands start from
    if not meets(base):
        for way in ways:
            search.islands(way, base.ranges, max_drop_pp, meets)
    best, accurate, meeting = _choose(
        frontier, meets, max_size, lambda p: in_disguise(p, search.movable, fp32["size_bytes"])
    )
    # slower than FP32 beyond a median's noise, while a faster candidate missed the budget: QAT may reach both
    slow = best.latency_ms > fp32["latency_ms"] * (1 + SAME_SPEED)
    disguise = in_disguise(best, search.movable, fp32["size_bytes"])
    faster_missed = any(p.latency_ms < fp32["latency_ms"] for p in frontier if p not in meeting)
    qat_may_help = bool(disguise) or (slow and faster_missed)
    _check_layer_names(model, model_path, best)
    verdict = judge(
        quality.spec, fp32["reference"], outputs[_key(best)], quality.targets, quality.inputs, max_drop_pp,
        quality.metric,
    ).to_dict()  # fmt: skip
    record = _record(model_path, f"{data} ({split})", max_drop_pp, tgt, quality, fp32, best, frontier, meeting)
    record.update(
        verdict=verdict,
        samples=len(x),
        latency_on=getattr(timer, "where", "a device"),
        max_size_bytes=max_size,
        commands=_commands(model_path, data, out, best, tgt, bool(meeting) and not qat_may_help, quality.label_free),
        slower_than_fp32=bool(meeting) and slow,
        too_big=bool(accurate) and not meeting,
        unresolved_faster=_unresolved_faster(frontier, best, max_drop_pp, max_size),
        as_fast=_as_fast(frontier, best, meeting),
        in_disguise=disguise,
        movable_layers=search.movable,
        **_metric_fields(quality.metric),
    )
    out = Path(out)
    write_json_atomic(out, record)
    int8_value = next((p.value for p in frontier if p.way == "int8" and p.ranges == "minmax"), frontier[0].value)
    return PlanResult(
        out, bool(meeting), max_drop_pp, fp32["value"], int8_value, best, tuple(frontier), (),
        f"{data} ({split})", round(time.perf_counter() - start, 3), best.way or "int8", quality.label_free,
        quality.metric, len(x), verdict,
    )  # fmt: skip


def _choose(frontier, meets, max_size, disguised):
    """The chosen candidate, those that meet the budget, and those that meet it and ``max_size``: the
    fastest (the most accurate of those as fast, within SAME_SPEED), a real quantized model before the FP32
    model in disguise; where the size misses, the smallest within the budget; where nothing meets it, the
    most accurate."""
    accurate = [p for p in frontier if meets(p)]
    meeting = [p for p in accurate if max_size is None or p.size_bytes <= max_size]
    meeting = [p for p in meeting if not disguised(p)] or meeting
    if accurate and not meeting:
        best = min(accurate, key=lambda p: (p.size_bytes, p.latency_ms))
    elif meeting:
        fastest = min(p.latency_ms for p in meeting)
        tied = [p for p in meeting if p.latency_ms <= fastest * (1 + SAME_SPEED)]
        best = min(tied, key=lambda p: (p.worse_by, p.size_bytes, len(p.changed), p.latency_ms))
    else:
        best = min(frontier, key=lambda p: (p.worse_by, p.latency_ms))
    return best, accurate, meeting


def _high(point: PlanPoint) -> float:
    high = point.worse_by_high
    return float("inf") if high is None or high != high else high


def _meets(max_drop_pp: float):
    """A candidate meets the budget when its paired 95% interval does: the upper end of how much worse
    it is stays within the budget. A point estimate within it is not enough: on 599 val samples a
    trained EfficientNetB0's plan of 3 float layers was 0.67 pp worse there, and 3.09 pp on test."""
    return lambda point: _high(point) <= max_drop_pp


def _unresolved_faster(frontier, best: PlanPoint, max_drop_pp: float, max_size) -> int | None:
    """The fastest candidate faster than ``best`` that is within the budget by its point estimate alone
    (its interval reaches past it: more samples would tell), as its index on the frontier. One within
    the budget by its interval too is not that: the same-speed rule passed it over (``_as_fast``)."""
    small = [p for p in frontier if max_size is None or p.size_bytes <= max_size]
    faster = [p for p in small if p.latency_ms < best.latency_ms and p.worse_by <= max_drop_pp < _high(p)]
    return frontier.index(min(faster, key=lambda p: p.latency_ms)) if faster else None


def _as_fast(frontier, best: PlanPoint, meeting) -> list[int]:
    """The candidates that meet the budget by their interval and are faster than ``best`` by less than
    SAME_SPEED (a median's noise): the plan kept the most accurate of them, ``best``."""
    return [frontier.index(p) for p in meeting if p is not best and p.latency_ms < best.latency_ms]


def _ways(tgt, fallback: str | None) -> tuple[str, ...]:
    if fallback is None:
        return tgt.fallbacks
    if fallback not in tgt.fallbacks:
        runs = ", ".join(tgt.runs)
        raise UsageError(
            f"--target {tgt.name} runs {runs}: it cannot run a layer at {fallback}; drop --fallback, and the plan "
            "tries every way the target runs"
        )
    return (fallback,)


def _key(point: PlanPoint) -> tuple:
    return (point.way, point.ranges, point.changed)


class _Search:
    """The candidates of one plan: each quantized, scored, timed, kept on the frontier."""

    def __init__(self, model, dataset, x, quality, samples, timer, frontier, outputs, progress=None):
        self.model, self.dataset, self.x, self.quality = model, dataset, x, quality
        self.samples, self.timer, self.frontier, self.outputs = samples, timer, frontier, outputs
        self.calibrated: dict[str, object] = {}
        self.progress = progress or (lambda _: None)
        self.fp32: dict = {}
        self.movable = 0  # the model's own layers the converter quantizes: what islands may move

    def _measurer(self, cal, fallback: str, method: str, way: str):
        reference, measure, seen = measuring(cal, self.x, self.quality, fallback, self.timer, (method, way))

        def measured(layers: list[str]) -> PlanPoint:
            point = measure(layers)
            out = self.outputs[_key(point)] = seen[point.changed]
            q = self.quality
            verdict = judge(q.spec, reference, out, q.targets, q.inputs, None, q.metric)
            point = replace(point, worse_by_high=round(verdict.interval95[1], 4))
            self.progress(point.way)
            return point

        return reference, measured

    def int8(self, method: str) -> None:
        """Full int8 with ``method``'s activation ranges (the converter's engine, per-channel weights)."""
        cal = calibrate(self.model, self.dataset, self.samples, False, method)
        if not cal.nodes:
            raise UsageError("the converter quantized no layer: there is nothing to plan")
        self.calibrated[method] = cal
        named = {layer.name for layer in self.model.layers}
        self.movable = max(self.movable, sum(name in named for name in cal.layers))
        reference, measure = self._measurer(cal, "float", method, "int8")
        if not self.fp32:
            self.fp32 = {
                "reference": reference,
                "value": self.quality.value(reference),
                # timed twice, the faster kept: the first model a process times runs slow (EfficientNetB0's
                # FP32: 2.07 ms in the plan, 1.16 ms timed again), which made every candidate look fast
                "latency_ms": min(self.timer(cal.float_model), self.timer(cal.float_model)),
                "size_bytes": len(cal.float_model),
            }
        self.frontier.append(measure([]))

    def islands(self, fallback: str, method: str, max_drop_pp: float, meets) -> None:
        """The fewest layers moved to ``fallback`` that meet the budget, and the points on the way."""
        way = WAYS[fallback]
        if fallback == "int16":
            from edgeq.quantize.mixed import calibrate_mixed

            cal = calibrate_mixed(self.model, self.dataset.calibration_samples(self.samples), ranges=method)
        else:
            cal = self.calibrated[method]
        reference, measure = self._measurer(cal, fallback, method, way)
        start = measure([])  # the engine's own full int8 (LiteRT Quantizer's for int16): its own speed
        if fallback == "int16":
            self.frontier.append(replace(start, way=LITERT_INT8))
            self.outputs[_key(self.frontier[-1])] = self.outputs[_key(start)]
        trail = [start]
        # only the model's own layers: a plan file names layers, and convert --plan maps each one back
        named = {layer.name for layer in self.model.layers}
        layers = [name for name in cal.layers if name in named]
        if len(cal.layers) <= EXACT_LAYERS and fallback == "float":
            _, _, ranked = exact_sensitivity(cal, self.x, self.quality, self.progress)
            ranked.sort(key=lambda r: (-r.gain, -r.loss, -r.mse_only_this))
            _greedy([r.layer for r in ranked if r.layer in named], measure, max_drop_pp, trail, meets)
        elif len(cal.layers) <= EXACT_LAYERS:
            ranking = _wide_ranking(self.model, cal, self.x, self.quality, start.value, reference, self.progress)
            _greedy([name for name in ranking if name in named], measure, max_drop_pp, trail, meets)
        else:
            ranking = _fast_wide_ranking(self.model, self.dataset, self.samples, layers, self.calibrated[method])
            _prefix_search([name for name in ranking if name in named], measure, max_drop_pp, trail, meets)
        self.frontier.extend(trail[1:])


def _record(model_path, data: str, max_drop_pp, tgt, quality, fp32: dict, best, frontier, meeting) -> dict:
    """plan.json of a target plan: what convert reads (layers, ranges, fallback) and what was weighed."""
    return {
        "kind": "edgeq.plan",
        "model": str(model_path),
        "data": data,
        "budget": max_drop_pp,
        "met": bool(meeting),
        "target": tgt.to_dict(),
        "fallback": "int16" if best.wide_layers or best.way == LITERT_INT8 else "float",
        "way": best.way,
        "label_free": quality.label_free,
        "fp32_value": fp32["value"],
        "fp32": {k: fp32[k] for k in ("value", "latency_ms", "size_bytes")},
        "int8_value": next((p.value for p in frontier if p.way == "int8"), None),
        "value": best.value,
        "worse_by": best.worse_by,
        "size_bytes": best.size_bytes,
        "latency_ms": best.latency_ms,
        "granularity": "per-channel",
        "ranges": best.ranges,
        "layers": {
            **{name: "float" for name in best.float_layers},
            **{name: {"activation_bits": 16} for name in best.wide_layers},
        },
        "chosen": frontier.index(best),
        "frontier": [asdict(p) for p in frontier],
    }


def conversion_of(best: PlanPoint, plan_path) -> dict:
    """The ConvertOptions fields that build a target plan's chosen candidate (its mode, plan or ranges)."""
    if best.wide_layers or best.way == LITERT_INT8:
        return {"mode": "int8-only", "plan": str(plan_path)}
    if best.float_layers:
        return {"mode": "int8", "plan": str(plan_path)}
    return {"mode": "int8-only", "ptq": best.ranges}


def _commands(model_path, data: str, out, best: PlanPoint, tgt, met: bool, label_free: bool) -> dict:
    """What to run next: the conversion that builds the chosen model, or the QAT the budget needs."""
    options = conversion_of(best, out)
    edgetpu = " --edgetpu" if tgt.name == "edgetpu" and options["mode"] == "int8-only" else ""
    how = f"--plan {out}" if "plan" in options else f"--ptq {best.ranges}"
    convert = f"edgeq convert {model_path} --{options['mode']} {how} --calib {data}{edgetpu}"
    commands = {"convert": convert}
    if not met:
        distill = " --distill" if label_free else ""
        commands["qat"] = f"edgeq train {model_path} --data {data} --epochs 0 --qat-epochs {QAT_EPOCHS}{distill}"
    return commands
