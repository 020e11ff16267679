"""The TFLite converter and LiteRT Quantizer, driven: calibration, conversion, the exporters."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from edgeq.convert.options import FLOAT_DTYPES, ConvertOptions, Mode, ModeSpec
from edgeq.data.sources import load_dataset
from edgeq.data.splits import Dataset
from edgeq.errors import ConversionError, IntegerOnlyError, UsageError
from edgeq.models.spec import ModelSpec
from edgeq.runtime.interpreter import TFLiteModel


def _input_rescaling_hint(keras_model, dataset, samples: int) -> str | None:
    """A model that rescales raw pixels itself (Rescaling 1/255 or 1/127.5 at its input, as
    keras.applications MobileNetV3 and EfficientNet do) given data already in [0, 1]: its float
    input then varies by a few thousandths, and an int8 grid keeps two or three levels of it."""
    for layer in keras_model.layers[:4]:
        if type(layer).__name__ != "Rescaling":
            continue
        scale = float(np.max(np.abs(np.asarray(layer.scale, dtype=np.float64))))
        x = dataset.calibration_samples(min(samples, 64))
        lo, hi = float(np.min(x)), float(np.max(x))
        if scale <= 0.01 and max(abs(lo), abs(hi)) <= 1.5:
            return (
                f"layer {layer.name!r} (Rescaling x{scale:.4g}) expects raw pixel values (0..255), but the "
                f"calibration data lies in [{lo:.3g}, {hi:.3g}]: give raw pixels, or build the model without its "
                "own preprocessing (include_preprocessing=False)"
            )
        return None
    return None


def _calibration(source: ModelSpec, calib: str | None, n: int, is_qat: bool, notes: list):
    """Calibration samples: --calib, else the data the model was trained on (run.json)."""
    spec = calib or source.trained_on
    if spec is None:
        return None, None
    if not calib:
        notes.append(f"calibration/verification data taken from the training run: {spec}")
    # raw files in the units the model was trained in; float files checked against them
    shape = source.input_shape
    dataset = load_dataset(spec, shape, labels_required=False, normalization=source.normalization)
    dataset.check_fits(shape, where=f"model {source.name}")
    dataset.check_finite()
    return dataset, spec


def _converter(
    model,
    spec: ModeSpec,
    dataset: Dataset | None,
    samples: int,
    granularity: str,
    io_type: str,
    is_qat,
    static_batch: bool = False,
):
    from edgeq.models.compat import tf
    from edgeq.models.load import input_names
    from edgeq.shims.tflite import disable_per_channel, keras_converter

    converter = keras_converter(model, static_batch)  # static: the Edge TPU compiler wants every shape fixed
    mode = spec.mode
    if mode == Mode.FP32:
        return converter
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if mode == Mode.FP16:
        converter.target_spec.supported_types = [tf.float16]
        return converter
    if mode == Mode.DYNAMIC:
        return converter
    if dataset is not None:
        # A QAT model takes its ranges from the fake-quant ops; TF 2.21 still insists on a
        # representative dataset for full-integer modes, so one is always given.
        converter.representative_dataset = dataset.representative_dataset(samples, order=input_names(model))
    if granularity == "per-tensor":
        if is_qat:
            raise UsageError(
                "--granularity applies to post-training quantization; a QAT model keeps its training "
                "granularity (edgeq train --granularity)"
            )
        disable_per_channel(converter)
    if mode == Mode.INT8_ONLY:
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        io = {"int8": tf.int8, "uint8": tf.uint8}[io_type]
        converter.inference_input_type = io
        converter.inference_output_type = io
    elif mode == Mode.INT16X8:
        converter.target_spec.supported_ops = [
            tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8
        ]
    return converter


_TF_OP = re.compile(r"'(tf\.[A-Za-z0-9_]+)' op")


def _converter_error(exc: Exception, spec: ModeSpec, source: str) -> ConversionError:
    text = str(exc)
    ops = sorted(set(_TF_OP.findall(text)))
    if ops:
        cls = IntegerOnlyError if spec.integer_only else ConversionError
        return cls(
            f"{source}: TFLite has no {'integer ' if spec.integer_only else ''}kernel for {', '.join(ops)}: "
            "replace those ops in the model, or convert with --int8 to let them run in float"
        )
    first = next((line for line in text.splitlines() if line.strip()), type(exc).__name__)
    return ConversionError(f"{source}: the TFLite converter failed in mode {spec.mode.value}: {first[:300]}")


def float_ops(model: TFLiteModel) -> list[str]:
    """Ops that read or write float tensors: what keeps a graph from being integer-only."""
    found = []
    for op in model.ops():
        dtypes = set(op.input_dtypes) | set(op.output_dtypes)
        if dtypes & FLOAT_DTYPES:
            found.append(f"{op.op_name}#{op.index}")
    return found


def _load_source(model_or_path):
    from edgeq.models.load import load_user_model

    if isinstance(model_or_path, (str, Path)):
        return load_user_model(model_or_path), Path(model_or_path)
    return model_or_path, None


def _convert_tflite(keras_model, spec: ModeSpec, dataset, options: ConvertOptions, is_qat) -> tuple[bytes, int]:
    """One TFLiteConverter run; integer-only results get their requantize pairs fused, and an
    int8 HARD_SWISH becomes ADD/MUL (edgeq.quantize.passes) except for the Edge TPU compiler."""
    from edgeq.quantize.passes import fuse_requantize, unfuse_hard_swish
    from edgeq.shims.tflite import native_output_silenced

    granularity = "per-channel" if is_qat else options.granularity
    converter = _converter(
        keras_model, spec, dataset, options.calib_samples, granularity, options.io_type, is_qat, options.edgetpu
    )
    with native_output_silenced():
        flatbuffer = converter.convert()
    if spec.calibrate and not options.edgetpu:  # int8 HARD_SWISH has no XNNPACK kernel: ADD/MUL run in one partition
        flatbuffer, _ = unfuse_hard_swish(flatbuffer)
    return fuse_requantize(flatbuffer) if spec.integer_only else (flatbuffer, 0)
