"""Post-training quantization: the bare TFLite converter vs edgeq's ranges and rounding, for BENCHMARKS.md.

For keras.applications architectures (random weights, BN statistics set from data) and
the zoo's digits-cnn after training: each converted --int8-only by the converter's own
calibration, by `--ptq auto` (whose manifest records every candidate: percentile, MSE,
entropy), by minmax, and with stochastic and AdaRound weight rounding (the same 64
calibration samples), measured against the FP32 model on the val split, which
calibration never sees (SQNR, top-1 agreement), with the time of each `convert`.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SIZE = int(os.environ.get("EDGEQ_BENCH_SIZE", "64"))
ARCHITECTURES = ("MobileNet", "MobileNetV2", "MobileNetV3Small", "EfficientNetB0", "ResNet50", "DenseNet121")
RANGES = ("converter", "minmax", "percentile", "mse", "entropy")


def _set_bn_statistics(model, x) -> None:
    """Moving mean/variance of every BN from one pass over real inputs (as a trained model has)."""
    from edgeq.compat import keras

    bns = [la for la in model.layers if isinstance(la, keras.layers.BatchNormalization)]
    saved = [bn.momentum for bn in bns]
    for bn in bns:
        bn.momentum = 0.0
    model(x, training=True)
    for bn, momentum in zip(bns, saved):
        bn.momentum = momentum


# Models that rescale raw pixels themselves get the input they expect: MobileNetV3 is built
# without its Rescaling, EfficientNet (which has no switch) gets 0..255 data. [0, 1] data into
# a Rescaling(1/255) leaves int8 two or three levels of the image (edgeq convert now says so).
OPTIONS = {"MobileNetV3Small": {"include_preprocessing": False}}
RAW_PIXELS = {"EfficientNetB0"}


def _raw_pixels(data: str, folder: Path) -> str:
    """The same synthetic samples as an npz of 0..255 floats (what EfficientNet's Rescaling expects)."""
    import numpy as np

    from edgeq.data import load_dataset

    d = load_dataset(data)
    path = folder / "raw255.npz"
    x = np.concatenate([d.x_train, d.x_val, d.x_test]) * 255.0
    np.savez(path, x=x.astype(np.float32), y=np.concatenate([d.y_train, d.y_val, d.y_test]))
    return f"npz:{path}"


def _models(tmp: Path):
    from edgeq.compat import keras
    from edgeq.data import load_dataset

    synthetic = f"synthetic:{SIZE}x{SIZE}x3:10:400"
    for name in os.environ.get("EDGEQ_BENCH_ARCHS", ",".join(ARCHITECTURES)).split(","):
        data = _raw_pixels(synthetic, tmp) if name in RAW_PIXELS else synthetic
        x = load_dataset(data).calibration_samples(64, seed=5)
        # logits, not softmax: with random weights a softmax is near uniform and hides the error
        model = getattr(keras.applications, name)(
            weights=None, input_shape=(SIZE, SIZE, 3), classes=10, classifier_activation=None, **OPTIONS.get(name, {})
        )
        _set_bn_statistics(model, x)
        path = tmp / f"{name}.keras"
        model.save(path)
        yield name, path, data
    from edgeq.train.fit import TrainConfig, train

    run = train(TrainConfig(model="digits-cnn", data="digits", out_dir=str(tmp / "digits")))
    yield "digits-cnn (trained)", run.fp32_model, "digits"


def input_only_ceiling(path, data) -> float:
    """SQNR (dB) of the FP32 model when only its input is put on an int8 grid (as an int8-only
    model's input is, from the same 64 calibration samples' range), on the val split.

    No int8 model can do better than this: it is how much the float network itself amplifies
    the one quantization every integer-only model has. Random-weight networks with BN set from
    data amplify it a lot (they are chaotic), trained ones little.
    """
    import numpy as np

    from edgeq.data import load_dataset
    from edgeq.model_io import load_keras_model

    dataset = load_dataset(data)
    calib = dataset.calibration_samples(64)
    lo, hi = min(float(calib.min()), 0.0), max(float(calib.max()), 0.0)
    scale = (hi - lo) / 255.0
    zero_point = np.round(-128 - lo / scale)
    x = dataset.x_val
    on_grid = (np.clip(np.rint(x / scale) + zero_point, -128, 127) - zero_point) * scale
    model = load_keras_model(path)
    clean = np.asarray(model.predict(x, verbose=0), dtype=np.float64)
    noisy = np.asarray(model.predict(on_grid.astype(np.float32), verbose=0), dtype=np.float64)
    return float(10 * np.log10(np.sum(clean**2) / max(np.sum((clean - noisy) ** 2), 1e-30)))


def _convert(path, data, out, **options) -> dict:
    from edgeq.convert import ConvertOptions, convert
    from edgeq.errors import EdgeqError

    start = time.perf_counter()
    try:
        # no verification threshold here: every method's SQNR is measured, and the table says
        # which would pass edgeq's default 10 dB
        options = {"min_sqnr_db": -100.0, **options}
        result = convert(path, out, ConvertOptions(mode="int8-only", calib=data, calib_samples=64, **options))
    except EdgeqError as exc:
        return {"error": str(exc)[:160], "seconds": time.perf_counter() - start}
    v = result.verification
    manifest = json.loads(Path(result.manifest).read_text())
    return {
        "sqnr_db": v.sqnr_db,
        "agreement": v.agreement,
        "integer_only": v.integer_only,
        "seconds": time.perf_counter() - start,
        "ptq": manifest.get("ptq"),
    }


def _auto_from(best: dict, target: float = 10.0) -> dict:
    """The default `--ptq auto` result, read off the every-candidate run.

    auto tries the same candidates in the same order and stops at the first that reaches
    the target; its time is theirs plus the work around them (loading, verification),
    taken as the every-candidate run's time less the candidates it would not have tried.
    """
    candidates = [c for c in (best.get("ptq") or {}).get("candidates", []) if "sqnr_db" in c]
    if not candidates:
        return {}
    tried = []
    for c in candidates:
        tried.append(c)
        if c["sqnr_db"] >= target:
            break
    chosen = max(tried, key=lambda c: c["sqnr_db"])
    skipped = sum(c["seconds"] for c in candidates[len(tried) :])
    return {
        "sqnr_db": chosen["sqnr_db"],
        "agreement": chosen["agreement"],
        "seconds": best["seconds"] - skipped,
        "ptq": {"chosen": chosen["method"]},
    }


def adaround_at_224() -> dict:
    """`--rounding adaround` on MobileNetV2 1.0 at 224x224 (the issue's time target), vs one bare conversion."""
    from edgeq.compat import keras

    data = "synthetic:224x224x3:10:160"
    with tempfile.TemporaryDirectory() as tmp:
        from edgeq.data import load_dataset

        model = keras.applications.MobileNetV2(weights=None, input_shape=(224, 224, 3), classes=10)
        _set_bn_statistics(model, load_dataset(data).calibration_samples(32, seed=5))
        path = Path(tmp) / "mnv2_224.keras"
        model.save(path)
        out = Path(tmp) / "m.tflite"
        bare = _convert(path, data, out, ptq="converter")
        ada = _convert(path, data, out, ptq="mse", rounding="adaround", seed=0)
    return {"converter": bare, "adaround": ada}


def measure() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, data in _models(Path(tmp)):
            out = Path(tmp) / "m.tflite"
            row = {"model": name, "ceiling_db": input_only_ceiling(path, data)}
            row["converter"] = _convert(path, data, out, ptq="converter")
            row["minmax"] = _convert(path, data, out, ptq="minmax")
            row["best"] = best = _convert(path, data, out, ptq="auto", ptq_target_db=1000.0)  # tries them all
            row["auto"] = _auto_from(best)  # what the default (stop at 10 dB) gives: its first passing candidate
            for c in (best.get("ptq") or {}).get("candidates", []):
                if c["method"] in ("percentile", "mse", "entropy"):
                    row[c["method"]] = c
            chosen = (best.get("ptq") or {}).get("chosen", "mse")
            method = chosen if chosen != "converter" else "mse"
            row["rounded_by"] = method
            row["nearest"] = row.get(method, {})
            for rounding in ("stochastic", "adaround"):
                row[rounding] = _convert(path, data, out, ptq=method, rounding=rounding, seed=0)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)  # whole rows: a stopped run still has its numbers
    return rows


