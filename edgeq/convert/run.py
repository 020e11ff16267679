"""``convert``: a model in, a verified .tflite and its manifest out."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from edgeq.convert.converter import _calibration, _convert_tflite, _converter_error, _input_rescaling_hint, _load_source
from edgeq.convert.manifest import _commit, _manifest, conversion_result
from edgeq.convert.options import VERIFY_SAMPLES, ConversionResult, ConvertOptions, Mode, ModeSpec, default_output
from edgeq.convert.plans import (
    _check_wide_plan,
    _convert_with_aeq,
    _convert_with_plan,
    _plan_float_layers,
    _plan_ranges,
    _sixteen_bit_qat,
)
from edgeq.convert.search import _check_held_out, _convert_searching_ranges
from edgeq.convert.verify import _held_targets, _verify
from edgeq.errors import ConversionError, DataError, UsageError
from edgeq.models.spec import ModelSpec
from edgeq.runtime.interpreter import TFLiteModel
from edgeq.tasks.table import TASKS

log = logging.getLogger(__name__)


def convert(model: Any, out: str | Path | None = None, options: ConvertOptions | None = None) -> ConversionResult:
    """Convert a Keras model (object or .keras/.h5/SavedModel path) and verify the result.

    Returns the written model's description; raises ConversionError (IntegerOnlyError
    for float ops in an integer-only model) and leaves nothing on disk when it fails.
    """
    from edgeq.models.load import concatenated_outputs, task_targets

    options = options or ConvertOptions()
    if isinstance(model, (str, Path)) and Path(model).suffix == ".tflite":
        from edgeq.convert.from_tflite import convert_float_tflite

        return convert_float_tflite(Path(model), out, options)
    if options.input_range:
        raise UsageError("--input-range is for a float .tflite; a Keras model's run records its own (run.json)")
    if options.split_outputs is not None:
        raise UsageError(
            "--split-outputs/--no-split-outputs is for a float .tflite; give a Keras model its heads as separate "
            "outputs"
        )
    spec, calib_samples, plan = options.spec, options.calib_samples, options.plan
    notes: list[str] = []
    keras_model, reference_model, source, is_qat = _source(model, options, notes)
    out = Path(out) if out else default_output(source.path or Path(f"{keras_model.name}.keras"), spec.mode)
    if out.suffix != ".tflite":
        raise UsageError(f"{out}: the output must end in .tflite")
    if plan:
        _check_wide_plan(keras_model, plan, options)
    dataset, data_spec = _calibration(source, options.calib, calib_samples, is_qat, notes)
    hint = (
        _input_rescaling_hint(keras_model, dataset, calib_samples) if dataset is not None and source.single_io else None
    )
    if hint:
        notes.append(hint)
    keras_model = _pretransformed(keras_model, dataset, options, notes)
    _check_data(spec, dataset, data_spec, is_qat, source.name)

    searching = spec.calibrate and spec.mode != Mode.INT16X8 and not is_qat and options.ptq != "converter"
    outputs = source.tasks(options.task, task_targets(dataset, source.output_names))
    if dataset is not None:
        for warning in concatenated_outputs(reference_model, dataset.calibration_samples(min(calib_samples, 64))):
            log.warning("%s", warning)
            notes.append(warning)
    # Held-out samples: a --ptq search chooses on one part, verification gates on another.
    # a task-metric gate (--max-drop) takes every held-out sample the choice leaves: n is its evidence
    verify_n = VERIFY_SAMPLES if options.max_drop is None else None
    held = dataset.held_out(verify_n, select=VERIFY_SAMPLES if searching and not plan else 0) if dataset else None
    if held is not None:
        _check_held_out(held, dataset, searching and not plan, options.ptq)
    started = time.perf_counter()
    route = {"searching": searching, "is_qat": is_qat, "source_name": source.name}
    # a model whose every output is classes: --ptq candidates are chosen by their answers (top-1 agreement)
    route["by_answers"] = all(TASKS[o.kind].classes for o in outputs)
    flatbuffer, ptq_record = _quantize(keras_model, reference_model, spec, dataset, options, held, route, notes)
    seconds = time.perf_counter() - started

    # verified with the kernels that run it on a device and in eval and profile (LiteRT's default, XNNPACK):
    # on a trained EfficientNetB0 the built-in int8 kernels read 57.10% on val where XNNPACK reads 59.43%
    tflite = TFLiteModel(model_content=flatbuffer)
    try:
        verification = _verify(
            tflite, reference_model, spec, held, data_spec, options.io_type, source, options.min_sqnr_db, outputs,
            _held_targets(dataset, held, outputs), options.max_drop,
        )  # fmt: skip
    except ConversionError as exc:
        if hint:  # the likeliest cause of a failed verification, said in the same line
            raise ConversionError(f"{exc}. Note: {hint}") from exc
        raise
    run = {"source": source, "is_qat": is_qat, "ptq": ptq_record, "seconds": seconds, "model": keras_model}
    manifest = _manifest(out, flatbuffer, tflite, spec, options, outputs, dataset, data_spec, verification, notes, run)
    _commit(out, flatbuffer, manifest, notes, options.edgetpu)
    return conversion_result(out, flatbuffer, manifest, spec, seconds, verification, is_qat, notes)


def _source(model: Any, options: ConvertOptions, notes: list[str]):
    """The model to convert, the model to verify against, its ModelSpec and whether it is QAT.

    ``--input-shape`` fixes free dimensions; a 16-bit QAT model gives its fine-tuned float twin;
    a Keras 3 model that a graph transform needs is translated to tf_keras."""
    from edgeq.models.load import as_tf_keras, describe, with_input_shape

    keras_model, source_path = _load_source(model)
    source = describe(keras_model, source_path)
    if options.input_shape:
        if source.is_qat:
            raise UsageError(f"{source.name}: a QAT model keeps the shape it trained with: edgeq train --input-shape")
        keras_model = with_input_shape(keras_model, options.input_shape, source.name)
        source = describe(keras_model, source_path)
    reference_model = keras_model  # verification compares with this, whatever --equalize/--bias-correct change
    is_qat = source.is_qat
    if is_qat:
        keras_model, is_qat = _sixteen_bit_qat(keras_model, source, options.spec, notes)
    _check_source(source, is_qat, options)
    if options.equalize or options.plan or options.bias_correct:  # graph transforms work on tf_keras
        keras_model = as_tf_keras(keras_model)
    return keras_model, reference_model, source, is_qat


def _check_source(source: ModelSpec, is_qat: bool, options: ConvertOptions) -> None:
    """Refuses what these options cannot do with this model (a QAT model's bits, free input dimensions...)."""
    transforms = options.equalize or options.plan or options.bias_correct
    if options.weight_bits != 8 and is_qat:
        raise UsageError(f"{source.name} is a QAT model: its weight bits are the ones it trained with (--weight-bits)")
    if transforms and is_qat:
        raise UsageError(
            f"{source.name}: --equalize, --bias-correct and --plan are post-training tools; give the FP32 model"
        )
    shapes = source.input_shapes
    free = {name: shape for name, shape in shapes.items() if any(d is None for d in shape)}
    if free:
        name, shape = next(iter(free.items()))
        example = "x".join(str(d if d is not None else 224) for d in shape)
        example = example if len(shapes) == 1 else f"{name}={example}"
        raise ConversionError(
            f"{source.name}: input {name!r} has shape {tuple(shape)}, with free dimensions (a fully convolutional "
            f"model): fix them for your camera with --input-shape {example}"
        )
    if transforms and not source.single_io:
        raise UsageError(
            f"{source.name} has {len(source.inputs)} input(s) and {len(source.outputs)} output(s): --equalize, "
            "--bias-correct and --plan take one-input one-output models; convert it without them "
            "(--ptq METHOD, --rounding and --weight-bits take any model)"
        )


def _check_data(spec: ModeSpec, dataset, data_spec, is_qat: bool, source_name: str) -> None:
    """Calibrating modes need samples, and a QAT model needs some to be verified on."""
    if spec.calibrate and dataset is None:
        if is_qat:
            raise UsageError(
                f"{source_name}: no data to verify the conversion: give --calib SRC (any samples of the input)"
            )
        raise UsageError(
            f"{source_name}: {spec.mode.value} post-training quantization needs a representative dataset: "
            "--calib SRC (e.g. --calib digits or --calib npz:calib.npz)"
        )
    if dataset is not None and dataset.count("train") == 0:
        raise DataError(f"calibration data {data_spec!r} is empty")


def _pretransformed(keras_model, dataset, options: ConvertOptions, notes: list[str]):
    """The model after --equalize and --bias-correct (copies; the caller's model is never changed)."""
    equalize, bias_correct, plan = options.equalize, options.bias_correct, options.plan
    calib_samples, granularity = options.calib_samples, options.granularity
    if equalize:
        from edgeq.transforms.equalize import equalized_copy

        x_equalize = dataset.calibration_samples(calib_samples) if dataset is not None else None
        keras_model, pairs = equalized_copy(keras_model, x_equalize)
        if pairs:
            worst = max(pairs, key=lambda p: p.range_spread_before)
            notes.append(
                f"equalized {len(pairs)} layer pair(s); largest channel-range spread {worst.first}: "
                f"{worst.range_spread_before:.1f}x -> {worst.range_spread_after:.1f}x"
            )
        else:
            notes.append("--equalize found no layer pairs (needs Conv/Dense -> ReLU/ReLU6/pool -> Conv/Dense)")
    if bias_correct and dataset is not None:
        from edgeq.transforms.bias_correction import correct_biases
        from edgeq.transforms.fold import folded_copy

        if not equalize:  # equalized_copy has folded BN into a copy already; correct a copy, never the caller's
            keras_model = folded_copy(keras_model)
        keep = frozenset(_plan_float_layers(keras_model, plan)) if plan else frozenset()
        x_bias = dataset.calibration_samples(calib_samples)
        shifts = correct_biases(keras_model, x_bias, granularity == "per-tensor", keep)
        if shifts:
            worst = max(shifts, key=lambda s: s.max_abs_shift)
            notes.append(
                f"bias-corrected {len(shifts)} layer(s); largest shift {worst.max_abs_shift:.3g} in {worst.layer}"
            )
        else:
            notes.append("--bias-correct found no Conv/Dense layer with a bias to correct")
    return keras_model


def _quantize(
    keras_model, reference_model, spec: ModeSpec, dataset, options: ConvertOptions, held, route: dict, notes
) -> tuple[bytes, dict | None]:
    """The flatbuffer, by the one path these options take: a plan, the mode's LiteRT Quantizer backend,
    edgeq's range search, or one TFLiteConverter run. Returns it and the manifest's PTQ record.

    ``route``: what the source decided (``searching``, ``is_qat``, ``source_name``).
    """
    plan, searching, is_qat = options.plan, route["searching"], route["is_qat"]
    ptq_record = None
    try:
        if plan:
            ranges = _plan_ranges(plan, options.ptq)
            flatbuffer = _convert_with_plan(
                keras_model,
                plan,
                dataset,
                options.calib_samples,
                options.granularity,
                ranges,
                notes,
                spec.mode == Mode.INT8_ONLY,
            )
            ptq_record = {"requested": options.ptq, "chosen": ranges, "plan": str(plan), "candidates": []}
        elif searching:
            flatbuffer, ptq_record = _convert_searching_ranges(
                keras_model, reference_model, spec, dataset, options, held, route["by_answers"]
            )
            notes.append(ptq_record.pop("note"))
        else:  # the mode's own exporter, named by its row of MODES
            flatbuffer = EXPORTERS[spec.backend](keras_model, spec, dataset, options, is_qat, notes)
    except (UsageError, DataError):
        raise
    except Exception as exc:  # the converter raises ConverterError, ValueError, RuntimeError...
        raise _converter_error(exc, spec, route["source_name"]) from exc
    return flatbuffer, ptq_record


def _export_tflite(keras_model, spec: ModeSpec, dataset, options: ConvertOptions, is_qat, notes) -> bytes:
    """One TFLiteConverter run (every mode but INT4's)."""
    flatbuffer, fused = _convert_tflite(keras_model, spec, dataset, options, is_qat)
    if fused:
        notes.append(f"fused {fused} DEQUANTIZE->QUANTIZE pair(s) the converter left into integer requantize ops")
    return flatbuffer


def _export_aeq(keras_model, spec: ModeSpec, dataset, options: ConvertOptions, is_qat, notes) -> bytes:
    """LiteRT Quantizer on the FP32 .tflite (the INT4 modes)."""
    return _convert_with_aeq(keras_model, spec, options.int4_granularity, notes)


# ModeSpec.backend -> the function that writes that mode's flatbuffer.
EXPORTERS = {"tflite": _export_tflite, "aeq": _export_aeq}
