"""The ladder, cheapest rung first, stopping at the first that gives a model faster than FP32 within the budget.

1. PTQ: full int8 with each activation range method;
2. the target plan: float or int16 islands the target runs (edgeq.analyze.speed, one search with rung 1);
3. QAT: with labels where the data has them, else distilled from the FP32 model (edgeq.train);
4. QAT again with the plan's float islands kept float (``train --layer-config PLAN``), if still short.

Each rung's candidate is chosen on val: it must meet the budget there by its paired 95% interval, be
faster than FP32 beyond a median's noise (on a target that runs float: on an integer-only one FP32 does
not run at all), fit ``max_size`` and not be the FP32 model in disguise. It is then built by the stage
that builds it (convert), timed again and judged once on test, which no choice has seen: its interval
must lie within the budget there too, or the ladder goes on. The final verdict is the test verdict.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from edgeq.analyze.sensitivity import load_fp32_with_data, quality_of
from edgeq.analyze.speed import QAT_EPOCHS, SAME_SPEED, conversion_of, host_timer, in_disguise, make_target_plan
from edgeq.errors import ConversionError, DataError, QualityGateError, UsageError
from edgeq.quantize.targets import load_target
from edgeq.report.format import size as human_bytes
from edgeq.runtime.delegation import structure_of
from edgeq.tasks.metrics import metric
from edgeq.tasks.verdicts import Verdict, judge

RUNGS = ("PTQ", "target plan", "QAT", "QAT with the plan's islands")
CANDIDATES = "candidates"  # where the built files of candidates that were not chosen go


@dataclass
class Rung:
    """What one rung of the ladder tried, and what became of it."""

    number: int
    name: str
    outcome: str = "skipped"  # chosen | failed on test | passed over | refused | skipped
    why: str = ""
    way: str | None = None
    seconds: float = 0.0
    candidates: list[dict] = field(default_factory=list)  # what the rung weighed (a plan's frontier points)
    file: str | None = None
    latency_ms: float | None = None
    size_bytes: int | None = None
    partitions: int | None = None  # XNNPACK's partitions of the built file: one runs whole in XNNPACK
    val: dict | None = None  # the candidate's verdict on val (what chose it)
    test: dict | None = None  # on test (what confirms it), judged once

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Judging:
    """A split's inputs, what the task is judged by on it, and FP32's outputs there."""

    x: object
    quality: object
    reference: object


@dataclass
class Ladder:
    """One optimize run: its settings, FP32's figures, and the rungs so far."""

    model: Path
    data: str
    budget: float
    out: Path
    target: object
    timer: object
    max_size: int | None
    calib_samples: int
    task: str | None
    say: object
    fp32: dict = field(default_factory=dict)
    rungs: list[Rung] = field(default_factory=list)
    splits: dict = field(default_factory=dict)
    label_free: bool = False
    test: Judging | None = None  # the split that confirms; no choice reads it

    @property
    def runs_float(self) -> bool:
        return "float" in self.target.runs


def optimize(
    model_path, data: str, target: str, max_drop_pp: float, out: str | Path, *, max_size: int | None = None,
    ranges: str | None = None, calib_samples: int = 200, timer=None, task: str | None = None,
    qat_epochs: int = QAT_EPOCHS, say=None, progress=None,
) -> dict:  # fmt: skip
    """Climb the ladder for ``model_path`` on ``data``; return what optimize.json records (the caller writes it)."""
    out = Path(out)
    if str(model_path).endswith(".tflite"):
        raise UsageError(
            f"{model_path}: optimize trains and plans a Keras model (QAT needs one); a float .tflite converts with "
            f"`edgeq convert {model_path} --int8-only --calib DATA` and plans its ops with `edgeq analyze plan`"
        )
    if out.exists() and any(p.name != "device" for p in out.iterdir()):  # device/: --on's profiles
        raise UsageError(f"--out {out}: the folder is not empty; give a new folder (optimize writes a whole one)")
    start = time.perf_counter()
    ladder = Ladder(Path(model_path), data, max_drop_pp, out, load_target(target), timer or host_timer(),
                    max_size, calib_samples, task, say or (lambda _: None))  # fmt: skip
    val, ladder.test = _judgings(ladder)  # a model or data that cannot be read leaves no folder behind
    out.mkdir(parents=True, exist_ok=True)
    ladder.say(_sizes_line(ladder))
    plan = _plan_rungs(ladder, ranges, progress)
    chosen = next((r for r in ladder.rungs if r.outcome == "chosen"), None)
    if chosen is None:
        chosen = _qat_rungs(ladder, plan, val, qat_epochs)
    return _summary(ladder, chosen, time.perf_counter() - start)


