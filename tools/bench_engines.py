"""The two QAT engines on Keras 3 models, for BENCHMARKS.md: TF-MOT (on the tf_keras translation) against
edgeq's Keras 3 engine (``edgeq.quantize.keras3_qat``), each measured on its int8 ``.tflite``.

keras.applications MobileNetV2, MobileNetV3Small and EfficientNetB0, built in Keras 3 (``import keras``),
trained from scratch at 32x32 on bench_ptq's photo task (6,000 samples: train 4,200, val 600, test 1,199),
as bench_mixed trains them. One FP32 model per architecture; both engines fine-tune that same file with
``edgeq train --epochs 0 --qat-epochs N --qat-engine ENGINE`` (keep-best on val), then ``convert --int8-only``.
On the 1,199 test samples: each file's accuracy, the paired bootstrap 95% interval of Keras 3 QAT minus
TF-MOT QAT and of each against the FP32 ``.tflite``; the QAT time per epoch; the float ops left in each
int8 file.

``python tools/bench.py --only engines`` (env EDGEQ_BENCH_ENGINES_ARCHS=..., EDGEQ_BENCH_QAT_EPOCHS=N,
EDGEQ_BENCH_CACHE=DIR keeps the trained FP32 models and each finished row).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ARCHS = os.environ.get("EDGEQ_BENCH_ENGINES_ARCHS", "MobileNetV2,MobileNetV3Small,EfficientNetB0").split(",")
SAMPLES = 6000
QAT_EPOCHS = int(os.environ.get("EDGEQ_BENCH_QAT_EPOCHS", "2"))
ENGINES = ("tfmot", "keras3")
RESAMPLES = 2000


def _fp32_keras3(name: str, data: str, folder: Path) -> Path:
    """The architecture built and trained in Keras 3 itself, as bench_mixed trains it in tf_keras."""
    import keras
    from bench_mixed import _fp32

    return _fp32(name, data, folder, keras=keras, suffix="_keras3")


def _correct(path: Path, x, y):
    from edgeq.runtime.interpreter import TFLiteModel

    return (TFLiteModel(path, use_default_delegates=False).predict(x, batch_size=1).argmax(-1) == y).astype(float)


def _paired(a, b) -> list[float]:
    """95% interval of accuracy(a) - accuracy(b) in pp, over paired resamples of the same test samples."""
    from edgeq.tasks.verdicts import paired_interval

    (low, high), _ = paired_interval(lambda idx: 100 * (a[idx].mean() - b[idx].mean()), len(a), resamples=RESAMPLES)
    return [round(low, 2), round(high, 2)]


def _engine(engine: str, fp32: Path, data: str, folder: Path) -> dict:
    from edgeq.convert.converter import float_ops
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.runtime.interpreter import TFLiteModel
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    out = folder / f"{fp32.stem}_{engine}"
    shutil.rmtree(out, ignore_errors=True)
    config = TrainConfig(model=str(fp32), data=data, out_dir=str(out), epochs=0, qat_epochs=QAT_EPOCHS,
                         batch_size=64, qat_engine=engine)  # fmt: skip
    start = time.perf_counter()
    result = train(config)
    seconds = time.perf_counter() - start
    stage = result.stages[-1]
    path = folder / f"{fp32.stem}_{engine}_int8.tflite"
    convert(result.qat_model, path, ConvertOptions(mode="int8-only", calib=data, min_sqnr_db=-1000.0))
    return {
        "engine": result.qat_engine, "path": str(path), "train_seconds": round(seconds, 1),
        "epoch_seconds": round(stage.seconds / max(stage.epochs, 1), 1),
        "val_accuracy": round(100 * stage.val_value, 2),
        "float_ops": len(float_ops(TFLiteModel(path))), "size_kib": round(path.stat().st_size / 1024, 1),
    }  # fmt: skip


def measure_arch(name: str, photos: str, raw: str, folder: Path) -> dict:
    from bench_ptq import RAW_PIXELS

    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.data.sources import load_dataset

    data = raw if name in RAW_PIXELS else photos
    cache = Path(os.environ.get("EDGEQ_BENCH_CACHE") or folder)
    cache.mkdir(parents=True, exist_ok=True)
    saved = cache / f"{name}_engines_row.json"
    if saved.exists():
        return json.loads(saved.read_text())
    start = time.perf_counter()
    fp32 = _fp32_keras3(name, data, cache)
    row = {"model": name, "fp32_train_seconds": round(time.perf_counter() - start, 1)}
    fp32_tflite = folder / f"{name}_fp32.tflite"
    convert(fp32, fp32_tflite, ConvertOptions(mode="fp32"))
    d = load_dataset(data)
    x, y = d.split("test")
    y = y.reshape(-1)
    correct = {"fp32": _correct(fp32_tflite, x, y)}
    row["samples"] = len(y)
    row["fp32_accuracy"] = round(100 * correct["fp32"].mean(), 2)
    for engine in ENGINES:
        r = _engine(engine, fp32, data, folder)
        correct[engine] = _correct(Path(r["path"]), x, y)
        r["accuracy"] = round(100 * correct[engine].mean(), 2)
        r["vs_fp32"] = _paired(correct[engine], correct["fp32"])
        row[engine] = r
        print(name, engine, json.dumps(r), flush=True)
    row["keras3_minus_tfmot"] = round(row["keras3"]["accuracy"] - row["tfmot"]["accuracy"], 2)
    row["keras3_minus_tfmot_interval95"] = _paired(correct["keras3"], correct["tfmot"])
    saved.write_text(json.dumps(row))
    return row


def measure() -> list[dict]:
    from bench_ptq import _raw_pixels, teacher_photos

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        photos = teacher_photos(tmp, n=SAMPLES)
        raw = _raw_pixels(photos, tmp)
        for name in ARCHS:
            rows.append(measure_arch(name, photos, raw, tmp))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _verdict(low: float, high: float) -> str:
    if low <= 0.0 <= high:
        return "within noise"
    return "Keras 3 better" if low > 0 else "TF-MOT better"


def _cell(engine: dict, row: dict) -> str:
    change = engine["accuracy"] - row["fp32_accuracy"]
    low, high = engine["vs_fp32"]
    return f"{engine['accuracy']:.2f}% ({change:+.2f}, {low:+.2f}..{high:+.2f})"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | FP32 | TF-MOT QAT int8 (vs FP32, 95% CI) | Keras 3 QAT int8 (vs FP32, 95% CI) | "
        "Keras 3 - TF-MOT (95% CI) | QAT s/epoch TF-MOT / Keras 3 | float ops | KiB TF-MOT / Keras 3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, k = r["tfmot"], r["keras3"]
        low, high = r["keras3_minus_tfmot_interval95"]

        lines.append(
            f"| {r['model']} | {r['fp32_accuracy']:.2f}% | {_cell(t, r)} | {_cell(k, r)} | "
            f"{r['keras3_minus_tfmot']:+.2f} pp "
            f"({low:+.2f}..{high:+.2f}, {_verdict(low, high)}) | {t['epoch_seconds']} / {k['epoch_seconds']} | "
            f"{t['float_ops']} / {k['float_ops']} | {t['size_kib']} / {k['size_kib']} |"
        )
    return lines


def run() -> str:
    rows = measure()
    from bench_ptq import TRAINED_EPOCHS

    n = rows[0]["samples"] if rows else 0
    lines = [
        "## QAT engines on Keras 3 models: TF-MOT (tf_keras translation) vs edgeq's Keras 3 engine",
        "",
        f"`python tools/bench.py --only engines`. keras.applications models built in Keras 3, trained from scratch "
        f"at 32x32 for {TRAINED_EPOCHS} epochs on bench_ptq's photo task ({SAMPLES} samples; EfficientNetB0 on "
        f"0..255 pixels, as its own Rescaling expects). Each engine fine-tunes the same FP32 file for {QAT_EPOCHS} "
        "QAT epochs (batch 64, keep-best on val), then `convert --int8-only`. Accuracy of each `.tflite` on the "
        f"{n} test samples; intervals are paired bootstrap 95% intervals ({RESAMPLES} resamples) of the "
        "difference in pp. s/epoch: the QAT stage's wall time over its epochs (tracing included).",
        "",
        *table(rows),
        "",
        "Both engines gain over FP32 because the FP32 models are short of converged and QAT is more epochs of "
        "training; the comparison that counts is the paired Keras 3 - TF-MOT column. The Keras 3 engine's epochs "
        "are slower here: its fake quantization runs as ops of the Keras 3 graph, where TF-MOT's wrappers are "
        "tf_keras layers.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
