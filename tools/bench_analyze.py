"""Sensitivity-analysis cost on MobileNetV2 alpha 0.35 (96x96): fast vs one conversion, exact per layer."""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SAMPLES = 100  # calibration samples, for the conversion and for the analysis alike
EXACT_LAYERS = 4  # exact sensitivity is timed on this many layers and reported per layer


def measure() -> dict:
    from edgeq.analyze.sensitivity import fast_sensitivity
    from edgeq.data.sources import load_dataset
    from edgeq.models import zoo
    from edgeq.models.compat import keras, tf
    from edgeq.quantize.calibration import calibrate, predict

    keras.utils.set_random_seed(0)
    dataset = load_dataset("synthetic:96x96x3:10")
    model = zoo.build("mobilenetv2", dataset.input_shape, dataset.num_classes, alpha=0.35)

    def one_conversion() -> float:
        converter = tf.lite.TFLiteConverter.from_keras_model(model)
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = converter.inference_output_type = tf.int8
        converter.representative_dataset = dataset.representative_dataset(SAMPLES)
        start = time.perf_counter()
        converter.convert()
        return time.perf_counter() - start

    one_conversion()  # warm-up
    conversion = statistics.median(one_conversion() for _ in range(2))
    start = time.perf_counter()
    cal = calibrate(model, dataset, SAMPLES)
    fast = fast_sensitivity(cal)
    fast_seconds = time.perf_counter() - start

    x, y = dataset.split("val")
    per_layer = []
    for layer in cal.layers[:EXACT_LAYERS]:
        t0 = time.perf_counter()
        own = cal.nodes_of_layers([layer])
        others = [n for n in cal.nodes if n not in own]
        predict(cal.quantize(own), x)
        predict(cal.quantize(others), x)
        per_layer.append(time.perf_counter() - t0)
    return {
        "conversion_s": conversion,
        "fast_s": fast_seconds,
        "fast_ratio": fast_seconds / conversion,
        "fast_layers": len(fast),
        "layers": len(cal.layers),
        "exact_per_layer_s": statistics.mean(per_layer),
        "eval_samples": len(x),
    }


def run() -> str:
    m = measure()
    return "\n".join(
        [
            "## Analysis: sensitivity cost on MobileNetV2 alpha 0.35 (96x96, random init)",
            "",
            f"Calibration with {SAMPLES} synthetic samples in every case. Fast = calibrate once + one "
            "QuantizationDebugger pass (per-layer MSE, RMSE/scale, max error, channel SQNR). Exact = per layer, "
            f"two re-quantizations of the calibrated model (all-but-this, only-this) and two LiteRT passes over "
            f"{m['eval_samples']} validation samples; timed on {EXACT_LAYERS} layers.",
            "",
            "| one int8-only conversion (s) | fast sensitivity (s) | fast / conversion | layers analyzed "
            "| exact, s per layer | exact, all layers (est. s) |",
            "|---|---|---|---|---|---|",
            f"| {m['conversion_s']:.1f} | {m['fast_s']:.1f} | {m['fast_ratio']:.2f}x | {m['fast_layers']} | "
            f"{m['exact_per_layer_s']:.2f} | {m['exact_per_layer_s'] * m['layers']:.0f} ({m['layers']} layers) |",
            "",
        ]
    )


if __name__ == "__main__":
    print(run())
