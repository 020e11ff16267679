"""Conversions with a precision plan: layers at 16 bits or float, through LiteRT Quantizer."""

from __future__ import annotations

import json
from pathlib import Path

from edgeq.convert.options import INT4_GRANULARITIES, ConvertOptions, Mode, ModeSpec
from edgeq.errors import UsageError
from edgeq.models.spec import ModelSpec
from edgeq.runtime.flatbuffer import verify_tflite


def _sixteen_bit_qat(keras_model, source: ModelSpec, spec: ModeSpec, notes: list[str]):
    """A QAT model that simulates 16-bit activations converts only to 16x8, and only by PTQ.

    TF 2.21's converter quantizes no QAT graph to 16x8 ("not yet supported for op:
    DEQUANTIZE"), so the float weights QAT fine-tuned (qat_float.keras, beside qat.h5)
    are converted with 16x8 post-training quantization instead.
    """
    from edgeq.models.keras3 import is_keras3_model
    from edgeq.models.load import QAT_FLOAT_NAME, load_user_model

    if is_keras3_model(keras_model):  # the Keras 3 QAT engine trains 8-bit activations only
        return keras_model, True
    from edgeq.train.schemes import activation_bits_of  # TF-MOT's wrappers: a tf_keras QAT model

    if 16 not in activation_bits_of(keras_model):
        return keras_model, True
    where, source_path = source.name, source.path
    if spec.mode != Mode.INT16X8:
        raise UsageError(f"{where} simulates 16-bit activations: convert it with --int16x8")
    fine_tuned = Path(source_path).parent / QAT_FLOAT_NAME if source_path else None
    if fine_tuned is None or not fine_tuned.exists():
        raise UsageError(
            f"{where}: TFLite cannot quantize a QAT graph to 16x8; convert the QAT-fine-tuned float model "
            f"({QAT_FLOAT_NAME}, written by edgeq train beside it) with --int16x8"
        )
    notes.append(f"16-bit-activation QAT: converted {fine_tuned} (its fine-tuned float weights) with 16x8 PTQ")
    return load_user_model(fine_tuned), False


def _convert_with_aeq(keras_model, spec: ModeSpec, int4_granularity: str, notes: list[str]) -> bytes:
    """FP32 TFLite, then LiteRT Quantizer's INT4 recipe on it (weight-only or dynamic)."""
    from edgeq.shims.tflite import keras_converter, native_output_silenced

    try:
        from litert_quantizer import qtyping, quantizer
    except ImportError as exc:
        raise UsageError(f'--{spec.mode.value} needs LiteRT Quantizer: pip install "edgeq[train]"') from exc
    with native_output_silenced():
        float_model = keras_converter(keras_model).convert()
    qt = quantizer.Quantizer(float_model)
    add = qt.add_weight_only_config if spec.mode == Mode.INT4_WEIGHTS else qt.add_dynamic_config
    add(
        regex=".*",
        operation_name=qtyping.TFLOperationName.ALL_SUPPORTED,
        num_bits=4,
        granularity=qtyping.QuantGranularity(INT4_GRANULARITIES[int4_granularity]),
    )
    result = qt.quantize(enable_progress_report=False)
    quantized = bytes(result.quantized_model)
    from edgeq.runtime.flatbuffer import bytes_by_dtype

    by_dtype = bytes_by_dtype(verify_tflite(quantized, "LiteRT Quantizer output"))
    int4, float32 = by_dtype.get("int4", 0), by_dtype.get("float32", 0)
    notes.append(
        f"LiteRT Quantizer {spec.mode.value} ({int4_granularity}): {len(float_model)} -> {len(quantized)} bytes; "
        f"{int4} bytes of INT4 weights, {float32} bytes still float32"
    )
    if int4 == 0 or float32 > 4 * int4:
        notes.append(
            f"most weights stayed float: LiteRT Quantizer applies {int4_granularity} INT4 to only some ops "
            "(blockwise: FULLY_CONNECTED); use --int4-granularity channel for convolutions"
        )
    return quantized


def _plan_resolved(keras_model, plan) -> dict:
    from edgeq.quantize.plan_file import LayerConfig, LayerPrecision

    return LayerConfig.load(plan).resolve([layer.name for layer in keras_model.layers], LayerPrecision())


def _plan_float_layers(keras_model, plan, resolved: dict | None = None) -> list[str]:
    resolved = resolved if resolved is not None else _plan_resolved(keras_model, plan)
    return [name for name, p in resolved.items() if p.keep_float]


def _plan_ranges(plan, ptq: str) -> str:
    """Activation ranges for --plan: --ptq METHOD when given, else those the plan was measured with."""
    from edgeq.quantize.ranges import ACTIVATION_METHODS

    if ptq in ACTIVATION_METHODS:
        return ptq
    if ptq == "converter" or Path(plan).suffix != ".json":
        return "minmax"
    try:
        recorded = json.loads(Path(plan).read_text()).get("ranges", "minmax")
    except (OSError, ValueError, AttributeError):
        return "minmax"  # LayerConfig.load names what is wrong with the file
    return recorded if recorded in ACTIVATION_METHODS else "minmax"


