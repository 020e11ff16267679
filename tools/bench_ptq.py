"""Post-training quantization: the bare TFLite converter vs edgeq's ranges and rounding, for BENCHMARKS.md.

For keras.applications architectures (random weights, BN statistics set from data) and
the zoo's digits-cnn after training: each converted --int8-only by the converter's own
calibration, by `--ptq auto` (whose manifest records every candidate: minmax, percentile,
MSE, entropy scored in the fake-quant model, the best of them converted), by minmax, and
with stochastic and AdaRound weight rounding (the same 64 calibration samples), measured
against the FP32 model on the val split, which calibration never sees (SQNR, top-1
agreement), with the time of each `convert`.

Then a harder trained task, where precisions separate: crops of scikit-learn's two sample
photos labelled by a fixed random CNN (the teacher), learnt by the zoo's resnet8; FP32 vs
int8 test accuracy for the converter and `auto`.
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
    """Moving mean/variance of every BN from one pass over real inputs (as a trained model has);
    a tf_keras or a Keras 3 model."""
    bns = [la for la in model.layers if type(la).__name__ == "BatchNormalization"]
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


def _raw_pixels(data: str, folder: Path, name: str = "raw255.npz") -> str:
    """The same synthetic samples as an npz of 0..255 floats (what EfficientNet's Rescaling expects)."""
    import numpy as np

    from edgeq.data.sources import load_dataset

    d = load_dataset(data)
    path = folder / name
    x = np.concatenate([d.x_train, d.x_val, d.x_test]) * 255.0
    np.savez(path, x=x.astype(np.float32), y=np.concatenate([d.y_train, d.y_val, d.y_test]))
    return f"npz:{path}"


def _models(tmp: Path):
    from edgeq.data.sources import load_dataset
    from edgeq.models.compat import keras

    synthetic = f"synthetic:{SIZE}x{SIZE}x3:10:400"
    for name in os.environ.get("EDGEQ_BENCH_ARCHS", ",".join(ARCHITECTURES)).split(","):
        data = _raw_pixels(synthetic, tmp) if name in RAW_PIXELS else synthetic
        x = load_dataset(data).calibration_samples(64, seed=5)
        keras.utils.set_random_seed(0)  # the same random weights in every run (they moved SQNR by several dB)
        # logits, not softmax: with random weights a softmax is near uniform and hides the error
        model = getattr(keras.applications, name)(
            weights=None, input_shape=(SIZE, SIZE, 3), classes=10, classifier_activation=None, **OPTIONS.get(name, {})
        )
        _set_bn_statistics(model, x)
        path = tmp / f"{name}.keras"
        model.save(path)
        yield name, path, data
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

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

    from edgeq.data.sources import load_dataset
    from edgeq.models.load import load_keras_model

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
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
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


def _auto_from(every: dict, target: float = 10.0) -> dict:
    """The default `--ptq auto` result, read off the `--ptq-target 1000` run.

    auto converts with the converter's ranges first and stops there when they reach the
    target; otherwise it does what the every-candidate run did. Its time is then the
    converter candidate's plus the work around it (loading, verification): the run's time
    less the edgeq part, which begins after the converter candidate.
    """
    candidates = (every.get("ptq") or {}).get("candidates", [])
    first = candidates[0] if candidates else {}
    if first.get("method") != "converter" or first.get("sqnr_db", -1e9) < target:
        return every
    ours = [c for c in candidates[1:] if "seconds" in c]
    return {
        "sqnr_db": first["sqnr_db"],
        "agreement": first["agreement"],
        "seconds": every["seconds"] - sum(c["seconds"] for c in ours),
        "ptq": {"chosen": "converter"},
    }


def adaround_at_224() -> dict:
    """`--rounding adaround` on MobileNetV2 1.0 at 224x224 (the issue's time target), vs one bare conversion."""
    from edgeq.models.compat import keras

    data = "synthetic:224x224x3:10:160"
    with tempfile.TemporaryDirectory() as tmp:
        from edgeq.data.sources import load_dataset

        model = keras.applications.MobileNetV2(weights=None, input_shape=(224, 224, 3), classes=10)
        _set_bn_statistics(model, load_dataset(data).calibration_samples(32, seed=5))
        path = Path(tmp) / "mnv2_224.keras"
        model.save(path)
        out = Path(tmp) / "m.tflite"
        bare = _convert(path, data, out, ptq="converter")
        ada = _convert(path, data, out, ptq="mse", rounding="adaround", seed=0)
    return {"converter": bare, "adaround": ada}


def bare_conversion_seconds(path, data) -> float:
    """One bare TFLiteConverter int8-only conversion (64 representative samples), no verification."""
    from bench_keras import bare_int8_only_seconds

    from edgeq.data.sources import load_dataset
    from edgeq.models.load import load_keras_model

    return bare_int8_only_seconds(load_keras_model(path), load_dataset(data).calibration_samples(64), samples=64)


def measure() -> list[dict]:
    from edgeq.quantize.ranges import ACTIVATION_METHODS

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, data in _models(Path(tmp)):
            out = Path(tmp) / "m.tflite"
            row = {"model": name, "ceiling_db": input_only_ceiling(path, data)}
            row["bare_seconds"] = bare_conversion_seconds(path, data)
            row["converter"] = _convert(path, data, out, ptq="converter")
            row["best"] = best = _convert(path, data, out, ptq="auto", ptq_target_db=1000.0)  # scores them all
            row["auto"] = _auto_from(best)  # what the default (stop at 10 dB) gives
            for c in (best.get("ptq") or {}).get("candidates", []):
                if c["method"] in ACTIVATION_METHODS:
                    row[c["method"]] = c  # every candidate is a conversion measured in LiteRT
            chosen = (best.get("ptq") or {}).get("chosen")
            method = chosen if chosen in ACTIVATION_METHODS else "mse"  # its nearest-rounding result is measured
            row["rounded_by"] = method
            row["nearest"] = row.get(method, {})
            for rounding in ("stochastic", "adaround"):
                row[rounding] = _convert(path, data, out, ptq=method, rounding=rounding, seed=0)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)  # whole rows: a stopped run still has its numbers
    return rows


