"""`edgeq optimize` for BENCHMARKS.md: the ladder against `analyze plan --target cpu` alone.

keras.applications EfficientNetB0 and MobileNetV3Small, trained from scratch at 32x32 on bench_ptq's photo
task (6,000 samples: val 600 chooses, test 1,199 confirms), as bench_mixed and bench_speed train them. For
each: `edgeq.optimize(FP32, data, max_drop_pp=1, target="cpu")` (every rung timed with profile's benchmark
on this CPU, 1 thread), its wall time, the rung it reached and its test verdict (paired bootstrap 95%
interval); beside it the plan alone (the rungs 1-2 search `analyze plan --target cpu --max-drop 1` runs, on
val), its pick built by the conversion it names and judged on the same test samples.

`python tools/bench.py --only optimize` (env EDGEQ_BENCH_OPTIMIZE_ARCHS=..., EDGEQ_BENCH_CACHE=DIR keeps
the trained FP32 models and each finished row).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ARCHS = os.environ.get("EDGEQ_BENCH_OPTIMIZE_ARCHS", "EfficientNetB0,MobileNetV3Small").split(",")
BUDGET_PP = 1.0


def _plan_alone(record: dict, out: Path, fp32: Path, data: str) -> dict:
    """The plan's own pick (what `analyze plan --target cpu` hands back), judged on test."""
    from edgeq.analyze.plan import PlanPoint
    from edgeq.analyze.speed import conversion_of
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.evaluate.run import evaluate

    plan = json.loads((out / "plan.json").read_text())
    best = plan["frontier"][plan["chosen"]]
    row = {
        "met": plan["met"], "way": best["way"], "ranges": best["ranges"],
        "moved": len(best["float_layers"]) + len(best["wide_layers"]), "in_disguise": plan.get("in_disguise"),
        "latency_ms": best["latency_ms"], "size_bytes": best["size_bytes"], "val_high": best["worse_by_high"],
        "candidates": len(plan["frontier"]),
    }  # fmt: skip
    built = next((r for r in record["rungs"][:2] if r.get("test")), None)
    if built is not None:
        row["test"] = built["test"]
        return row
    options = conversion_of(
        PlanPoint(**{**best, **{k: tuple(best[k]) for k in ("float_layers", "int4_layers", "wide_layers")}}),
        out / "plan.json",
    ) | {"calib": data, "min_sqnr_db": -1000.0}
    path = out.parent / f"{out.name}_plan_alone.tflite"
    convert(fp32, path, ConvertOptions(**options))
    row["test"] = evaluate(path, fp32, data, split="test").verdicts[0]
    return row


def measure_arch(name: str, photos: str, raw: str, folder: Path) -> dict:
    from bench_mixed import _fp32
    from bench_ptq import RAW_PIXELS

    import edgeq
    from edgeq.errors import QualityGateError

    data = raw if name in RAW_PIXELS else photos
    cache = Path(os.environ.get("EDGEQ_BENCH_CACHE") or folder)
    cache.mkdir(parents=True, exist_ok=True)
    saved = cache / f"{name}_optimize_row.json"
    if saved.exists():
        return json.loads(saved.read_text())
    start = time.perf_counter()
    fp32 = _fp32(name, data, cache)
    train_seconds = round(time.perf_counter() - start, 1)
    out = folder / f"{name}_optimized"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    try:
        edgeq.optimize(fp32, data, max_drop_pp=BUDGET_PP, target="cpu", out=out, say=lambda s: print(name, s))
    except QualityGateError as exc:
        print(name, "optimize:", exc, flush=True)
    wall = round(time.perf_counter() - start, 1)
    record = json.loads((out / "optimize.json").read_text())
    row = {
        "model": name, "fp32_train_seconds": train_seconds, "wall_seconds": wall, "record": record,
        "plan_alone": _plan_alone(record, out, fp32, data),
    }  # fmt: skip
    saved.write_text(json.dumps(row))
    return row


def measure() -> list[dict]:
    import bench_mixed

    return bench_mixed.measure(ARCHS, measure_arch)


