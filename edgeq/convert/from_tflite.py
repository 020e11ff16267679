"""`edgeq convert X.tflite`: a float .tflite from any framework, quantized and verified like a Keras model.

The file is made ready for LiteRT Quantizer (float16 constants to float32, a signature where it
has none: ``edgeq.quantize.float_model.prepared_float_model``), calibrated with edgeq's observers and range methods
(``edgeq.quantize.mixed.calibrate_float``, as mixed plans are), quantized integer-only (int8
inputs and outputs), and verified output by output against the float file itself. What needs the
source model (QAT, graph transforms, the TFLite converter's options) is refused in one line.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgeq.convert.manifest import _commit, _manifest, conversion_result
from edgeq.convert.options import VERIFY_SAMPLES, ConversionResult, ConvertOptions, Mode, default_output
from edgeq.convert.plans import _plan_ranges
from edgeq.convert.verify import _held_targets, _verify
from edgeq.errors import ConversionError, UsageError
from edgeq.models.spec import ModelSpec, describe_tflite
from edgeq.quantize.float_model import prepared_float_model
from edgeq.runtime.inputs import Normalization
from edgeq.runtime.interpreter import TFLiteModel, with_joins
from edgeq.tasks.table import AGAINST_FLOAT

MODES = (Mode.INT8_ONLY, Mode.INT8, Mode.INT16X8)
# What a .tflite cannot be given, and what to bring instead.
_NEEDS_SOURCE = {
    "equalize": "--equalize changes the float layers",
    "bias_correct": "--bias-correct changes the float layers",
    "input_shape": "--input-shape rebuilds the model's inputs",
}


def _refused(path: Path, options: ConvertOptions) -> None:
    """One line for each option a float .tflite cannot take, saying what to do instead."""
    spec = options.spec
    if spec.mode not in MODES:
        raise UsageError(
            f"{path}: a float .tflite is quantized by LiteRT Quantizer to --int8-only, --int8 (ops it has no int8 "
            f"kernel for stay float) or --int16x8, with integer inputs and outputs; {spec.mode.value} needs the "
            "source model (.keras/.h5/SavedModel)"
        )
    for option, what in _NEEDS_SOURCE.items():
        if getattr(options, option):
            raise UsageError(f"{path}: {what}, which a .tflite does not have: give the source model for it")
    if options.edgetpu:
        raise UsageError(
            f"{path}: --edgetpu compiles what the TFLite converter writes; convert this file with --int8-only, "
            "then run edgetpu_compiler on the result (edgeq inspect --edgetpu says what it would refuse)"
        )
    if options.rounding != "nearest" or options.weight_ranges != "minmax":
        raise UsageError(f"{path}: --rounding and --weight-ranges choose Keras weights: give the source model")
    if options.weight_bits not in (4, 8):
        raise UsageError(f"{path}: --weight-bits takes 8 or 4 (W4A8) for a .tflite")
    if options.calib is None:
        raise UsageError(f"{path}: a .tflite records no training data: give --calib SRC (samples of its input)")


def _ranges(options: ConvertOptions) -> str:
    """--ptq for a .tflite: edgeq's observers with one method (auto and converter: min/max)."""
    return options.ptq if options.ptq not in ("auto", "converter") else "minmax"