def teacher_photos(
    folder: Path, n: int = 3000, size: int = 32, classes: int = 10, seed: int = 0, skip: int = 0,
    name: str = "teacher_photos.npz",
) -> str:  # fmt: skip
    """Crops of scikit-learn's two sample photos labelled by a fixed random CNN, as an npz source.

    Random crops (32 to 160 pixels a side, resized to ``size``, flipped half the time) give
    natural-image statistics; the teacher's logits, standardized per class so the classes are
    about equally common, give labels a student can learn but with many samples near a
    decision boundary, where int8's error flips the answer. Nothing is downloaded: the photos
    ship with scikit-learn.

    ``skip``: draw that many crops first and label with their per-class statistics, then keep only
    the ``n`` after them: fresh samples of the same task as ``teacher_photos(n=skip)`` (more held-out data).
    """
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images

    from edgeq.models.compat import keras

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    total = skip + n
    x = np.empty((total, size, size, 3), np.float32)
    for i in range(total):
        photo = photos[i % len(photos)]
        side = int(rng.integers(size, 5 * size + 1))
        r, c = (int(rng.integers(0, dim - side + 1)) for dim in photo.shape[:2])
        crop = Image.fromarray(photo[r : r + side, c : c + side]).resize((size, size), Image.BILINEAR)
        image = np.asarray(crop, np.float32) / 255.0
        x[i] = image[:, ::-1] if rng.random() < 0.5 else image
    keras.utils.set_random_seed(seed)
    teacher = keras.Sequential(
        [
            keras.Input((size, size, 3)),
            keras.layers.Conv2D(32, 5, strides=2, activation="relu"),
            keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(classes),
        ]
    )
    logits = teacher.predict(x - 0.5, batch_size=256, verbose=0)
    stats = logits[:skip] if skip else logits
    y = np.argmax((logits - stats.mean(0)) / (stats.std(0) + 1e-9), axis=1)
    path = folder / name
    np.savez(path, x=x[skip:], y=y[skip:].astype(np.int64))
    return f"npz:{path}"