def _cell(r: dict, seconds=False) -> str:
    if "sqnr_db" not in r:
        return "failed" if r else "-"
    text = f"{r['sqnr_db']:.1f} / {r['agreement']:.0%}"
    return text + (f" / {r['seconds']:.0f}s" if seconds else "")


def run() -> str:
    rows = measure()
    big = adaround_at_224() if os.environ.get("EDGEQ_BENCH_ADAROUND224", "1") == "1" else None
    lines = [
        "## Post-training quantization: the converter's ranges vs edgeq's",
        "",
        f"`python tools/bench.py --only ptq`: `edgeq convert --int8-only` with 64 calibration samples (train "
        "split), measured against the FP32 model on the val split, which calibration never sees "
        f"({SIZE}x{SIZE} keras.applications models with logit outputs: random weights, BN statistics set from "
        "one batch of synthetic data; MobileNetV3Small without its Rescaling, EfficientNetB0 given 0..255 pixels; "
        "digits-cnn: trained on real digits). Cells: SQNR dB / top-1 agreement; "
        "percentile, mse and entropy are `auto`'s candidates as its manifest records them; time is the whole `edgeq "
        "convert` (verification included). `auto` stops at the first candidate that passes verification "
        "(10 dB), read off the `auto, all` run (`--ptq-target 1000`, which tries every candidate and keeps the best): "
        "the candidates it would have tried, and that run's time less the candidates it would have skipped.",
        "",
        "| model | FP32, only the input on the int8 grid (ceiling) | "
        + " | ".join(f"`--ptq {m}`" for m in RANGES)
        + " | `auto` (chosen) | `auto, all` (chosen) | "
        "auto, all - converter | auto time / converter time | auto, all time / converter time |",
        "|---|" + "---|" * (len(RANGES) + 6),
    ]
    gains, ratios, all_ratios, refused = [], [], [], []
    for row in rows:
        auto, best, bare = row["auto"], row["best"], row["converter"]
        ok = all("sqnr_db" in r for r in (auto, best, bare))
        if ok:
            gains.append(best["sqnr_db"] - bare["sqnr_db"])
            ratios.append(auto["seconds"] / bare["seconds"])
            all_ratios.append(best["seconds"] / bare["seconds"])
        if "sqnr_db" not in auto or auto["sqnr_db"] < 10.0:
            refused.append(row["model"])
        lines.append(
            f"| {row['model']} | {row['ceiling_db']:.1f} | "
            + " | ".join(_cell(row.get(m, {})) for m in RANGES)
            + f" | {_cell(auto)} ({(auto.get('ptq') or {}).get('chosen', '?')})"
            + f" | {_cell(best)} ({(best.get('ptq') or {}).get('chosen', '?')}) | "
            + (f"{gains[-1]:+.1f} dB | {ratios[-1]:.1f}x | {all_ratios[-1]:.1f}x |" if ok else "- | - | - |")
        )
    if gains:
        lines += [
            "",
            f"`auto, all` over the converter: median {statistics.median(gains):+.1f} dB (min {min(gains):+.1f}). "
            f"Time / one bare conversion: `auto` median {statistics.median(ratios):.1f}x (max {max(ratios):.1f}x), "
            f"`auto, all` median {statistics.median(all_ratios):.1f}x (max {max(all_ratios):.1f}x). "
            f"Below 10 dB with `auto`: {', '.join(refused) or 'none'}.",
        ]
    lines += [
        "",
        "### Weight rounding (`--rounding`), with the range method `auto` chose (mse where it chose the converter)",
        "",
        "| model | ranges | nearest | stochastic (seed 0) | adaround | adaround time |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ada = row["adaround"]
        lines.append(
            f"| {row['model']} | {row['rounded_by']} | {_cell(row['nearest'])} | {_cell(row['stochastic'])} | "
            f"{_cell(ada)} | {ada.get('seconds', 0):.0f}s |"
        )
    if big:
        bare, ada = big["converter"], big["adaround"]
        lines += [
            "",
            f"MobileNetV2 1.0 at 224x224 (64 calibration samples): `--ptq mse --rounding adaround` took "
            f"{ada.get('seconds', float('nan')) / 60:.1f} min ({_cell(ada)}), one bare conversion "
            f"{bare.get('seconds', float('nan')):.0f} s ({_cell(bare)}); target: at most 10 min on 2 cores.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