def convert_float_tflite(path: Path, out: str | Path | None, options: ConvertOptions) -> ConversionResult:
    """Quantize the float .tflite at ``path`` and verify it against the file, output by output."""
    from edgeq.data.sources import load_dataset
    from edgeq.models.load import task_targets
    from edgeq.quantize.mixed import calibrate_float, op_names

    _refused(path, options)
    # LiteRT Quantizer's models have int8 inputs and outputs; --int8 lets the ops it has no int8 kernel for
    # (PRELU) stay float between DEQUANTIZE and QUANTIZE, --int8-only and --int16x8 refuse them
    spec, notes = replace(options.spec, integer_io=True, integer_only=options.spec.mode != Mode.INT8), []
    prepared = prepared_float_model(path.read_bytes(), str(path), options.split_outputs is True)
    if prepared.split:
        notes.append(
            f"output(s) {', '.join(prepared.split)} split into the tensors each concatenated (--split-outputs)"
        )
    if prepared.float16_constants:
        notes.append(f"{prepared.float16_constants} float16 constant(s) read as float32 (their DEQUANTIZE ops removed)")
    if prepared.signature_added:
        notes.append("the file has no signature: edgeq gave it one from its inputs and outputs (serving_default)")
    notes.extend(prepared.notes())
    reference = TFLiteModel(model_content=prepared.content)
    source = _described(reference, path)
    out = Path(out) if out else default_output(path, spec.mode)
    if out.suffix != ".tflite" or out.resolve() == path.resolve():
        raise UsageError(f"{out}: the output must end in .tflite and not overwrite the float model")
    normalization = input_range(options.input_range)
    source = replace(source, normalization=normalization)
    dataset = load_dataset(options.calib, source.input_shape, labels_required=False, normalization=normalization)
    if normalization is not None and dataset.normalization != normalization:
        raise UsageError(
            f"--input-range {options.input_range}: --calib {options.calib} is in its own units (scale "
            f"{dataset.normalization.scale:g}, offset {dataset.normalization.offset:g}); the range applies to 8-bit "
            "images: faces, shapes, images:DIR, coco:, tfrecord: or an .npz of uint8 x"
        )
    dataset.check_fits(source.input_shape, where=f"model {path}")
    dataset.check_finite()
    outputs = source.tasks(options.task, task_targets(dataset, source.output_names))
    held = dataset.held_out(VERIFY_SAMPLES if options.max_drop is None else None, select=0)
    started = time.perf_counter()
    ranges = _plan_ranges(options.plan, options.ptq) if options.plan else _ranges(options)
    samples = dataset.calibration_samples(options.calib_samples)
    cal = calibrate_float(prepared.content, samples, op_names(prepared.content), ranges)
    uneven = uneven_concatenations(prepared.content, cal.calibration)
    joins: list[dict] = []
    if uneven and options.split_outputs is None:
        prepared, cal, joins = _split_uneven(path, prepared, uneven, (samples, ranges), cal, notes)
    else:
        notes.extend(_uneven_note(u) for u in uneven)
    wide = cal.layers if spec.mode == Mode.INT16X8 else _planned_ops(path, options, cal.layers, notes)
    flatbuffer = _integer_edits(cal.quantize(wide, weight_bits=options.weight_bits), notes)
    seconds = time.perf_counter() - started
    notes.append(
        f"LiteRT Quantizer, {ranges} activation ranges (edgeq's observers), "
        f"{'16' if wide else '8'}-bit activations, {options.weight_bits}-bit weights"
    )
    tflite = with_joins(_quantized_model(flatbuffer, path), joins)
    targets = _held_targets(dataset, held, outputs)
    # no labels for a mask, points or a presence score: judged by its task against the float file's answers
    against_float = frozenset(o.name for o in outputs if o.kind in AGAINST_FLOAT and targets.get(o.name) is None)
    try:
        verification = _verify(
            tflite, reference, spec, held, options.calib, options.io_type, source, options.min_sqnr_db, outputs,
            targets, options.max_drop, against_float,
        )  # fmt: skip
    except ConversionError as exc:
        if _free_batch(prepared.content):  # the likeliest cause of float ops left, said in the same line
            raise type(exc)(
                f"{exc}. Note: the file's batch dimension is free, so its Reshape targets are computed at run "
                "time, in float (SHAPE ops): export it with a fixed batch of 1"
            ) from exc
        raise
    run = {"source": source, "is_qat": False, "ptq": None, "seconds": seconds, "model": None, "wide": list(wide),
           "passes": prepared.record(), "joined_outputs": joins}  # fmt: skip
    manifest = _manifest(
        out, flatbuffer, tflite, spec, options, outputs, dataset, options.calib, verification, notes, run
    )
    _commit(out, flatbuffer, manifest, notes, False)
    return conversion_result(out, flatbuffer, manifest, spec, seconds, verification, False, notes)


def _quantized_model(flatbuffer: bytes, path: Path) -> TFLiteModel:
    """The int8 file in the interpreter. One it cannot load is edgeq's doing, never the user's: refused, and
    nothing is written."""
    from edgeq.errors import ModelLoadError

    try:
        return TFLiteModel(model_content=flatbuffer)
    except ModelLoadError as exc:
        why = str(exc).split("cannot load it: ", 1)[-1]
        raise ConversionError(
            f"{path}: edgeq wrote an int8 file this interpreter cannot load ({why}); that is edgeq's bug, not "
            "the model's: nothing was written; please report it with the .tflite, and --int8 may convert meanwhile"
        ) from exc