def harder_trained() -> dict:
    """resnet8 trained on the teacher-labelled photo crops; FP32 vs int8 test accuracy, converter vs auto."""
    from edgeq.evaluate.run import evaluate
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = teacher_photos(tmp)
        run = train(TrainConfig(model="resnet8", data=data, out_dir=str(tmp / "run"), epochs=15, qat_epochs=1))
        result = {"data": "3000 teacher-labelled 32x32 crops of scikit-learn's sample photos, 10 classes"}
        ways = (("converter", {"ptq": "converter"}), ("auto", {}), ("auto, all", {"ptq_target_db": 1000.0}))
        for name, options in ways:
            out = tmp / f"{name.replace(', ', '_')}.tflite"
            converted = _convert(run.fp32_model, data, out, **options)
            if "sqnr_db" not in converted:
                result[name] = converted
                continue
            ev = evaluate(out, run.fp32_model, data, split="test")
            result[name] = converted | {
                "accuracy": ev.value,
                "fp32_value": ev.reference_value,
                "worse_by": ev.worse_by,
                "test_sqnr_db": ev.sqnr_db,
                "test_agreement": ev.agreement,
                "chosen": (converted.get("ptq") or {}).get("chosen"),
            }
        print(json.dumps(result, default=str), flush=True)
    return result


TRAINED_EPOCHS = int(os.environ.get("EDGEQ_BENCH_TRAINED_EPOCHS", "4"))


def trained_architectures() -> list[dict]:
    """The keras.applications architectures trained from scratch (FP32, Adam, TRAINED_EPOCHS
    epochs) on the teacher-labelled photo crops, then converted by the converter, by `auto`
    scoring every candidate, and with AdaRound on the range method auto converted.

    Random-weight networks amplify any input error (see input_only_ceiling); trained ones are
    what users bring, and what published PTQ results are measured on.
    """
    from edgeq.data.sources import load_dataset
    from edgeq.evaluate.run import evaluate
    from edgeq.models.compat import keras
    from edgeq.quantize.ranges import ACTIVATION_METHODS

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        photos = teacher_photos(tmp)
        for name in os.environ.get("EDGEQ_BENCH_ARCHS", ",".join(ARCHITECTURES)).split(","):
            data = _raw_pixels(photos, tmp) if name in RAW_PIXELS else photos
            d = load_dataset(data)
            keras.utils.set_random_seed(0)
            model = getattr(keras.applications, name)(
                weights=None, input_shape=d.x_train.shape[1:], classes=10, classifier_activation=None,
                **OPTIONS.get(name, {}),
            )  # fmt: skip
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=["accuracy"])
            start = time.perf_counter()
            model.fit(d.x_train, d.y_train, epochs=TRAINED_EPOCHS, batch_size=64, verbose=0)
            # A few hundred steps leave BN's moving averages (momentum 0.99) partly at their
            # initial 0 and 1: the network then saturates at inference and outputs a constant
            # (MobileNet: chance accuracy, output std 1e-8). Re-estimated from 512 training
            # samples, as after any short training (PyTorch's "precise BN").
            _set_bn_statistics(model, d.x_train[:512])
            path = tmp / f"{name}.keras"
            model.save(path)
            row = {"model": name, "train_seconds": time.perf_counter() - start}
            row["ceiling_db"] = input_only_ceiling(path, data)
            row["converter"] = _convert(path, data, tmp / "converter.tflite", ptq="converter")
            row["best"] = best = _convert(path, data, tmp / "best.tflite", ptq="auto", ptq_target_db=1000.0)
            row["auto"] = _auto_from(best)
            chosen = (best.get("ptq") or {}).get("chosen")
            method = chosen if chosen in ACTIVATION_METHODS else "minmax"  # AdaRound on the ranges auto chose
            row["rounded_by"] = method
            row["adaround"] = _convert(path, data, tmp / "adaround.tflite", ptq=method, rounding="adaround", seed=0)
            for key in ("converter", "best", "adaround"):
                if "sqnr_db" in row[key]:
                    ev = evaluate(tmp / f"{key}.tflite", path, data, split="test")
                    row[key] |= {"accuracy": ev.value, "fp32_value": ev.reference_value}
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
    return rows


def _nearest_of(row: dict) -> dict:
    """The measured int8 model with the ranges AdaRound used and nearest rounding: auto converted it."""
    for c in (row["best"].get("ptq") or {}).get("candidates", []):
        if c["method"] == row["rounded_by"] and "sqnr_db" in c:
            return c
    return {}


