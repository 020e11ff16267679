"""Keras 3 and the layers TF-MOT has no config for, for BENCHMARKS.md (ratios from one run).

1. Translating Keras 3 EfficientNetB0 to tf_keras / one bare int8-only conversion of it.
2. QAT epoch / FP32 epoch for tf_keras MobileNetV3Small and EfficientNetB0 (96x96, 10
   classes, synthetic data): what edgeq's own output quantizers and TF-op rewrites cost.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SIZE = 96
SAMPLES = 256


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, size=(SAMPLES, SIZE, SIZE, 3)).astype("float32")
    return x, rng.integers(0, 10, SAMPLES)


def _epoch_seconds(model, x, y, repeats: int = 2) -> float:
    from edgeq.train.stages import _compile

    _compile(model, 1e-4)
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)  # trace + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.fit(x, y, epochs=1, batch_size=32, verbose=0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bare_int8_only_seconds(model, x, samples: int = 32) -> float:
    """One bare TFLiteConverter int8-only conversion (``samples`` representative samples), timed."""
    from edgeq.models.compat import tf
    from edgeq.shims.tflite import native_output_silenced

    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.int8
    converter.representative_dataset = lambda: ([x[i : i + 1]] for i in range(samples))
    start = time.perf_counter()
    with native_output_silenced():
        converter.convert()
    return time.perf_counter() - start


def run() -> str:
    import edgeq.models.compat  # noqa: F401, I001  (Keras flavour first, before Keras 3 imports TensorFlow)
    import keras  # noqa: I001

    from edgeq.models.compat import keras as tf_keras
    from edgeq.models.translate import translate
    from edgeq.train.schemes import QuantSettings, build_qat_model

    x, y = _data()
    k3 = keras.applications.EfficientNetB0(weights=None, input_shape=(SIZE, SIZE, 3), classes=10)
    translation = translate(k3)
    convert_s = bare_int8_only_seconds(translation.model, x)
    lines = [
        "## Keras 3 models and TF-MOT's missing layers",
        "",
        f"`python tools/bench.py --only keras` ({SIZE}x{SIZE}x3, 10 classes, random weights, {SAMPLES} synthetic "
        "samples, batch 32; epoch times are medians of 2 after a warm-up epoch).",
        "",
        "| what | seconds | ratio |",
        "|---|---|---|",
        f"| Keras 3 EfficientNetB0 -> tf_keras translation / one bare int8-only conversion | "
        f"{translation.seconds:.2f} / {convert_s:.2f} | {translation.seconds / convert_s:.2f}x |",
    ]
    for name in ("MobileNetV3Small", "EfficientNetB0"):
        model = getattr(tf_keras.applications, name)(weights=None, input_shape=(SIZE, SIZE, 3), classes=10)
        fp32 = _epoch_seconds(model, x, y)
        start = time.perf_counter()
        qat_model = build_qat_model(model, QuantSettings())
        wrap = time.perf_counter() - start
        qat = _epoch_seconds(qat_model, x, y)
        lines.append(
            f"| {name}: QAT epoch / FP32 epoch (QAT wrapping took {wrap:.1f} s) | {qat:.2f} / {fp32:.2f} | "
            f"{qat / fp32:.2f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
