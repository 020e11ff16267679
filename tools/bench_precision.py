"""FP32 vs INT8 PTQ vs INT8 QAT vs INT4 PTQ vs INT4 QAT for digits-cnn and ds-cnn (recipes' settings).

Every row is a real file made by edgeq's own train/convert and measured by edgeq eval
against the same FP32 model on the same test split.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODELS = ("digits-cnn", "ds-cnn")


@dataclass(frozen=True)
class PrecisionRow:
    variant: str
    how: str
    accuracy: float
    worse_by: float
    size_bytes: int
    size_ratio: float


def precision_table(
    model: str, workdir: str | Path, data: str | None = None, epochs: int | None = None, qat_epochs: int | None = None
) -> list[PrecisionRow]:
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.evaluate.run import evaluate
    from edgeq.train.config import TrainConfig
    from edgeq.train.fit import train

    workdir = Path(workdir)
    base = train(
        TrainConfig(model=model, data=data, out_dir=str(workdir / "w8"), epochs=epochs, qat_epochs=qat_epochs),
        force=True,
    )
    record_data = data or json.loads(base.run.read_text())["data"]["source"]
    w4 = train(
        TrainConfig(
            model=str(base.fp32_model),
            data=record_data,
            out_dir=str(workdir / "w4"),
            epochs=0,
            qat_epochs=qat_epochs if qat_epochs is not None else base.stages[-1].epochs,
            weight_bits=4,
        ),
        force=True,
    )
    variants = [
        ("FP32", "TFLite float32", base.fp32_model, "fp32", None),
        ("INT8 PTQ", "int8-only, 200 calibration samples", base.fp32_model, "int8-only", record_data),
        ("INT8 QAT", "TF-MOT 8-bit QAT -> int8-only", base.qat_model, "int8-only", None),
        ("INT4 PTQ", "AI Edge Quantizer INT4 weight-only, per channel", base.fp32_model, "int4-weights", None),
        ("INT4 QAT", "TF-MOT 4-bit-weight QAT -> int8-only (INT4 weights)", w4.qat_model, "int8-only", None),
    ]
    rows = []
    for name, how, source, mode, calib in variants:
        out = workdir / f"{name.replace(' ', '_').lower()}.tflite"
        convert(source, out, ConvertOptions(mode=mode, calib=calib, min_sqnr_db=-100))
        ev = evaluate(out, base.fp32_model, record_data)
        rows.append(PrecisionRow(name, how, ev.value, ev.worse_by, ev.size_bytes, ev.size_ratio))
    fp32_size = rows[0].size_bytes
    return [
        PrecisionRow(r.variant, r.how, r.accuracy, r.worse_by, r.size_bytes, r.size_bytes / fp32_size) for r in rows
    ]


def markdown(model: str, rows: list[PrecisionRow]) -> str:
    lines = [f"| {model} | accuracy | drop vs FP32 (pp) | size | vs FP32 TFLite | how |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.accuracy:.2%} | {r.worse_by:+.2f} | {r.size_bytes / 1024:.1f} KiB | "
            f"{r.size_ratio:.1%} | {r.how} |"
        )
    return "\n".join(lines) + "\n"


def run() -> str:
    parts = [
        "## Precision: accuracy and size of each quantization path",
        "",
        "`python tools/bench.py --only precision`: each reference model trained with its recipe "
        "(`models/*.toml`), then converted five ways and measured with `edgeq eval` on the test split "
        "(digits: real handwritten digits; ds-cnn: synthetic 49x10 'MFCC' data, 12 classes).",
        "",
    ]
    for model in MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            parts.append(markdown(model, precision_table(model, tmp)))
    return "\n".join(parts)


if __name__ == "__main__":
    print(run())