def _test_cell(verdict: dict | None) -> str:
    if not verdict:
        return "-"
    low, high = verdict["interval95"]
    word = "worse" if verdict["worse_by"] > 0 else "better"
    return f"{abs(verdict['worse_by']):.2f} pp {word} (drop 95% CI {low:+.2f}..{high:+.2f}, n={verdict['n']:,})"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | what | rung reached / pick | test: change vs FP32 | within 1 pp by the interval "
        "| latency ms (FP32, x) | size KiB (FP32) | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rec, plan = row["record"], row["plan_alone"]
        fp32 = rec["fp32"]
        chosen = next((r for r in rec["rungs"] if r["outcome"] == "chosen"), None)
        reached = f"{chosen['number']} {chosen['name']}: {chosen['way']}" if chosen else "none (FAIL)"
        last = chosen or rec["rungs"][-1]
        for what, pick, test, latency, size, wall in (
            ("`edgeq optimize`", reached, last.get("test"), last.get("latency_ms"), last.get("size_bytes"),
             row["wall_seconds"]),
            ("`analyze plan --target cpu` alone", f"{plan['way']} ({plan['ranges']}, {plan['moved']} moved)"
             + (f"; {plan['in_disguise']}" if plan.get("in_disguise") else ""), plan["test"], plan["latency_ms"],
             plan["size_bytes"], None),
        ):  # fmt: skip
            within = "-" if not test else ("yes" if test["interval95"][1] <= BUDGET_PP else "no")
            # the ladder's pick against FP32 timed back to back at the end; the plan's against the plan's FP32 timing
            ms = fp32.get("final_ms") if wall is not None else fp32.get("plan_latency_ms")
            ms = ms or fp32["latency_ms"]
            speed = "-" if not latency else f"{latency:.3f} ({ms:.3f}, {ms / latency:.1f}x)"
            size_kib = "-" if not size else f"{size / 1024:.0f} ({fp32['size_bytes'] / 1024:.0f})"
            lines.append(
                f"| {row['model']} | {what} | {pick} | {_test_cell(test)} | {within} | {speed} | {size_kib} | "
                f"{'-' if wall is None else f'{wall:.0f}'} |"
            )
    return lines


def _rungs(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        parts = []
        for r in row["record"]["rungs"]:
            figures = f", {r['latency_ms']:.3f} ms" if r.get("latency_ms") else ""
            parts.append(f"{r['number']} {r['name']} ({r['seconds']:.0f} s): {r['outcome']}{figures}"
                         + (f" ({r['why']})" if r["why"] and r["outcome"] != "chosen" else ""))  # fmt: skip
        lines.append(f"- {row['model']}: " + "; ".join(parts) + f". Closing line: `{row['record']['line']}`")
    return lines


def run() -> str:
    rows = measure()
    rec = rows[0]["record"]
    head = [
        "## `edgeq optimize`: the ladder against the plan alone",
        "",
        "`python tools/bench.py --only optimize`. bench_ptq's photo task, 6,000 samples, each architecture trained "
        f"from scratch at 32x32 as in bench_mixed; val n={rec['splits']['val']} chooses each candidate, test "
        f'n={rec["splits"]["test"]} confirms it once. `edgeq.optimize(FP32, data, max_drop_pp=1, target="cpu")`: '
        "PTQ with each range method, the cpu plan's islands, QAT (with the labels the data has), QAT with the plan's "
        "islands, every candidate timed on this CPU with profile's benchmark (1 thread, XNNPACK, median of 50 runs); "
        "a rung ends the ladder when its model is faster than FP32 by over 5% and the upper end of its paired 95% "
        "interval is within 1 pp on val and then on test. The plan alone: its pick from the same search, built by "
        "the conversion it names and judged on the same test samples. Latency: the ladder's pick and FP32's .tflite "
        "timed back to back at the end (the faster of two medians each); the plan's pick against the plan's own FP32 "
        "timing. "
        "Wall: the whole ladder, FP32 training not included. QAT with labels is 3 more epochs of training: on these "
        "FP32 models, trained from scratch for a few epochs, it gains accuracy as well as speed (as in the speed "
        "section); the budget is judged against the FP32 model the user gave.",
        "",
    ]
    return "\n".join(head + table(rows) + [""] + _rungs(rows)) + "\n"


if __name__ == "__main__":
    print(run())