def _integer_edits(flatbuffer: bytes, notes: list[str]) -> bytes:
    """After LiteRT Quantizer: data-movement ops it left float made int8, int8 HARD_SWISH as ADD/MUL (XNNPACK
    has no int8 kernel for it), each named in the notes."""
    from edgeq.quantize.passes import integer_movers, signature_outputs, unfuse_hard_swish

    flatbuffer, named = signature_outputs(flatbuffer)
    if named:
        notes.append(f"output(s) {', '.join(named)} named by the signature again (LiteRT Quantizer had made a "
                     "float copy the output)")  # fmt: skip
    flatbuffer, moved = integer_movers(flatbuffer)
    if moved:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(moved.items()))
        notes.append(f"{kinds} moved int8 codes instead of floats (LiteRT Quantizer left them float)")
    flatbuffer, swish = unfuse_hard_swish(flatbuffer)
    if swish:
        notes.append(f"{swish} int8 HARD_SWISH op(s) written as ADD/MUL: XNNPACK has no int8 HARD_SWISH kernel")
    return flatbuffer


def input_range(text: str | None) -> Normalization | None:
    """--input-range LO:HI as the normalisation of 8-bit images: LO at 0, HI at 255."""
    if not text:
        return None
    try:
        low, high = (float(v) for v in str(text).split(":"))
    except ValueError:
        raise UsageError(f"--input-range {text!r}: write LO:HI, e.g. -1:1 or 0:1") from None
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        raise UsageError(f"--input-range {text!r}: HI must be above LO")
    return Normalization(scale=(high - low) / 255.0, offset=low, raw_max=255.0)


def _planned_ops(path: Path, options: ConvertOptions, ops: list[str], notes: list[str]) -> list[str]:
    """The ops --plan (analyze plan of this .tflite) puts at 16-bit activations; [] without a plan."""
    if not options.plan:
        return []
    from edgeq.quantize.plan_file import LayerConfig, LayerPrecision

    resolved = LayerConfig.load(options.plan).resolve(ops, LayerPrecision())
    other = [n for n, p in resolved.items() if p.keep_float or p.weight_bits != 8]
    if other:
        raise UsageError(
            f"{options.plan} keeps {', '.join(other[:3])} float or at other weight bits: a .tflite's plan gives ops "
            "16-bit activations only (edgeq analyze plan X.tflite --fallback int16)"
        )
    wide = [n for n, p in resolved.items() if p.activation_bits == 16]
    if wide and options.spec.mode != Mode.INT8_ONLY:
        raise UsageError(f"{options.plan} puts {len(wide)} op(s) at 16-bit activations: convert it with --int8-only")
    notes.append(f"plan {options.plan}: {len(wide)} op(s) at 16-bit activations, every other one int8")
    return wide


PASS_THROUGH = ("RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS")


# One int8 scale for a concatenation gives its smallest part (max |value| s of the whole's S) about
# 255 * s / S steps. Past 16x that is under 16 steps, 4 bits: a 0..1 score then moves in steps of 1/16 or
# coarser, enough to flip a detector's 0.5 threshold and to cost its mAP (MediaPipe's face detector, 71x).
SPLIT_RATIO = 16.0


@dataclass(frozen=True)
class Uneven:
    """An output a CONCATENATION writes whose parts' calibrated ranges differ more than SPLIT_RATIO."""

    output: str  # as the signature names it
    tensor: str
    op: int
    spans: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return max(self.spans) / max(min(self.spans), 1e-12)


def uneven_concatenations(content: bytes, calibration: dict, ratio: float = SPLIT_RATIO) -> list[Uneven]:
    """Outputs made by a CONCATENATION of tensors whose calibrated ranges differ more than ``ratio``: in
    one int8 tensor (one scale) the small ones (YOLO's scores beside its pixel boxes) round to a few steps."""
    from edgeq.runtime.flatbuffer import verify_tflite

    desc = verify_tflite(content, "the float model")
    main = desc.main
    shown = {t: n for sig in desc.signatures[:1] for n, t in sig.outputs.items()}  # the names a reader sees
    producer = {t: op for op in main.operators for t in op.outputs}
    found = []
    for output in main.outputs:
        op = producer.get(output)
        while op is not None and op.op_type in PASS_THROUGH and op.inputs:
            op = producer.get(op.inputs[0])
        if op is None or op.op_type != "CONCATENATION":
            continue
        names = [main.tensors[i].name for i in op.inputs if i >= 0]
        spans = [max(abs(float(np.min(calibration[n]["min"]))), abs(float(np.max(calibration[n]["max"]))))
                 for n in names if n in calibration]  # fmt: skip
        if len(spans) >= 2 and max(spans) > ratio * max(min(spans), 1e-12):
            found.append(Uneven(shown.get(output, main.tensors[output].name), main.tensors[output].name, op.index,
                                tuple(spans)))  # fmt: skip
    return found


