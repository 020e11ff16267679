"""Pretrained float .tflite models no one here wrote, from the CLI: FP32 vs int8-only.

The models ship inside the mediapipe 0.10.14 wheel (float16 weights, no signature, the 2020 schema):
``make pretrained`` downloads the wheel once (``pip download --no-deps``) into .cache/pretrained;
nothing is fetched while this runs. Each model goes through what a user types:
``edgeq convert X.tflite --int8-only --calib ... --input-range ...`` (with ``--task FILE`` for the
detector's SSD layout), ``edgeq eval`` against the float file, ``edgeq profile`` of both.

- MediaPipe's short-range face detector (SSD: 896 anchors, 128x128, inputs in [-1, 1]) on the
  ``faces:128:5000`` source (a real face pasted on real photos, exact boxes): mAP@0.5 and
  mAP@0.5:0.95 (pycocotools) on the 1,000 test images, the change with a paired bootstrap 95%
  interval over images (eval's verdict, 1,000 resamples); also with --ptq mse and --int16x8.
- MediaPipe's face landmark model (468 3-D landmarks in 192x192 pixels, inputs in [0, 1]) on face
  crops of the same source: no labels, so its int8 error against the float file, in pixels.

Latency: edgeq profile, 1 thread, XNNPACK, median of 50 runs after 5, on this CPU. About 4 minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".cache" / "pretrained"
VERSION = "0.10.14"
DETECTOR = "mediapipe/modules/face_detection/face_detection_short_range.tflite"
LANDMARKS = "mediapipe/modules/face_landmark/face_landmark.tflite"
FACES = "faces:128:5000"
CROPS = "faces:256:7000"
FACE_TASK = {
    "detection": {
        "layout": "ssd",
        "boxes": "regressors",
        "scores": "classificators",
        "classes": 1,
        "class_names": ["face"],
        # MediaPipe's face_detection_short_range graph: SsdAnchorsCalculator and TensorsToDetectionsCalculator options
        "anchors": {
            "input_size": 128,
            "num_layers": 4,
            "min_scale": 0.1484375,
            "max_scale": 0.75,
            "strides": [8, 16, 16, 16],
            "aspect_ratios": [1.0],
            "interpolated_scale_aspect_ratio": 1.0,
            "anchor_offset": 0.5,
            "fixed_anchor_size": True,
        },
        "coder": {"order": "xywh", "scales": [128, 128, 128, 128], "exponential": False, "score": "sigmoid"},
    }
}


def _edgeq(*args, refused_ok: bool = False) -> str:
    """One edgeq command as a user runs it; what it printed (it must succeed, unless ``refused_ok``:
    then its one-line error)."""
    done = subprocess.run(
        [sys.executable, "-m", "edgeq", *map(str, args)], capture_output=True, text=True, cwd=ROOT, check=False
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    if refused_ok and done.returncode != 0 and errors:
        return errors[0]
    if done.returncode not in (0, 4):  # 4: a --max-drop gate that failed, which the table reports
        raise SystemExit(f"edgeq {' '.join(map(str, args))} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _models(folder: Path) -> dict[str, Path]:
    wheels = sorted(WHEELS.glob(f"mediapipe-{VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"no mediapipe {VERSION} wheel in {WHEELS}: run `make pretrained` first")
    found = {}
    with zipfile.ZipFile(wheels[0]) as wheel:
        for member in (DETECTOR, LANDMARKS):
            path = folder / Path(member).name
            path.write_bytes(wheel.read(member))
            found[path.stem] = path
    return found


def _latency(model: Path, folder: Path) -> float:
    out = folder / f"{model.stem}.profile.json"
    _edgeq("profile", model, "--threads", "1", "--runs", "50", "--warmup", "5", "--json", out)
    return float(json.loads(out.read_text())["model"]["runs"][0]["latency"]["median_ms"])


def _detector(model: Path, folder: Path) -> list[str]:
    task = folder / "face_task.json"
    task.write_text(json.dumps(FACE_TASK))
    rows = []
    fp32_ms = _latency(model, folder)
    variants = (("int8-only, edgeq min/max ranges", ["--int8-only"]), ("int8-only, --ptq mse", ["--int8-only",
                "--ptq", "mse"]), ("int16x8 (16-bit activations)", ["--int16x8"]))  # fmt: skip
    first = None
    for label, flags in variants:
        out = folder / f"face_{len(rows)}.tflite"
        _edgeq("convert", model, *flags, "--calib", FACES, "--input-range", "-1:1", "--task", task, "--out", out)
        record = folder / f"face_{len(rows)}.eval.json"
        _edgeq("eval", out, "--reference", model, "--data", FACES, "--task", task, "--max-drop", "1", "--json", record)
        d = json.loads(record.read_text())["detection"]
        low, high = d["verdict"]["interval95"]
        first = first or d
        rows.append(
            f"| {label} | {d['map50']:.4f} | {d['worse_by']:+.2f} [{low:+.2f}, {high:+.2f}] | {d['map']:.4f} | "
            f"{out.stat().st_size / 1024:.1f} KiB | {_latency(out, folder):.3f} |"
        )
    return [
        f"MediaPipe face detector (`{Path(DETECTOR).name}`, float16 weights, no signature), {first['images']} test "
        f"images of `{FACES}` with {first['objects']} faces. mAP change: points worse than the float file, paired "
        "bootstrap 95% interval (1,000 resamples of the images).",
        "",
        "| model | mAP@0.5 | mAP@0.5 change [95% CI] | mAP@0.5:0.95 | size | latency ms |",
        "|---|---|---|---|---|---|",
        f"| float (as shipped) | {first['reference_map50']:.4f} | | {first['reference_map']:.4f} | "
        f"{model.stat().st_size / 1024:.1f} KiB | {fp32_ms:.3f} |",
        *rows,
    ]


def _face_crops(folder: Path) -> tuple[str, str]:
    """Face crops (1.5 x the face box, 192x192, uint8) of the faces source, as landmark models take them:
    calibration from its val split, the evaluation file from its train split (eval's test split of it
    then holds about 1,000 crops, none seen by calibration)."""
    from PIL import Image

    from edgeq.data.sources import load_dataset

    data = load_dataset(CROPS)
    paths = []
    for split in ("val", "train"):
        x, y = data.split(split)
        crops = []
        for image, boxes, classes in zip(x, y["gt_boxes"], y["gt_classes"]):
            box = boxes[int(np.argmax(classes >= 0))] * 256
            cy, cx, side = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2, max(box[2] - box[0], box[3] - box[1]) * 1.5
            raw = Image.fromarray(np.clip(image * 255, 0, 255).astype(np.uint8))
            crops.append(
                np.asarray(raw.crop((cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2)).resize((192, 192)))
            )
        path = folder / f"crops_{split}.npz"
        np.savez(path, x=np.stack(crops))
        paths.append(f"npz:{path}")
    return paths[0], paths[1]


def _landmarks(model: Path, folder: Path) -> list[str]:
    train, test = _face_crops(folder)
    out = folder / "landmarks_int8.tflite"
    refused = _edgeq("convert", model, "--int8-only", "--calib", train, "--input-range", "0:1", "--out", out,
                     refused_ok=True)  # fmt: skip
    _edgeq("convert", model, "--int8", "--calib", train, "--input-range", "0:1", "--out", out)
    record = folder / "landmarks.eval.json"
    _edgeq("eval", out, "--reference", model, "--data", test, "--json", record)
    e = json.loads(record.read_text())
    by_name = {o["name"]: o["comparison"] for o in e["outputs"]}
    marks = by_name["conv2d_21"]
    return [
        f"MediaPipe face landmarks (`{Path(LANDMARKS).name}`, float16 weights, no signature), {e['samples']} face "
        f"crops (192x192) of `{CROPS}` (calibrated on others), no labels: the int8 model against the float file.",
        "",
        f"`--int8-only` answered: `{refused[:300]}`. So the row below is `--int8`: PRELU stays float "
        "between DEQUANTIZE and QUANTIZE.",
        "",
        "| model | landmark error vs float (mean abs, pixels of 192) | max abs | SQNR dB | size | latency ms |",
        "|---|---|---|---|---|---|",
        f"| float (as shipped) | | | | {model.stat().st_size / 1024:.1f} KiB | {_latency(model, folder):.3f} |",
        f"| int8 (PRELU float) | {marks['mae']:.3f} | {marks['max_abs_error']:.2f} | {marks['sqnr_db']:.1f} | "
        f"{out.stat().st_size / 1024:.1f} KiB | {_latency(out, folder):.3f} |",
    ]


def run() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        models = _models(folder)
        detector = _detector(models["face_detection_short_range"], folder)
        landmarks = _landmarks(models["face_landmark"], folder)
    lines = [
        "## Pretrained float .tflite models from a wheel: MediaPipe's face detector and face landmarks",
        "",
        f"`tools/bench_pretrained.py` (`make pretrained` once: the mediapipe {VERSION} wheel, whose models these "
        "are). Each row is what the CLI printed for `edgeq convert X.tflite --int8-only --calib ... "
        "--input-range ...`, then `edgeq eval` against the float file and `edgeq profile` (1 thread, XNNPACK).",
        "",
        *detector,
        "",
        *landmarks,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