def _plan_wide_layers(keras_model, plan, resolved: dict | None = None) -> list[str]:
    resolved = resolved if resolved is not None else _plan_resolved(keras_model, plan)
    return [n for n, p in resolved.items() if not p.keep_float and p.activation_bits == 16]


def _check_wide_plan(keras_model, plan, options: ConvertOptions) -> list[str]:
    """The plan's 16-bit layers, refused where the mixed model cannot be what was asked for."""
    resolved = _plan_resolved(keras_model, plan)
    wide = _plan_wide_layers(keras_model, plan, resolved)
    if not wide:
        if options.mode != Mode.INT8 and _plan_float_layers(keras_model, plan, resolved):
            raise UsageError(f"{plan} keeps some layers float, so it converts with --int8 (float I/O, float fallback)")
        return wide
    moved = [n for n, p in resolved.items() if p.keep_float or p.weight_bits != 8]
    if options.mode != Mode.INT8_ONLY:
        raise UsageError(f"{plan} puts {len(wide)} layer(s) at 16-bit activations: convert it with --int8-only")
    if options.edgetpu:
        raise UsageError(
            f"{plan} puts {', '.join(wide[:3])}{' ...' if len(wide) > 3 else ''} at 16-bit activations, which the "
            "Edge TPU cannot map (it runs int8 only): plan with --fallback float, or QAT (edgeq train)"
        )
    if options.io_type != "int8" or options.granularity != "per-channel" or options.equalize or options.bias_correct:
        raise UsageError(
            f"{plan}: a mixed int8/int16 model is LiteRT Quantizer's per-channel, int8-I/O model: drop --io-type, "
            "--granularity, --equalize and --bias-correct"
        )
    if moved:
        raise UsageError(f"{plan}: 16-bit layers cannot be mixed with float or INT4 layers ({', '.join(moved[:3])})")
    return wide


def _convert_mixed(keras_model, plan, wide: list[str], dataset, samples, ranges, notes) -> bytes:
    """Integer-only: the plan's layers at 16-bit activations (16x8), every other one int8."""
    from edgeq.quantize.mixed import calibrate_mixed, wide_layers

    cal = calibrate_mixed(keras_model, dataset.calibration_samples(samples), ranges=ranges)
    flatbuffer = cal.quantize(wide)
    got = wide_layers(flatbuffer, cal.layer_names)
    ops = sum(len(v) for v in got.values())
    total = len(verify_tflite(flatbuffer, "the mixed model").main.operators)
    notes.append(
        f"plan {plan}: {len(got)} layer(s) at 16-bit activations ({', '.join(got) or 'none'}; {ops} of {total} ops, "
        f"QUANTIZE ops between int8 and int16), every other one int8, by LiteRT Quantizer, {ranges} activation ranges"
    )
    return flatbuffer


def _convert_with_plan(keras_model, plan, dataset, samples, granularity, ranges, notes, integer_only=False) -> bytes:
    """Full integer except the layers the plan keeps float (denylisted at quantization)."""
    from edgeq.quantize.calibration import calibrate

    resolved = _plan_resolved(keras_model, plan)
    wide = _plan_wide_layers(keras_model, plan, resolved)
    if wide or (integer_only and not any(p.keep_float or p.weight_bits != 8 for p in resolved.values())):
        # 16-bit layers, or an int16 plan whose budget full int8 met: the model the plan measured
        return _convert_mixed(keras_model, plan, wide, dataset, samples, ranges, notes)
    float_layers = [name for name, p in resolved.items() if p.keep_float]
    int4_layers = [name for name, p in resolved.items() if not p.keep_float and p.weight_bits == 4]
    if int4_layers:
        from edgeq.transforms.int4 import int4_weight_copy

        keras_model = int4_weight_copy(keras_model, int4_layers)
        notes.append(
            f"plan: {len(int4_layers)} layer(s) with INT4-valued weights ({', '.join(int4_layers)}); the TFLite "
            "converter stores them in int8 containers: for packed INT4, QAT with edgeq train --layer-config PLAN"
        )
    cal = calibrate(keras_model, dataset, samples, per_tensor=granularity == "per-tensor", ranges=ranges)
    nodes = cal.nodes_of_layers(float_layers)
    notes.append(
        f"plan {plan}: {len(float_layers)} layer(s) kept float ({', '.join(float_layers) or 'none'}), "
        f"{len(cal.nodes) - len(nodes)} of {len(cal.nodes)} ops integer, {ranges} activation ranges"
    )
    return cal.quantize(nodes)