def _trained_table(rows: list[dict]) -> list[str]:
    lines = [
        "### The same architectures, trained",
        "",
        f"Each architecture trained from scratch at 32x32 on the photo task below ({TRAINED_EPOCHS} FP32 epochs, "
        "Adam, BN statistics re-estimated from 512 training samples after), then converted with 64 calibration "
        "samples. Cells: SQNR dB / top-1 agreement against FP32 on the val split, and int8 accuracy on the test "
        "split. `auto, all` converts every range candidate (`--ptq-target 1000`) and keeps the best; "
        "AdaRound rounds the weights with those same ranges, so `nearest` is that same conversion with nearest "
        "rounding. The photos are 8-bit pixels, so the int8 input holds them exactly: no input-only ceiling here.",
        "",
        "| model | FP32 test accuracy | `--ptq converter` | `auto, all` (chosen) | ranges | nearest | "
        "`--rounding adaround` | auto, all - converter | adaround - nearest | train / adaround time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r):
        return f"{_cell(r)} / {r['accuracy']:.1%}" if "accuracy" in r else _cell(r)

    def diff(a, b):
        return a["sqnr_db"] - b["sqnr_db"] if "sqnr_db" in a and "sqnr_db" in b else None

    gains, ada_gains, refused = [], [], []
    for row in rows:
        conv, best, ada, nearest = row["converter"], row["best"], row["adaround"], _nearest_of(row)
        gain, ada_gain = diff(best, conv), diff(ada, nearest)
        gains += [gain] if gain is not None else []
        ada_gains += [ada_gain] if ada_gain is not None else []
        if "sqnr_db" not in row["auto"] or row["auto"]["sqnr_db"] < 10.0:
            refused.append(row["model"])
        lines.append(
            f"| {row['model']} | {conv.get('fp32_value', float('nan')):.1%} | {cell(conv)} | "
            f"{cell(best)} ({(best.get('ptq') or {}).get('chosen', '?')}) | {row['rounded_by']} | "
            f"{_cell(nearest)} | {cell(ada)} | "
            + (f"{gain:+.1f} dB | " if gain is not None else "- | ")
            + (f"{ada_gain:+.1f} dB | " if ada_gain is not None else "- | ")
            + f"{row['train_seconds']:.0f}s / {ada.get('seconds', 0):.0f}s |"
        )
    if gains:
        lines += [
            "",
            f"Over the converter: `auto, all` median {statistics.median(gains):+.1f} dB (min {min(gains):+.1f}). "
            f"AdaRound over nearest rounding with the same ranges: median {statistics.median(ada_gains):+.1f} dB "
            f"(min {min(ada_gains):+.1f}, max {max(ada_gains):+.1f}). "
            f"Below 10 dB with `auto`: {', '.join(refused) or 'none'}.",
        ]
    return lines


def _cell(r: dict, seconds=False) -> str:
    if "sqnr_db" not in r:
        return "failed" if r else "-"
    text = f"{r['sqnr_db']:.1f} / {r['agreement']:.0%}"
    return text + (f" / {r['seconds']:.0f}s" if seconds else "")


def run() -> str:
    rows = measure()
    hard = harder_trained() if os.environ.get("EDGEQ_BENCH_HARD", "1") == "1" else None
    big = adaround_at_224() if os.environ.get("EDGEQ_BENCH_ADAROUND224", "1") == "1" else None
    trained = trained_architectures() if os.environ.get("EDGEQ_BENCH_TRAINED", "1") == "1" else None
    lines = [
        "## Post-training quantization: the converter's ranges vs edgeq's",
        "",
        f"`python tools/bench.py --only ptq`: `edgeq convert --int8-only` with 64 calibration samples (train "
        "split), measured against the FP32 model on the val split, which calibration never sees "
        f"({SIZE}x{SIZE} keras.applications models with logit outputs: random weights, BN statistics set from "
        "one batch of synthetic data; MobileNetV3Small without its Rescaling, EfficientNetB0 given 0..255 pixels; "
        "digits-cnn: trained on real digits). Cells: SQNR dB / top-1 agreement. minmax, percentile, mse and "
        "entropy are `auto`'s candidates as its manifest records them, each a conversion measured in LiteRT "
        "(the converter's calibration with every min/max re-chosen by the method). `auto, all` is `--ptq-target "
        "1000`, which converts every candidate; the default `auto` keeps the converter's ranges when they reach "
        "10 dB, and is "
        "read off the same run. Times are whole `edgeq convert` runs (loading and verification included) over one "
        "bare `TFLiteConverter` int8-only conversion of the same model and 64 samples.",
        "",
        "| model | FP32, only the input on the int8 grid (ceiling) | bare conversion | "
        + " | ".join(f"`--ptq {m}`" for m in RANGES)
        + " | `auto` (chosen) | `auto, all` (chosen) | auto - converter | auto, all - converter | "
        "auto time / bare | auto, all time / bare |",
        "|---|" + "---|" * (len(RANGES) + 8),
    ]
    gains, all_gains, ratios, all_ratios, refused, worse = [], [], [], [], [], []
    for row in rows:
        auto, best, conv = row["auto"], row["best"], row["converter"]
        ok = all("sqnr_db" in r for r in (auto, best, conv))
        if ok:
            gains.append(auto["sqnr_db"] - conv["sqnr_db"])
            all_gains.append(best["sqnr_db"] - conv["sqnr_db"])
            ratios.append(auto["seconds"] / row["bare_seconds"])
            all_ratios.append(best["seconds"] / row["bare_seconds"])
            if gains[-1] < -0.05:  # not the rounding of the manifest's 3 decimals
                worse.append(row["model"])
        if "sqnr_db" not in auto or auto["sqnr_db"] < 10.0:
            refused.append(row["model"])
        lines.append(
            f"| {row['model']} | {row['ceiling_db']:.1f} | {row['bare_seconds']:.1f}s | "
            + " | ".join(_cell(row.get(m, {})) for m in RANGES)
            + f" | {_cell(auto)} ({(auto.get('ptq') or {}).get('chosen', '?')})"
            + f" | {_cell(best)} ({(best.get('ptq') or {}).get('chosen', '?')}) | "
            + (
                f"{gains[-1]:+.1f} dB | {all_gains[-1]:+.1f} dB | {ratios[-1]:.1f}x | {all_ratios[-1]:.1f}x |"
                if ok
                else "- | - | - | - |"
            )
        )
    if gains:
        lines += [
            "",
            f"Over the converter: `auto` median {statistics.median(gains):+.1f} dB (min {min(gains):+.1f}), "
            f"`auto, all` median {statistics.median(all_gains):+.1f} dB (min {min(all_gains):+.1f}). "
            f"Time / one bare conversion: `auto` median {statistics.median(ratios):.1f}x (max {max(ratios):.1f}x), "
            f"`auto, all` median {statistics.median(all_ratios):.1f}x (max {max(all_ratios):.1f}x). "
            f"`auto` below the converter: {', '.join(worse) or 'none'}. "
            f"Below 10 dB with `auto`: {', '.join(refused) or 'none'}.",
        ]
    if trained:
        lines += ["", *_trained_table(trained)]
    if hard:
        lines += [
            "",
            "### A harder trained task",
            "",
            f"{hard['data']} (labels from a fixed random CNN, the teacher), learnt by the zoo's resnet8 "
            "(15 FP32 epochs); test split. `edgeq convert --int8-only` then `edgeq eval`.",
            "",
            "| ranges | chosen | FP32 accuracy | int8 accuracy | drop (pp) | SQNR (test) | agreement | convert time |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in ("converter", "auto", "auto, all"):
            r = hard.get(name, {})
            if "accuracy" not in r:
                lines.append(f"| {name} | failed: {r.get('error', '?')} | | | | | | |")
                continue
            lines.append(
                f"| {name} | {r['chosen'] or '-'} | {r['fp32_value']:.2%} | {r['accuracy']:.2%} | "
                f"{r['worse_by']:.2f} | {r['test_sqnr_db']:.1f} dB | {r['test_agreement']:.1%} | {r['seconds']:.0f}s |"
            )
    lines += [
        "",
        "### Weight rounding (`--rounding`), with the range method that `auto, all` chose",
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
    import sys

    # --trained: only the trained architectures' table (the rest of the section takes an hour more)
    print("\n".join(_trained_table(trained_architectures())) if "--trained" in sys.argv[1:] else run())