def _concatenation_outputs(content: bytes) -> set[int]:
    """The CONCATENATION ops that write a graph output themselves (what --split-outputs splits)."""
    from edgeq.runtime.flatbuffer import verify_tflite

    main = verify_tflite(content, "the float model").main
    return {op.index for op in main.operators if op.op_type == "CONCATENATION" and set(op.outputs) & set(main.outputs)}


def _uneven_note(u: Uneven) -> str:
    return (
        f"output {u.output!r} concatenates tensors whose ranges differ {u.ratio:.0f}x (max |value| "
        f"{', '.join(f'{s:.3g}' for s in u.spans)}) in op {u.op} CONCATENATION: one int8 scale rounds the small "
        "ones to a few steps; convert without --no-split-outputs (each part its own scale), or export the model "
        "with them apart"
    )


def _split_uneven(path: Path, prepared, uneven: list[Uneven], calibration: tuple, cal, notes: list[str]):
    """Each uneven output split into its parts (each its own int8 scale), calibrated again; the joins say
    how eval, profile and verification read the parts back as the file's one output."""
    from edgeq.quantize.mixed import calibrate_float, op_names

    split = prepared_float_model(path.read_bytes(), str(path), {u.tensor for u in uneven})
    if not split.joins:  # a concatenation behind a RESHAPE: the output is not the op's own, left as it is
        notes.extend(_uneven_note(u) for u in uneven)
        return prepared, cal, []
    samples, ranges = calibration
    cal = calibrate_float(split.content, samples, op_names(split.content), ranges)
    # both in the graph's output order; a concatenation behind a RESHAPE is not split
    found = [u for u in uneven if u.op in _concatenation_outputs(prepared.content)]
    for (name, parts, _), u in zip(split.joins, found):
        notes.append(
            f"output {name!r} split into its {len(parts)} concatenated parts, each its own int8 scale: their "
            f"ranges differ {u.ratio:.0f}x (> {SPLIT_RATIO:g}x); eval, profile and verification join "
            "them back (manifest joined_outputs; --no-split-outputs keeps one tensor)"
        )
    return split, cal, [{"output": n, "parts": list(p), "axis": a} for n, p, a in split.joins]


def _free_batch(content: bytes) -> bool:
    from edgeq.runtime.flatbuffer import verify_tflite

    desc = verify_tflite(content, "the float model")
    return any(desc.main.tensors[i].dynamic for i in desc.main.inputs)


def _described(reference: TFLiteModel, path: Path) -> ModelSpec:
    """The float file's ModelSpec, named by the file; a free (-1) input dimension is refused."""
    source = _with_activations(describe_tflite(reference, path), reference)
    free = [t.name for t in source.inputs if any(d is None or d < 1 for d in t.shape)]
    if free:
        raise UsageError(f"{path}: input {free[0]!r} has a free dimension: export the model with a fixed input shape")
    return source


_ACTIVATION_OPS = {"LOGISTIC": "sigmoid", "SOFTMAX": "softmax"}


def _with_activations(source: ModelSpec, reference: TFLiteModel) -> ModelSpec:
    """The float file's outputs with the activation that ends each (LOGISTIC: sigmoid, SOFTMAX), looked
    for through reshapes: what infers a presence score as binary and a per-pixel mask as segmentation."""
    from edgeq.runtime.flatbuffer import verify_tflite

    desc = reference.description or verify_tflite(reference.model_content, "the float model")
    main = desc.main
    producer = {t: op for op in main.operators for t in op.outputs}
    by_tensor = {t: n for sig in desc.signatures[:1] for n, t in sig.outputs.items()}
    found = {}
    for output in main.outputs:
        op = producer.get(output)
        while op is not None and op.op_type in PASS_THROUGH and op.inputs:
            op = producer.get(op.inputs[0])
        if op is not None and op.op_type in _ACTIVATION_OPS:
            found[by_tensor.get(output, main.tensors[output].name)] = _ACTIVATION_OPS[op.op_type]
    outputs = tuple(replace(t, activation=found.get(t.name, t.activation)) for t in source.outputs)
    return replace(source, outputs=outputs)
