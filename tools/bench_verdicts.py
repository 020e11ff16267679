"""Verdicts with their evidence: models whose int8 form may lose points, judged by every gate.

Keras 3 MobileNetV3Small and EfficientNetB0 (32x32, logits, `from_logits` cross-entropy in their
compile config) trained on 6,000 teacher-labelled crops of scikit-learn's sample photos (1,199 test
samples), converted `--int8-only` with the converter's own ranges. Each gate is run from the CLI as a user
runs it, and what it prints is kept: `convert`'s verification, `eval --max-drop 1` on test, and
`analyze plan --max-drop 1` on val. The section says what each gate decided and with what n and
interval, so a reader sees whether the splits disagree or n is too small to tell.

python tools/bench.py --only verdicts     (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
EPOCHS = int(os.environ.get("EDGEQ_BENCH_VERDICT_EPOCHS", "6"))
SAMPLES = 6000
ARCHITECTURES = os.environ.get("EDGEQ_BENCH_VERDICT_ARCHS", "MobileNetV3Small,EfficientNetB0").split(",")
OPTIONS = {"MobileNetV3Small": {"include_preprocessing": False}}
RAW_PIXELS = {"EfficientNetB0"}  # its Rescaling and Normalization expect 0..255 pixels


def _edgeq(*args) -> tuple[int, str]:
    """One edgeq command as a user runs it; its exit code and what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "edgeq", *map(str, args)], capture_output=True, text=True, cwd=ROOT, check=False
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith(("I0000", "W0000"))]
    return done.returncode, "\n".join(lines)


def _train(folder: Path, name: str, photos: str) -> tuple[Path, str]:
    import keras
    from bench_ptq import _raw_pixels, _set_bn_statistics

    from edgeq.data.sources import load_dataset

    data = _raw_pixels(photos, folder) if name in RAW_PIXELS else photos
    d = load_dataset(data)
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(
        weights=None, input_shape=d.x_train.shape[1:], classes=10, classifier_activation=None, **OPTIONS.get(name, {})
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(d.x_train, d.y_train, epochs=EPOCHS, batch_size=64, verbose=0)
    _set_bn_statistics(model, d.x_train[:512])
    path = folder / f"{name}.keras"
    model.save(path)
    return path, data


def measure(name: str) -> dict:
    from bench_ptq import teacher_photos

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        model, data = _train(folder, name, teacher_photos(folder, n=SAMPLES))
        row: dict = {"model": name, "train_seconds": round(time.perf_counter() - start)}
        out = folder / "int8.tflite"
        row["convert_default"] = _edgeq("convert", model, "--int8-only", "--calib", data,
                                        "--out", folder / "default.tflite")  # fmt: skip
        row["convert"] = _edgeq("convert", model, "--int8-only", "--ptq", "converter", "--calib", data,
                                "--min-sqnr", "0", "--out", out)  # fmt: skip
        row["convert_max_drop"] = _edgeq("convert", model, "--int8-only", "--ptq", "converter", "--calib", data,
                                         "--max-drop", "1", "--out", folder / "gated.tflite")  # fmt: skip
        row["eval"] = _edgeq("eval", out, "--reference", model, "--data", data, "--max-drop", "1",
                             "--json", folder / "eval.json")  # fmt: skip
        if (folder / "eval.json").is_file():
            row["eval_json"] = json.loads((folder / "eval.json").read_text())["verdicts"]
        plan_start = time.perf_counter()
        row["plan"] = _edgeq("analyze", "plan", model, "--data", data, "--max-drop", "1",
                             "--out", folder / "plan.json")  # fmt: skip
        row["plan_seconds"] = round(time.perf_counter() - plan_start)
        if (folder / "plan.json").is_file():
            plan = json.loads((folder / "plan.json").read_text())
            row["plan_json"] = {k: plan.get(k) for k in ("met", "verdict", "layers", "samples")}
            if plan.get("layers"):
                planned = folder / "planned.tflite"
                row["convert_plan"] = _edgeq("convert", model, "--int8", "--plan", folder / "plan.json",
                                             "--calib", data, "--out", planned)  # fmt: skip
                # the converted plan on the split the plan measured: the same model gives the same accuracy
                row["eval_plan_val"] = _edgeq("eval", planned, "--reference", model, "--data", data,
                                              "--split", "val", "--max-drop", "1")  # fmt: skip
                row["eval_int8_val"] = _edgeq("eval", out, "--reference", model, "--data", data,
                                              "--split", "val", "--max-drop", "1")  # fmt: skip
        return row


def run() -> str:
    lines = [
        "## Verdicts: every gate with its n and interval",
        "",
        f"`python tools/bench.py --only verdicts`: Keras 3 `keras.applications` models (32x32, logits) trained "
        f"{EPOCHS} epochs on {SAMPLES} teacher-labelled crops of scikit-learn's sample photos (70/10/20 split: "
        "val 599, test 1199), then converted and judged by each gate from the CLI, as a user runs them. What "
        "each printed (its verdict lines):",
    ]
    for name in ARCHITECTURES:
        row = measure(name)
        print(json.dumps(row, indent=1, default=str), flush=True)
        lines += ["", f"### {name} (trained in {row['train_seconds']} s)", ""]
        for key, title in (
            ("convert_default", "`edgeq convert --int8-only` (defaults: `--ptq auto`, verification by SQNR)"),
            ("convert", "`edgeq convert --int8-only --ptq converter --min-sqnr 0`"),
            ("convert_max_drop", "`edgeq convert --int8-only --ptq converter --max-drop 1` (verification by accuracy)"),
            ("eval", "`edgeq eval --max-drop 1` of the `--ptq converter` model (test split)"),
            ("plan", f"`edgeq analyze plan --max-drop 1` (val split, {row.get('plan_seconds')} s)"),
            ("convert_plan", "`edgeq convert --int8 --plan plan.json` (the plan just written)"),
            ("eval_plan_val", "`edgeq eval --split val --max-drop 1` of that converted plan (the plan's own split)"),
            ("eval_int8_val", "`edgeq eval --split val --max-drop 1` of the `--ptq converter` model"),
        ):
            if key in row:
                code, text = row[key]
                kept = [line for line in text.splitlines() if "task metric" in line or "budget" in line
                        or line.startswith(("error", "chosen plan", "note: --ptq"))]  # fmt: skip
                lines += [f"{title}: exit {code}", "", "```", *(kept or text.splitlines()[-4:]), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tools"))
    sys.path.insert(0, str(ROOT))
    print(run())