def _judgings(ladder: Ladder) -> tuple[Judging, Judging]:
    model, dataset, described = load_fp32_with_data(ladder.model, ladder.data, "optimize")
    found = []
    for split in ("val", "test"):
        x, _ = dataset.split(split)
        if len(x) == 0:
            raise DataError(f"data {ladder.data!r} has no {split} samples: optimize chooses on val, confirms on test")
        quality = quality_of(model, described, dataset, split, ladder.task)
        found.append(Judging(x, quality, model.predict(x, batch_size=64, verbose=0)))
        ladder.splits[split] = len(x)
    ladder.label_free = found[0].quality.label_free
    ladder.splits["metric"] = found[0].quality.metric
    return found[0], found[1]


def resolvable_agreement(n: int, budget_pp: float) -> float:
    """The share of FP32's answers a classifier must keep for its paired 95% interval, at no change in
    accuracy, to end within ``budget_pp``: the interval's half width is about 196 sqrt(d / n) pp, d the
    share of answers that change."""
    return max(0.0, 1.0 - n * (budget_pp / 196.0) ** 2)


def _sizes_line(ladder: Ladder) -> str:
    val, test = ladder.splits["val"], ladder.splits["test"]
    text = f"{ladder.data}: val n={val} chooses, test n={test} confirms (70/10/20 of the data)"
    if ladder.splits["metric"] == "accuracy":
        text += (
            f"; within {ladder.budget:g} pp by the interval needs about {resolvable_agreement(val, ladder.budget):.1%} "
            f"top-1 agreement with FP32 on val, {resolvable_agreement(test, ladder.budget):.1%} on test"
        )
    return text


def _plan_rungs(ladder: Ladder, ranges: str | None, progress) -> dict:
    """Rungs 1 and 2: one target plan on val (every range method at full int8, then the islands the target
    runs where full int8 misses the budget), its pick built, timed and judged on test."""
    marks: dict[str, float] = {}
    start = time.perf_counter()

    def seen(what) -> None:  # the time of the last full-int8 candidate ends rung 1
        if what == "int8":
            marks["int8"] = time.perf_counter() - start
        if progress is not None:
            progress(what)

    plan_path = ladder.out / "plan.json"
    result = make_target_plan(ladder.model, ladder.data, ladder.budget, plan_path, ladder.target.name,
                              ladder.calib_samples, "val", seen, ranges, ladder.task, None, ladder.timer,
                              ladder.max_size)  # fmt: skip
    total = time.perf_counter() - start  # the search's own time; FP32's second timing is not a rung's
    record = json.loads(plan_path.read_text())
    ladder.fp32 = dict(record["fp32"], where=record["latency_on"], plan_latency_ms=record["fp32"]["latency_ms"])
    _fp32_file(ladder)
    ladder.say(f"FP32: {ladder.fp32['latency_ms']:.3g} ms on {ladder.fp32['where']} (the faster of the plan's "
               f"timing and a second one), {human_bytes(ladder.fp32['size_bytes'])}")  # fmt: skip
    ptq = Rung(1, RUNGS[0], seconds=round(marks.get("int8", total), 1))
    islands = Rung(2, RUNGS[1], seconds=round(total - ptq.seconds, 1))
    for point, raw in zip(result.frontier, record["frontier"]):
        (ptq if point.way == "int8" else islands).candidates.append(raw)
    best = result.best
    pick, other = (ptq, islands) if best.way == "int8" else (islands, ptq)
    low = min(ptq.candidates, key=lambda p: p["worse_by_high"])
    if other is ptq:
        other.outcome = "passed over"
        other.why = (f"full int8 misses the budget on val: the best ({low['ranges']} ranges) is at most "
                     f"{low['worse_by_high']:+.2f}")  # fmt: skip
    elif not ladder.target.fallbacks:
        other.why = f"{ladder.target.name} runs int8 only: there are no islands to try"
    elif not islands.candidates:
        other.why = "not searched: full int8 met the budget on val, and islands are searched only where it misses"
    else:
        near = min(islands.candidates, key=lambda p: p["worse_by_high"])
        other.outcome = "passed over"
        other.why = f"no island candidate met the budget on val: the best is at most {near['worse_by_high']:+.2f}"
    ladder.rungs += sorted((ptq, islands), key=lambda r: r.number)
    _try_plan_point(ladder, pick, best, result.met, record)
    for rung in (ptq, islands):
        ladder.say(_rung_line(ladder, rung))
    return record


