"""Host-side benchmarks for BENCHMARKS.md: ratios measured in one run, on this machine.

1. QAT epoch time / FP32 epoch time (same model, data, batch size).
2. `edgeq convert` time (load + convert + verify + write) / bare TFLiteConverter time
   (the same int8-only conversion of the same in-memory model, nothing else).

For digits-cnn (digits) and mobilenetv2 alpha 0.35 at 96x96 (synthetic data).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CASES = (
    # name, architecture, data, options, timed epochs, calibration samples
    ("digits-cnn", "digits-cnn", "digits", {}, 3, 100),
    ("mobilenetv2-0.35 (96x96)", "mobilenetv2", "synthetic:96x96x3:10", {"alpha": 0.35}, 2, 100),
)


def _epoch_seconds(model, dataset, epochs: int, batch_size: int = 32) -> float:
    from edgeq.train.stages import _compile

    _compile(model, 1e-4)
    model.fit(dataset.x_train, dataset.y_train, epochs=1, batch_size=batch_size, verbose=0)  # trace + warm-up
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        model.fit(dataset.x_train, dataset.y_train, epochs=1, batch_size=batch_size, verbose=0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bare_convert_seconds(model, dataset, samples: int) -> float:
    from edgeq.models.compat import tf

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.int8
    converter.representative_dataset = dataset.representative_dataset(samples)
    start = time.perf_counter()
    converter.convert()
    return time.perf_counter() - start


def measure() -> list[dict]:
    from edgeq.convert.options import ConvertOptions
    from edgeq.convert.run import convert
    from edgeq.data.sources import load_dataset
    from edgeq.models import zoo
    from edgeq.models.compat import keras
    from edgeq.train.schemes import QuantSettings, build_qat_model

    rows = []
    for name, arch, data, options, epochs, samples in CASES:
        keras.utils.set_random_seed(0)
        dataset = load_dataset(data)
        fp32 = zoo.build(arch, dataset.input_shape, dataset.num_classes, **options)
        fp32_epoch = _epoch_seconds(fp32, dataset, epochs)
        qat = build_qat_model(fp32, QuantSettings())
        qat_epoch = _epoch_seconds(qat, dataset, epochs)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "qat.h5"
            qat.save(path)
            _bare_convert_seconds(qat, dataset, samples)  # warm the converter once
            bare = statistics.median(_bare_convert_seconds(qat, dataset, samples) for _ in range(2))
            edgeq_times = []
            for i in range(2):
                start = time.perf_counter()
                convert(
                    path,
                    Path(tmp) / f"m{i}.tflite",
                    ConvertOptions(mode="int8-only", calib=data, calib_samples=samples),
                )
                edgeq_times.append(time.perf_counter() - start)
            edgeq = statistics.median(edgeq_times)
        rows.append(
            {
                "model": name,
                "train samples": len(dataset.x_train),
                "fp32_epoch_s": fp32_epoch,
                "qat_epoch_s": qat_epoch,
                "qat_ratio": qat_epoch / fp32_epoch,
                "bare_convert_s": bare,
                "edgeq_convert_s": edgeq,
                "convert_ratio": edgeq / bare,
            }
        )
    return rows


def run() -> str:
    rows = measure()
    lines = [
        "## Host: training and conversion overhead",
        "",
        "`python tools/bench.py` (median of timed repeats after one warm-up; 2 CPU cores). "
        "QAT ratio = QAT epoch / FP32 epoch of the same model and data. Convert ratio = "
        "`edgeq convert --int8-only` (load .h5 + convert + verify in LiteRT + write manifest) / "
        "a bare `TFLiteConverter` int8-only conversion of the same in-memory QAT model, "
        "same representative dataset.",
        "",
        "| model | train samples | FP32 epoch (s) | QAT epoch (s) | QAT / FP32 "
        "| bare convert (s) | edgeq convert (s) | edgeq / bare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['train samples']} | {r['fp32_epoch_s']:.2f} | {r['qat_epoch_s']:.2f} | "
            f"{r['qat_ratio']:.2f}x | {r['bare_convert_s']:.2f} | {r['edgeq_convert_s']:.2f} "
            f"| {r['convert_ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
