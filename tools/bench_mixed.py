"""Where int8 hurts, for BENCHMARKS.md: converter PTQ, mixed int8/int16 PTQ from a plan, QAT with
labels and by distillation, and W4A8 with nearest vs AdaRound rounding, on trained architectures.

The photo task is bench_ptq's (crops of scikit-learn's two sample photos labelled by a fixed
random CNN), 6,000 samples, so the test split holds 1,200. Each architecture is trained from
scratch at 32x32 as bench_ptq trains it; every quantized model is then scored on the test split
against the FP32 model on the same samples: accuracy, the paired difference with a bootstrap 95%
interval (edgeq.tasks.verdicts.paired_interval, 1,000 resamples), size, single-thread latency
on this CPU (edgeq's profile, LiteRT), and for the mixed model the share of ops at 16-bit.

`python tools/bench.py --only mixed` (EDGEQ_BENCH_MIXED_ARCHS=EfficientNetB0,... to choose).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ARCHS = os.environ.get("EDGEQ_BENCH_MIXED_ARCHS", "EfficientNetB0,MobileNetV2,MobileNetV3Small").split(",")
SAMPLES = 6000
PLAN_BUDGET_PP = 0.5
QAT_EPOCHS = 3
RESAMPLES = 1000
# EDGEQ_BENCH_MIXED_STEPS=mixed,w4_adaround re-measures those steps only, reusing the rest of
# each row from EDGEQ_BENCH_CACHE (where every row is saved); all steps by default
STEPS = ("ptq", "mixed", "qat", "qat_distill", "w4_nearest", "w4_adaround")


def _fp32(name: str, data: str, folder: Path, keras=None, suffix: str = "") -> Path:
    """The architecture trained from scratch (logits), BN statistics from real inputs; in tf_keras, or in the
    Keras module given (bench_engines builds it in Keras 3)."""
    from bench_ptq import OPTIONS, TRAINED_EPOCHS, _set_bn_statistics

    from edgeq.data.sources import load_dataset

    if keras is None:
        from edgeq.models.compat import keras
    path = folder / f"{name}{suffix}.keras"
    if path.exists():  # EDGEQ_BENCH_CACHE kept it from an earlier run
        return path
    d = load_dataset(data)
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(
        weights=None, input_shape=d.x_train.shape[1:], classes=10, classifier_activation=None, **OPTIONS.get(name, {})
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=["accuracy"])
    model.fit(d.x_train, d.y_train, epochs=TRAINED_EPOCHS, batch_size=64, verbose=0)
    _set_bn_statistics(model, d.x_train[:512])
    model.save(path)
    return path


def _score(path: Path, fp32_correct, x, y, fp32_ms: float | None = None) -> dict:

    from edgeq.profile.run import profile_model
    from edgeq.runtime.flatbuffer import op_summary, read_tflite
    from edgeq.runtime.interpreter import TFLiteModel
    from edgeq.tasks.verdicts import paired_interval

    correct = (TFLiteModel(path, use_default_delegates=False).predict(x, batch_size=1).argmax(-1) == y).astype(float)
    (low, high), _ = paired_interval(
        lambda idx: 100 * (correct[idx].mean() - fp32_correct[idx].mean()), len(correct), resamples=RESAMPLES
    )
    ops = op_summary(read_tflite(path))
    run = profile_model(path, runs=100, warmup=10, progress=False).model.runs[0]
    return {
        "accuracy": round(100 * correct.mean(), 2),
        "worse_by": round(100 * (fp32_correct.mean() - correct.mean()), 2),
        "interval95": [round(-high, 2), round(-low, 2)],  # of the drop
        "size_kib": round(path.stat().st_size / 1024, 1),
        "latency_ms": run.latency.median_ms,
        "int16_share": ops.int16_share,
        "int16_ops": ops.int16_ops,
        "ops": ops.total,
    }


def measure_arch(name: str, photos: str, raw: str, folder: Path) -> dict:
    from bench_ptq import RAW_PIXELS

    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import load_keras_model
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    data = raw if name in RAW_PIXELS else photos
    d = load_dataset(data)
    x, y = d.split("test")
    cache = Path(os.environ.get("EDGEQ_BENCH_CACHE") or folder)
    cache.mkdir(parents=True, exist_ok=True)
    saved = cache / f"{name}_row.json"
    row: dict = json.loads(saved.read_text()) if saved.exists() else {}
    row |= {"model": name, "test_samples": len(y)}
    steps = [s for s in os.environ.get("EDGEQ_BENCH_MIXED_STEPS", ",".join(STEPS)).split(",") if s]
    start = time.perf_counter()
    fp32 = _fp32(name, data, cache)
    row.setdefault("train_seconds", round(time.perf_counter() - start, 1))
    fp32_correct = (load_keras_model(fp32).predict(x, batch_size=128, verbose=0).argmax(-1) == y).astype(float)
    row["fp32_value"] = round(100 * fp32_correct.mean(), 2)
    loose = {"min_sqnr_db": -1000.0}  # measured here, not gated: a W4A8 model below the default threshold is a row

    def converted(key: str, source, **options) -> None:
        out = folder / f"{name}_{key}.tflite"
        start = time.perf_counter()
        try:
            convert(source, out, ConvertOptions(mode="int8-only", calib=data, **(loose | options)))
        except Exception as exc:  # a row says what failed; the others still run
            row[key] = {"error": str(exc).splitlines()[0][:200]}
            print(name, key, "failed:", row[key]["error"], flush=True)
            return
        row[key] = _score(out, fp32_correct, x, y) | {"seconds": round(time.perf_counter() - start, 1)}
        print(name, key, json.dumps(row[key]), flush=True)

    if "ptq" in steps:
        converted("ptq", fp32, ptq="converter")
    if "mixed" in steps:
        _mixed(name, fp32, data, folder, row, converted)
    for key, distill in (("qat", False), ("qat_distill", True)):
        if key not in steps:
            continue
        start = time.perf_counter()
        out_dir = str(folder / f"{name}_{key}")
        run = train(
            TrainConfig(model=str(fp32), data=data, out_dir=out_dir, epochs=0, qat_epochs=QAT_EPOCHS, distill=distill)
        )
        seconds = round(time.perf_counter() - start, 1)
        converted(key, run.qat_model)
        row[key]["train_seconds"] = seconds
    for rounding in ("nearest", "adaround"):
        if f"w4_{rounding}" in steps:
            converted(f"w4_{rounding}", fp32, weight_bits=4, rounding=rounding, ptq="minmax")
    saved.write_text(json.dumps(row))
    return row


def _mixed(name, fp32, data, folder, row, converted) -> None:
    from edgeq.analyze.plan import make_plan

    start = time.perf_counter()
    plan = make_plan(fp32, data, PLAN_BUDGET_PP, folder / f"{name}_plan.json", samples=200, fallback="int16")
    row["plan"] = {
        "met": plan.met,
        "wide_layers": len(plan.best.wide_layers),
        "val_drop_pp": plan.best.worse_by,
        "measured": len(plan.frontier),
        "seconds": round(time.perf_counter() - start, 1),
    }
    converted("mixed", fp32, plan=str(plan.path))


def measure(archs=None, per_arch=None) -> list[dict]:
    """``per_arch(name, photos, raw, folder)`` (this module's measure_arch by default) for each of ``archs``,
    on the photo task written once into a scratch folder."""
    from bench_ptq import _raw_pixels, teacher_photos

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        photos = teacher_photos(tmp, n=SAMPLES)
        raw = _raw_pixels(photos, tmp)
        for name in archs or ARCHS:
            row = (per_arch or measure_arch)(name, photos, raw, tmp)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _cell(r: dict) -> str:
    if "error" in r:
        return f"failed: {r['error'][:60]}"
    low, high = r["interval95"]
    return f"{r['accuracy']:.2f}% ({-r['worse_by']:+.2f}, {-high:+.2f}..{-low:+.2f})"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | FP32 | converter PTQ | mixed int8/int16 PTQ (0.5 pp plan) | 16-bit ops | QAT, labels | "
        "QAT, label-free (distilled) | size int8 / mixed KiB | latency int8 / mixed ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mixed = r["mixed"]
        share = f"{mixed['int16_ops']}/{mixed['ops']} ({100 * mixed['int16_share']:.0f}%)" if "ops" in mixed else "-"
        lines.append(
            f"| {r['model']} | {r['fp32_value']:.2f}% | {_cell(r['ptq'])} | {_cell(mixed)} | {share} | "
            f"{_cell(r['qat'])} | {_cell(r['qat_distill'])} | {r['ptq'].get('size_kib', '-')} / "
            f"{mixed.get('size_kib', '-')} | {r['ptq'].get('latency_ms', '-')} / {mixed.get('latency_ms', '-')} |"
        )
    return lines


def w4_table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | FP32 | W4A8 nearest | W4A8 AdaRound | share of nearest's loss AdaRound recovers | size KiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        near, ada = r["w4_nearest"], r["w4_adaround"]
        recovered = "-"
        if "worse_by" in near and "worse_by" in ada and near["worse_by"] > 0:
            recovered = f"{100 * (near['worse_by'] - ada['worse_by']) / near['worse_by']:.0f}%"
        lines.append(
            f"| {r['model']} | {r['fp32_value']:.2f}% | {_cell(near)} | {_cell(ada)} | {recovered} | "
            f"{ada.get('size_kib', '-')} |"
        )
    return lines


def _findings(rows: list[dict]) -> list[str]:
    """The issue's targets, read off the rows: mixed within 1 pp with at most 15% of ops at 16-bit,
    QAT within 0.5 pp, AdaRound recovering at least half of nearest's loss."""
    lines = []
    for r in rows:
        mixed, near, ada = r.get("mixed", {}), r.get("w4_nearest", {}), r.get("w4_adaround", {})
        qats = [r[k]["worse_by"] for k in ("qat", "qat_distill") if "worse_by" in r.get(k, {})]
        parts = []
        if "worse_by" in mixed:
            ok = mixed["worse_by"] <= 1.0 and mixed["int16_share"] <= 0.15
            parts.append(
                f"mixed {-mixed['worse_by']:+.2f} pp vs FP32 with {100 * mixed['int16_share']:.0f}% of ops at 16-bit "
                f"({'met' if ok else 'not met'})"
            )
        if qats:
            parts.append(f"best QAT {-min(qats):+.2f} pp vs FP32 ({'met' if min(qats) <= 0.5 else 'not met'})")
        if "worse_by" in near and "worse_by" in ada and near["worse_by"] > 0:
            share = (near["worse_by"] - ada["worse_by"]) / near["worse_by"]
            parts.append(
                f"AdaRound recovers {100 * share:.0f}% of nearest's W4A8 loss ({'met' if share >= 0.5 else 'not met'})"
            )
        lines.append(f"- {r['model']}: " + "; ".join(parts) + ".")
    return lines


def run() -> str:
    return section(measure())


def section(rows: list[dict]) -> str:
    text = [
        "## Where int8 hurts: mixed int8/int16 PTQ, QAT with and without labels, W4A8",
        "",
        f"`python tools/bench.py --only mixed`. bench_ptq's photo task with {SAMPLES} samples (train 70%, val 10%, "
        f"test 20% = {rows[0]['test_samples'] if rows else '?'} test samples); each architecture trained from scratch "
        "at 32x32 as there. Cells: test accuracy (drop vs FP32 in pp, paired bootstrap 95% interval of the drop over "
        f"{RESAMPLES} resamples of the same test samples). Converter PTQ: `edgeq convert --int8-only --ptq converter`. "
        f"Mixed: `edgeq analyze plan --fallback int16 --max-drop {PLAN_BUDGET_PP}` on the val split, then "
        "`edgeq convert --int8-only --plan`, integer-only, 16-bit ops counted by `edgeq inspect`. QAT: "
        f"`edgeq train FP32.keras --epochs 0 --qat-epochs {QAT_EPOCHS}`, with labels, or `--distill` (the FP32 model's "
        "outputs as targets, no label used). Latency: `edgeq profile`, 1 thread, median of 100 runs, this CPU.",
        "",
        *table(rows),
        "",
        "W4A8: `edgeq convert --int8-only --weight-bits 4 --ptq minmax --rounding nearest|adaround` (per-channel 4-bit "
        "weight codes in [-7, 7], packed two per byte by the converter, int8 activations and kernels).",
        "",
        *w4_table(rows),
        "",
        "Targets (issue: within 1 pp by mixed PTQ with at most 15% of ops at 16-bit; within 0.5 pp by QAT; "
        "AdaRound recovers at least half of nearest's loss):",
        "",
        *_findings(rows),
        "",
        "Reading it. MobileNetV2 and MobileNetV3Small lose nothing measurable to int8 here (the converter's PTQ is "
        "within noise of FP32), so the plan keeps them all-int8. EfficientNetB0 loses 2.75 pp, and 16-bit activations "
        "recover it only when nearly every layer has them: each layer adds a little error (the BENCHMARKS ptq section "
        "follows it down the network), so no 15% of the ops carries the loss, and 16x8 kernels have no XNNPACK path, "
        "which made that model 36x slower on this CPU. QAT with labels is the fix there (its +7.6 pp is also 3 more "
        "epochs of training). Distillation without labels was worse than PTQ on two of three (the 55%-accurate "
        "EfficientNet teacher's soft targets do not pull the student toward the labels). W4A8: AdaRound recovers more "
        "than half of nearest rounding's loss on the two MobileNets, a fifth on EfficientNetB0; packed INT4 weights "
        "also run 4-10x slower than int8 on this CPU (no XNNPACK path for them), so W4A8 buys size, not speed.",
        "",
        "Raw rows: " + "; ".join(f"{r['model']}: plan {json.dumps(r['plan'])}" for r in rows),
        "",
    ]
    return "\n".join(text)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(run())