def _fp32_file(ladder: Ladder) -> None:
    """FP32's .tflite (convert --fp32) in candidates/, timed again: FP32's latency is the faster of the two
    medians, so one slow moment of a loaded machine never makes every candidate look fast."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert

    folder = ladder.out / CANDIDATES
    folder.mkdir(exist_ok=True)
    path = folder / "fp32.tflite"
    try:
        convert(ladder.model, path, ConvertOptions(mode="fp32", task=ladder.task))
    except ConversionError as exc:  # the plan's one timing stands
        ladder.fp32["note"] = f"FP32 timed once: its own conversion failed ({str(exc)[:160]})"
        return
    again = round(float(ladder.timer(path.read_bytes())), 4)
    ladder.fp32.update(file=str(path.relative_to(ladder.out)), latency_ms=min(ladder.fp32["latency_ms"], again))
    ladder.fp32["timings_ms"] = [ladder.fp32["plan_latency_ms"], again]


def final_timing(ladder: Ladder, chosen: Rung) -> None:
    """The closing line's speed: FP32's file and the chosen one timed back to back, twice each, the faster
    median of each kept (the same timer, the same minute)."""
    if "file" not in ladder.fp32:
        return
    fp32 = (ladder.out / ladder.fp32["file"]).read_bytes()
    mine = (ladder.out / chosen.file).read_bytes()
    times = [(ladder.timer(fp32), ladder.timer(mine)) for _ in range(2)]
    ladder.fp32["final_ms"] = round(float(min(t[0] for t in times)), 4)
    chosen.latency_ms = round(float(min(t[1] for t in times)), 4)


def refusal(point, fp32: dict, budget: float, runs_float: bool, movable: int, max_size: int | None) -> str | None:
    """Why a plan's candidate cannot end the ladder, judged on val (None: it may, once test confirms it)."""
    disguise = in_disguise(point, movable, fp32["size_bytes"])
    high = point.worse_by_high
    if disguise:
        return f"{disguise}: the FP32 model in disguise, no real gain"
    if high is None or not math.isfinite(high) or high > budget:
        return f"misses the budget on val by its interval (at most {high:+.2f})"
    if max_size is not None and point.size_bytes > max_size:
        return f"{point.size_bytes / 1024:.1f} KiB, over --max-size {max_size / 1024:.0f} KiB"
    if runs_float and point.latency_ms > fp32["latency_ms"] * (1 - SAME_SPEED):
        return (f"not faster than FP32 beyond a median's noise ({point.latency_ms:.3g} vs {fp32['latency_ms']:.3g} ms, "
                f"{SAME_SPEED:.0%})")  # fmt: skip
    return None


def _try_plan_point(ladder: Ladder, rung: Rung, best, met: bool, record: dict) -> None:
    rung.way = _way(best)
    rung.latency_ms, rung.size_bytes = best.latency_ms, best.size_bytes
    why = refusal(best, ladder.fp32, ladder.budget, ladder.runs_float, record["movable_layers"], ladder.max_size)
    if why:
        rung.outcome, rung.why = "passed over", why
        return
    options = conversion_of(best, ladder.out / "plan.json")
    options.update(calib=ladder.data, calib_samples=ladder.calib_samples, task=ladder.task)
    name = "ptq" if rung.number == 1 else "plan"
    _build_and_confirm(ladder, rung, ladder.model, options, name, None, best.worse_by_high)


def _way(point) -> str:
    if point.way == "int8":
        return f"int8 ({point.ranges} ranges)"
    if point.changed:
        return f"{point.way} ({len(point.changed)} layers, {point.ranges} ranges)"
    return str(point.way)


