"""Build the tiny committed test models in tests/data/ (needs the host install: TensorFlow).

Writes, deterministically enough for tests (the tests check properties, not bytes):

- ``tiny_int8.tflite``   a small CNN on 8x8 digits, integer-only, int8 input and output
- ``tiny_uint8.tflite``  the same network with uint8 input and output
- ``tiny_fp32.tflite``   its FP32 twin
- ``tiny_custom_op.tflite`` the int8 model with one op replaced by an unknown custom op
- ``tiny_edgetpu.tflite`` the int8 model whose first op is an ``edgetpu-custom-op``,
  the way ``edgetpu_compiler`` output looks (it runs only with the Edge TPU delegate)
- ``tiny_digits.npz``    200 test digits: ``x`` (float32, N,8,8,1 in [0,1]) and ``y`` (int64)

The last two are made by rewriting the flatbuffer with the schema that ships with
ai-edge-litert, so the "custom op" files are real .tflite files an interpreter rejects.

With ``--mobilenetv2 DIR`` it also writes ``mobilenetv2_fp32.tflite`` and
``mobilenetv2_int8.tflite`` (alpha 1.0, 224x224, random weights, calibrated on random
data) into DIR for the latency benchmark in tools/bench_device.py. Usage::

    python tools/make_tiny_models.py [--out tests/data] [--mobilenetv2 runs/bench]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEED = 7


def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits as (x_train, y_train, x_test, y_test), x in [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(x))
    x, y = x[order], y[order]
    return x[200:], y[200:], x[:200], y[:200]


def _tiny_cnn(keras):
    inputs = keras.Input((8, 8, 1), batch_size=1, name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(10, activation="softmax", name="probs")(h)
    return keras.Model(inputs, outputs, name="tiny_cnn")


def _convert(tf, model, representative, io_dtype=None) -> bytes:
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    if io_dtype is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = representative
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = io_dtype
        converter.inference_output_type = io_dtype
    return converter.convert()


def replace_op_with_custom(content: bytes, op_index: int, custom_code: str) -> bytes:
    """Return ``content`` with op ``op_index`` of subgraph 0 turned into a custom op."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(content, 0))
    code = schema.OperatorCodeT()
    code.builtinCode = schema.BuiltinOperator.CUSTOM
    code.deprecatedBuiltinCode = schema.BuiltinOperator.CUSTOM
    code.customCode = custom_code
    code.version = 1
    model.operatorCodes.append(code)
    op = model.subgraphs[0].operators[op_index]
    op.opcodeIndex = len(model.operatorCodes) - 1
    op.builtinOptionsType = schema.BuiltinOptions.NONE
    op.builtinOptions = None
    op.customOptions = [0]
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def make_tiny(out: Path, tf, keras) -> None:
    x_train, y_train, x_test, y_test = _digits()
    keras.utils.set_random_seed(SEED)
    model = _tiny_cnn(keras)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=32, epochs=12, verbose=0)
    _, acc = model.evaluate(x_test, y_test, batch_size=1, verbose=0)
    print(f"tiny CNN FP32 test accuracy: {acc:.3f}")

    def representative():
        for i in range(100):
            yield [x_train[i : i + 1]]

    out.mkdir(parents=True, exist_ok=True)
    int8 = _convert(tf, model, representative, tf.int8)
    files = {
        "tiny_fp32.tflite": _convert(tf, model, representative, None),
        "tiny_int8.tflite": int8,
        "tiny_uint8.tflite": _convert(tf, model, representative, tf.uint8),
        "tiny_custom_op.tflite": replace_op_with_custom(int8, 1, "EdgeqUnknownOp"),
        "tiny_edgetpu.tflite": replace_op_with_custom(int8, 0, "edgetpu-custom-op"),
    }
    for name, content in files.items():
        (out / name).write_bytes(content)
        print(f"wrote {out / name} ({len(content)} bytes)")
    np.savez_compressed(out / "tiny_digits.npz", x=x_test.astype(np.float32), y=y_test)
    print(f"wrote {out / 'tiny_digits.npz'}")


def make_mobilenetv2(out: Path, tf, keras) -> None:
    keras.utils.set_random_seed(SEED)
    model = keras.applications.MobileNetV2(input_shape=(224, 224, 3), alpha=1.0, weights=None, classes=1000)
    rng = np.random.default_rng(SEED)

    def representative():
        for _ in range(8):
            yield [rng.uniform(-1, 1, (1, 224, 224, 3)).astype(np.float32)]

    out.mkdir(parents=True, exist_ok=True)
    for name, io_dtype in (("mobilenetv2_fp32.tflite", None), ("mobilenetv2_int8.tflite", tf.int8)):
        content = _convert(tf, model, representative, io_dtype)
        (out / name).write_bytes(content)
        print(f"wrote {out / name} ({len(content)} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data")
    parser.add_argument("--mobilenetv2", type=Path, default=None, help="also write MobileNetV2 models here")
    parser.add_argument("--skip-tiny", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    from edgeq.models.compat import keras, tf

    if not args.skip_tiny:
        make_tiny(args.out, tf, keras)
    if args.mobilenetv2 is not None:
        make_mobilenetv2(args.mobilenetv2, tf, keras)


if __name__ == "__main__":
    main()
