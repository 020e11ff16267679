"""Object detection: the zoo detector on the built-in shapes source, FP32 vs int8, judged by COCO mAP.

One table, the same 1,200 test images: FP32 (Keras), converter PTQ, edgeq's ``--ptq auto`` and QAT,
each ``--int8-only``: mAP@0.5, mAP@0.5:0.95 (pycocotools), size, and latency on this CPU (edgeq
profile, 1 thread). The difference to FP32 in mAP@0.5 comes with a paired bootstrap 95% interval
(the images resampled, both models scored on each resample).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DATA = "shapes:96:6000"
BOOTSTRAP = 50


def _bootstrap(decoded: dict, truth, size, classes, seed: int = 0) -> dict:
    from edgeq.tasks.detection import mean_average_precision

    rng = np.random.default_rng(seed)
    boxes, labels = truth
    n = len(boxes)
    diffs = {name: [] for name in decoded if name != "fp32"}
    order = list(diffs)
    same = {b: a for i, a in enumerate(order) for b in order[i + 1 :] if decoded[a] is decoded[b]}
    for _ in range(BOOTSTRAP):
        idx = rng.integers(0, n, n)
        base = mean_average_precision([decoded["fp32"][i] for i in idx], boxes[idx], labels[idx], size, classes)
        for name in diffs:
            if name in same:  # the same .tflite bytes as another row: the same numbers
                diffs[name].append(diffs[same[name]][-1])
                continue
            got = mean_average_precision([decoded[name][i] for i in idx], boxes[idx], labels[idx], size, classes)
            diffs[name].append((got["map50"] - base["map50"]) * 100)
    return {name: tuple(np.percentile(v, [2.5, 97.5])) for name, v in diffs.items()}


def run() -> str:
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import keras_outputs, load_user_model
    from edgeq.profile.run import profile_model
    from edgeq.runtime.interpreter import TFLiteModel
    from edgeq.tasks.detection import DetectionSpec, decode, mean_average_precision
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        result = train(TrainConfig(model="shapes-detector", data=DATA, out_dir=str(tmp / "run")))
        train_s = time.perf_counter() - start
        paths = {"fp32": convert(result.fp32_model, tmp / "fp32.tflite", ConvertOptions(mode="fp32")).path}
        for name, source, ptq in (("converter", result.fp32_model, "converter"), ("auto", result.fp32_model, "auto"),
                                  ("qat", result.qat_model, "auto")):  # fmt: skip
            paths[name] = convert(source, tmp / f"{name}.tflite", ConvertOptions(mode="int8-only", ptq=ptq)).path
        d = load_dataset(DATA)
        x, y = d.split("test")
        truth = (y["gt_boxes"], y["gt_classes"])
        spec = DetectionSpec("boxes", "scores", "centre", d.num_classes)
        size = tuple(d.input_shape[:2])
        decoded = {"fp32": decode(spec, keras_outputs(load_user_model(result.fp32_model), x))}
        for name in ("converter", "auto", "qat"):
            twin = next((k for k in decoded if k != "fp32" and paths[k].read_bytes() == paths[name].read_bytes()), None)
            decoded[name] = decoded[twin] if twin else decode(spec, TFLiteModel(paths[name]).predict_outputs(x))
        scores = {name: mean_average_precision(found, *truth, size, spec.classes) for name, found in decoded.items()}
        print(f"trained in {train_s:.0f} s; scoring", file=sys.stderr, flush=True)
        intervals = _bootstrap(decoded, truth, size, spec.classes)
        latency, sizes = {}, {}
        for name in ("fp32", "converter", "auto", "qat"):
            report = profile_model(paths[name], runs=200, warmup=20, progress=False)
            latency[name] = report.model.runs[0].latency.median_ms
            sizes[name] = paths[name].stat().st_size
    rows = [
        "## Object detection: the zoo detector on `shapes`, FP32 vs int8 (COCO mAP, pycocotools)",
        "",
        f"`tools/bench_detection.py`: `edgeq train shapes-detector --data {DATA}` (MobileNetV2-0.35 to stride 8 + "
        f"centre head, 96x96; 30 FP32 + 4 QAT epochs, {train_s / 60:.1f} min on this machine), then "
        "`edgeq convert --int8-only` of the FP32 model (`--ptq converter`, `--ptq auto`) and of the QAT model. "
        f"The same {len(x)} test images ({int((truth[1] >= 0).sum())} objects) for every row; decoding and NMS "
        "in edgeq (score >= 0.05, IoU 0.5, top 100). Latency: `edgeq profile`, 1 thread, median of 200 (the FP32 "
        f"row is its FP32 .tflite). Interval: paired bootstrap over the images, {BOOTSTRAP} resamples.",
        "",
        "| model | mAP@0.5 | mAP@0.5 - FP32, points (95% CI) | mAP@0.5:0.95 | size | latency ms |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "fp32": "FP32 (Keras; .tflite for size/latency)",
        "converter": "int8-only, converter PTQ",
        "auto": "int8-only, `--ptq auto` (a model with two outputs: the converter's ranges)",
        "qat": "int8-only, QAT (4 epochs)",
    }
    for name in ("fp32", "converter", "auto", "qat"):
        s = scores[name]
        diff = ""
        if name != "fp32":
            low, high = intervals[name]
            diff = f"{(s['map50'] - scores['fp32']['map50']) * 100:+.2f} ({low:+.2f}, {high:+.2f})"
        size_kib = sizes[name] / 1024
        rows.append(f"| {labels[name]} | {s['map50']:.4f} | {diff} | {s['map']:.4f} | {size_kib:.1f} KiB | "
                    f"{latency[name]:.3f} |")  # fmt: skip
    rows += ["", "Target: the QAT int8 model within 1.0 mAP@0.5 point of FP32."]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(run())