def _build_and_confirm(
    ladder: Ladder, rung: Rung, source, options: dict, name: str, val: Judging | None, val_high: float | None = None
) -> None:
    """Convert ``source`` as ``options`` say, time the file, judge it on val (a QAT model: the plan judged
    its own candidates there, ``val_high``), then once on test. The file stays in the folder only when chosen."""
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert

    if ladder.target.name == "edgetpu" and options.get("mode") == "int8-only":
        options["edgetpu"] = True
    if not ladder.label_free and val is None:
        # the FP32 model's own conversion is verified against FP32 by the task metric, as the ladder judges;
        # a QAT model's against the QAT model (SQNR): its budget is against FP32, which the ladder judges itself
        options.setdefault("max_drop", ladder.budget)
    path = ladder.out / f"{name}.tflite"
    try:
        built = convert(source, path, ConvertOptions(**{k: v for k, v in options.items() if v is not None}))
    except ConversionError as exc:
        rung.outcome, rung.why = "refused", f"convert refused it: {exc}"
        return
    rung.file, rung.size_bytes = path.name, built.size_bytes
    model_bytes = path.read_bytes()
    rung.latency_ms = round(float(ladder.timer(model_bytes)), 4)
    rung.partitions = structure_of(model_bytes).partitions
    if val is not None:
        rung.val = _judged(path, val, ladder.budget).to_dict()
        val_high = rung.val["interval95"][1]
    point = _AsPoint(rung.latency_ms, rung.size_bytes, float("nan") if val_high is None else val_high)
    why = refusal(point, ladder.fp32, ladder.budget, ladder.runs_float, 1, ladder.max_size)
    if why:  # the file built, as timed and judged itself
        rung.outcome, rung.why = "passed over", f"as built: {why}"
        _set_aside(ladder, path)
        return
    verdict = _judged(path, ladder.test, ladder.budget)
    rung.test = verdict.to_dict()
    if verdict.passed:
        rung.outcome, rung.why = "chosen", "meets the budget on test by its interval, faster than FP32"
        if not ladder.runs_float:
            rung.why = f"meets the budget on test by its interval; FP32 does not run on {ladder.target.name}"
        return
    rung.outcome = "failed on test"
    rung.why = f"chosen on val, but on test at most {verdict.interval95[1]:+.2f}: over the budget"
    _set_aside(ladder, path)


@dataclass(frozen=True)
class _AsPoint:
    """A built file's figures in the shape ``refusal`` reads (never float islands: no disguise)."""

    latency_ms: float
    size_bytes: int
    worse_by_high: float
    way: str = "int8"
    float_layers: tuple = ()


def _judged(path: Path, split: Judging, budget: float) -> Verdict:
    """The file against FP32 on ``split``: passed only when the paired interval's upper end is within ``budget``."""
    from edgeq.runtime.interpreter import TFLiteModel

    q = split.quality
    got = TFLiteModel(path, use_default_delegates=False).predict(split.x, batch_size=1)
    verdict = judge(q.spec, split.reference, got, q.targets, q.inputs, None, q.metric)
    high = verdict.interval95[1]
    return replace(verdict, budget=budget, passed=bool(math.isfinite(high) and high <= budget))


def _set_aside(ladder: Ladder, path: Path) -> None:
    """A built candidate that was not chosen: into candidates/, with its manifest, out of the shipping folder."""
    folder = ladder.out / CANDIDATES
    folder.mkdir(exist_ok=True)
    for part in (path, path.with_name(f"{path.stem}.manifest.json")):
        if part.exists():
            os.replace(part, folder / part.name)


def _rung_line(ladder: Ladder, rung: Rung) -> str:
    text = f"rung {rung.number} ({rung.name}, {rung.seconds:.0f} s): {rung.outcome}"
    if rung.way:
        text += f": {rung.way}"
    if rung.latency_ms is not None:
        text += f", {rung.latency_ms:.3g} ms vs FP32 {ladder.fp32['latency_ms']:.3g}"
    if rung.partitions is not None:
        text += f", {rung.partitions} XNNPACK partition(s)"
    if rung.test:
        text += f"; test {Verdict.from_dict(rung.test).line()}"
    return text + (f" ({rung.why})" if rung.why and rung.outcome != "chosen" else "")


def _qat_rungs(ladder: Ladder, plan: dict, val: Judging, qat_epochs: int) -> Rung | None:
    """Rungs 3 and 4: QAT (labels or distilled, the default schedule, keep-best on val), then QAT with the
    plan's float islands kept float, each converted, timed, judged on val, then on test."""
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    islands = [k for k, v in plan["layers"].items() if v == "float"]
    steps = [(3, None), (4, ladder.out / "plan.json" if islands and not plan.get("in_disguise") else None)]
    for number, layer_config in steps:
        rung = Rung(number, RUNGS[number - 1])
        ladder.rungs.append(rung)
        if number == 4 and layer_config is None:
            rung.why = ("the plan has no float islands to keep" if not islands
                        else "the plan's islands are the FP32 model in disguise")  # fmt: skip
            ladder.say(_rung_line(ladder, rung))
            continue
        start = time.perf_counter()
        folder = ladder.out / ("qat" if number == 3 else "qat_islands")
        how = "label-free, distilled from FP32" if ladder.label_free else "labels"
        rung.way = f"int8 (QAT, {how})" + (f", {len(islands)} layers float" if layer_config else "")
        ladder.say(f"rung {number} ({rung.name}): training {qat_epochs} QAT epochs ({how}) into {folder}")
        result = train(TrainConfig(model=str(ladder.model), data=ladder.data, out_dir=str(folder), epochs=0,
                                   qat_epochs=qat_epochs, task=ladder.task,
                                   layer_config=str(layer_config) if layer_config else None))  # fmt: skip
        options = {"mode": "int8" if layer_config else "int8-only", "task": ladder.task}
        _build_and_confirm(ladder, rung, result.qat_model, options, "qat" if number == 3 else "qat_islands", val)
        rung.seconds = round(time.perf_counter() - start, 1)
        ladder.say(_rung_line(ladder, rung))
        if rung.outcome == "chosen":
            return rung
    return None


def _summary(ladder: Ladder, chosen: Rung | None, seconds: float) -> dict:
    """optimize.json: every rung, FP32's figures, the split sizes, the chosen one and why, the closing line."""
    if chosen is not None:
        final_timing(ladder, chosen)
    return {
        "kind": "edgeq.optimize",
        "model": str(ladder.model),
        "data": ladder.data,
        "budget": ladder.budget,
        "metric": ladder.splits.get("metric"),
        "change_unit": metric(ladder.splits.get("metric") or "accuracy").change_label,
        "target": ladder.target.to_dict(),
        "latency_on": ladder.fp32.get("where"),
        "host_stands_in": str(ladder.fp32.get("where", "")).startswith("this host"),
        "label_free": ladder.label_free,
        "splits": {"val": ladder.splits["val"], "test": ladder.splits["test"]},
        "fp32": {k: v for k, v in ladder.fp32.items() if k != "where"},
        "max_size_bytes": ladder.max_size,
        "rungs": [r.to_dict() for r in ladder.rungs],
        "chosen": None if chosen is None else chosen.number,
        "file": None if chosen is None else chosen.file,
        "passed": chosen is not None,
        "seconds": round(seconds, 1),
        "line": closing_line(ladder, chosen),
    }


def closing_line(ladder: Ladder, chosen: Rung | None) -> str:
    fp32 = ladder.fp32
    where = "" if not str(fp32.get("where", "")).startswith("this host") else " (this host stood in for the target)"
    if chosen is None:
        return f"no rung met --max-drop {ladder.budget:g} on test faster than FP32: FAIL{where}"
    test = Verdict.from_dict(chosen.test)
    low, high = test.interval95
    row = metric(test.metric)
    fp32_ms = fp32.get("final_ms", fp32["latency_ms"])
    speed = f"{chosen.latency_ms:.3g} ms vs FP32 {fp32_ms:.3g} ms ({fp32_ms / chosen.latency_ms:.1f}x)"
    if not ladder.runs_float:
        name = ladder.target.name
        speed = f"{chosen.latency_ms:.3g} ms (FP32 does not run on {name}; {fp32_ms:.3g} ms here)"
    sizes = f"{human_bytes(chosen.size_bytes)} vs {human_bytes(fp32['size_bytes'])}"
    return (
        f"{chosen.way} ({chosen.name}): {speed}, {sizes}, test {row.label} {row.show_change(test.worse_by)} "
        f"(95% CI {low:+.2f}..{high:+.2f} {row.change_label} worse, n={test.n:,}): pass{where}"
    )


def gate(record: dict) -> None:
    """The exit of a ladder that found nothing: one line, naming the best test figure and the record."""
    if record["passed"]:
        return
    tried = [r for r in record["rungs"] if r["outcome"] != "skipped"]
    raise QualityGateError(
        f"no rung of the ladder gave a model faster than FP32 within --max-drop {record['budget']:g} on test ("
        + "; ".join(f"{r['number']} {r['name']}: {r['outcome']}" for r in tried)
        + "): each rung's figures are in optimize.json"
    )
