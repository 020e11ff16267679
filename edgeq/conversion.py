"""Keras -> TFLite through one table of conversion modes, verified before it is written.

Every conversion is loaded back into LiteRT, checked against what its mode promises
(I/O dtypes, integer-only graph) and compared with the source model on real samples.
Only then are the model and its manifest moved into place; a failure leaves no file.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from edgeq.artifacts import provenance, sha256_bytes, sha256_file, write_bytes_atomic, write_json_atomic
from edgeq.data import DEFAULT_CALIBRATION_SAMPLES, Dataset, HeldOut, Normalization, load_dataset
from edgeq.errors import ConversionError, DataError, IntegerOnlyError, UsageError
from edgeq.quantize.numerics import ROUNDINGS
from edgeq.quantize.ranges import ACTIVATION_METHODS, WEIGHT_METHODS
from edgeq.runtime.flatbuffer import precision_counts, verify_tflite
from edgeq.runtime.inputs import ROUNDING as INPUT_ROUNDING
from edgeq.runtime.inputs import manifest_beside
from edgeq.runtime.interpreter import TFLiteModel
from edgeq.tasks.metrics import compare_outputs
from edgeq.tasks.table import TASKS, task
from edgeq.tasks.verdicts import NothingJudged, Verdict, judge

log = logging.getLogger(__name__)


class Mode(str, Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    DYNAMIC = "dynamic"
    INT8 = "int8"
    INT8_ONLY = "int8-only"
    INT16X8 = "int16x8"
    INT4_WEIGHTS = "int4-weights"
    INT4_DYNAMIC = "int4-dynamic"


@dataclass(frozen=True)
class ModeSpec:
    mode: Mode
    help: str
    suffix: str  # default file name: <model stem>_<suffix>.tflite
    calibrate: bool  # needs a representative dataset
    integer_only: bool  # refuse any float op or tensor on the inference path
    integer_io: bool  # int8 (or uint8) input and output tensors
    min_sqnr_db: float  # verification: output SQNR vs the source model must reach this
    backend: str = "tflite"  # its exporter, a key of EXPORTERS: "tflite" (TFLiteConverter), "aeq" (LiteRT Quantizer)


# The one table: CLI flags, validation, file names and verification all read it.
MODES: dict[Mode, ModeSpec] = {
    Mode.FP32: ModeSpec(Mode.FP32, "float32 TFLite, no quantization", "fp32", False, False, False, 40.0),
    Mode.FP16: ModeSpec(Mode.FP16, "float16 weights, float compute", "fp16", False, False, False, 30.0),
    Mode.DYNAMIC: ModeSpec(
        Mode.DYNAMIC, "dynamic-range: int8 weights, float activations", "dynamic", False, False, False, 10.0
    ),
    Mode.INT8: ModeSpec(
        Mode.INT8, "full integer with float I/O (float fallback allowed)", "int8", True, False, False, 10.0
    ),
    Mode.INT8_ONLY: ModeSpec(
        Mode.INT8_ONLY,
        "integer-only: TFLITE_BUILTINS_INT8, int8 I/O, refuses float ops",
        "int8_only",
        True,
        True,
        True,
        10.0,
    ),
    Mode.INT16X8: ModeSpec(Mode.INT16X8, "16-bit activations, 8-bit weights", "int16x8", True, False, False, 15.0),
    Mode.INT4_WEIGHTS: ModeSpec(
        Mode.INT4_WEIGHTS,
        "INT4 weight-only (LiteRT Quantizer), float compute",
        "int4w",
        False,
        False,
        False,
        5.0,
        "aeq",
    ),
    Mode.INT4_DYNAMIC: ModeSpec(
        Mode.INT4_DYNAMIC,
        "INT4 weights, dynamic-range activations (LiteRT Quantizer)",
        "int4dyn",
        False,
        False,
        False,
        5.0,
        "aeq",
    ),
}

# --int4-granularity: LiteRT Quantizer's weight granularities.
INT4_GRANULARITIES = {
    "channel": "CHANNELWISE",
    "block32": "BLOCKWISE_32",
    "block64": "BLOCKWISE_64",
    "block128": "BLOCKWISE_128",
    "block256": "BLOCKWISE_256",
}

FLOAT_DTYPES = {"float32", "float16", "float64"}
VERIFY_SAMPLES = 200  # held-out samples verification compares on (and a --ptq search chooses on)

# --ptq: who chooses the ranges of integer post-training quantization. "converter" is the
# TFLite converter's own min/max calibration; the others re-choose each calibrated min/max by
# edgeq's methods (edgeq.quantize.calibration.ActivationRanges). "minmax" is not quite the
# converter's ranges: TFLite's calibrator logs an op's inputs after the op ran, so a tensor that
# an in-place op consumes (a residual ADD's branch) can get that op's output values in its range;
# edgeq observes every tensor as it was. "auto" converts with the converter's ranges first and
# stops there when the SQNR reaches the target (the verification threshold unless --ptq-target
# raises it), so a model the converter handles well costs one conversion; otherwise edgeq's
# methods are converted in turn until one does, and the best is kept.
PTQ_AUTO = ("converter", "minmax", "percentile", "mse", "entropy")
PTQ_METHODS = ("auto", "converter", *ACTIVATION_METHODS)
ROUNDING_METHODS = (*ROUNDINGS, "adaround")  # adaround: edgeq.transforms.adaround


@dataclass(frozen=True)
class Verification:
    samples: int
    data: str  # where the samples came from
    agreement: float | None  # top-1 agreement with the source model (None: no output is classes)
    max_abs_error: float
    mean_abs_error: float
    sqnr_db: float
    min_sqnr_db: float
    float_ops: tuple[str, ...]
    integer_only: bool
    passed: bool
    classes: int | None = None  # classes among the samples (None: unlabelled or not class ids)
    outputs: tuple[dict, ...] = ()  # each output by name: task, SQNR, its threshold, agreement, passed


@dataclass(frozen=True)
class ConversionResult:
    path: Path
    manifest: Path
    mode: str
    size_bytes: int
    seconds: float
    sha256: str
    input: dict
    output: dict
    ops: dict[str, int]
    verification: Verification
    source_is_qat: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    edgetpu: dict | None = None  # compatibility check and compiler result, with --edgetpu
    outputs: tuple[dict, ...] = ()  # each output: name, task, dtype, quantization


def default_output(source: str | Path, mode: Mode) -> Path:
    source = Path(source)
    return source.with_name(f"{source.stem if source.is_file() else source.name}_{MODES[mode].suffix}.tflite")


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


def _calibration(source_path, model_input_shape, calib: str | None, n: int, is_qat: bool, notes: list):
    """Calibration samples: --calib, else the data the model was trained on (run.json)."""
    from edgeq.models.load import recorded_normalization, run_record_for

    record = run_record_for(source_path) if source_path else None
    spec = calib
    if spec is None and record is not None:
        spec = record.get("data", {}).get("source")
    if spec is None:
        return None, None
    if not calib:
        notes.append(f"calibration/verification data taken from the training run: {spec}")
    normalization = recorded_normalization(source_path)
    # raw files in the units the model was trained in; float files checked against them
    shape = model_input_shape if isinstance(model_input_shape, dict) else tuple(model_input_shape)
    dataset = load_dataset(spec, shape, labels_required=False, normalization=normalization)
    dataset.check_fits(shape, where=f"model {source_path}")
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


@dataclass(frozen=True)
class ConvertOptions:
    """How to convert: built by the CLI from its flags and by Python callers alike.

    The mode is a row of MODES; every other field refines it. Combinations that cannot
    work are refused when the options are made, before any model is loaded.
    """

    mode: Mode = Mode.INT8_ONLY
    calib: str | None = None  # representative data source; None: the training run's (run.json)
    calib_samples: int = DEFAULT_CALIBRATION_SAMPLES
    granularity: str = "per-channel"  # PTQ weights: per-channel | per-tensor
    io_type: str = "int8"  # --int8-only I/O: int8 | uint8
    min_sqnr_db: float | str | None = None  # verification threshold (dB, or NAME=DB,...); None: the mode's
    edgetpu: bool = False
    equalize: bool = False
    plan: str | None = None  # layer-wise plan (analyze plan): those layers stay float
    int4_granularity: str = "channel"
    bias_correct: bool = False
    ptq: str = "auto"  # integer PTQ ranges: auto | converter | minmax | percentile | mse | entropy
    weight_ranges: str = "minmax"  # edgeq's PTQ weight ranges per channel: minmax | mse
    rounding: str = "nearest"  # edgeq's PTQ weight rounding: nearest | stochastic | adaround
    weight_bits: int = 8  # 4: W4A8, per-channel 4-bit weight codes ([-7, 7]) inside int8 kernels
    seed: int = 0  # stochastic rounding's and AdaRound's seed (recorded in the manifest)
    ptq_target_db: float | None = None  # --ptq auto stops at the first candidate this good; None: min_sqnr_db
    input_shape: str | None = None  # --input-shape HxWxC (or NAME=HxWxC,...): fixes a fully convolutional input
    task: str | None = None  # --task KIND | NAME=KIND,... | tasks.json: what each output is (else inferred)
    # --max-drop: outputs with a task metric are verified by it on labelled held-out samples (Verdict), not SQNR
    max_drop: float | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError as exc:
            raise UsageError(f"unknown mode {self.mode!r}; choose one of: {', '.join(m.value for m in Mode)}") from exc
        if self.plan is not None:
            object.__setattr__(self, "plan", str(self.plan))
        spec = self.spec
        if self.io_type not in ("int8", "uint8"):
            raise UsageError(f"--io-type must be int8 or uint8, got {self.io_type!r}")
        if self.io_type == "uint8" and not spec.integer_io:
            raise UsageError("--io-type uint8 applies to --int8-only")
        if self.int4_granularity not in INT4_GRANULARITIES:
            raise UsageError(f"--int4-granularity must be one of {', '.join(INT4_GRANULARITIES)}")
        if self.edgetpu and spec.mode != Mode.INT8_ONLY:
            raise UsageError("--edgetpu needs --int8-only: the Edge TPU runs only fully integer models")
        if self.granularity not in ("per-channel", "per-tensor"):
            raise UsageError(f"--granularity must be per-channel or per-tensor, got {self.granularity!r}")
        if self.bias_correct and not spec.calibrate:
            raise UsageError("--bias-correct corrects integer PTQ: use it with --int8, --int8-only or --int16x8")
        if self.ptq not in PTQ_METHODS:
            raise UsageError(f"--ptq must be one of {', '.join(PTQ_METHODS)}, got {self.ptq!r}")
        if self.weight_ranges not in WEIGHT_METHODS:
            raise UsageError(f"--weight-ranges must be one of {', '.join(WEIGHT_METHODS)}, got {self.weight_ranges!r}")
        if self.rounding not in ROUNDING_METHODS:
            raise UsageError(f"--rounding must be one of {', '.join(ROUNDING_METHODS)}, got {self.rounding!r}")
        if self.rounding != "nearest" and (
            not spec.calibrate or spec.mode == Mode.INT16X8 or self.ptq == "converter" or self.plan
        ):
            raise UsageError(
                f"--rounding {self.rounding} rounds the weights of edgeq's integer PTQ: use it with --int8 or "
                "--int8-only and --ptq auto|minmax|percentile|mse|entropy (not converter, --plan or --int16x8)"
            )
        if self.bias_correct and (self.weight_ranges != "minmax" or self.rounding != "nearest"):
            # The correction is (W_q - W) E[x] for the weights the converter would store: min/max
            # per-channel scales, rounded to nearest. Other weights would get the wrong shift.
            raise UsageError(
                "--bias-correct corrects for min/max weights rounded to nearest, but --weight-ranges "
                f"{self.weight_ranges} --rounding {self.rounding} deploys other weights: drop --bias-correct "
                "(AdaRound already corrects the layer outputs) or use --weight-ranges minmax --rounding nearest"
            )
        if self.weight_bits not in (4, 8):
            raise UsageError(f"--weight-bits must be 4 or 8, got {self.weight_bits}")
        if self.weight_bits == 4:
            if spec.mode not in (Mode.INT8, Mode.INT8_ONLY):
                raise UsageError("--weight-bits 4 (W4A8) is integer PTQ: use it with --int8-only or --int8")
            if self.ptq == "converter" or self.plan or self.bias_correct or self.granularity != "per-channel":
                raise UsageError(
                    "--weight-bits 4 rounds per-channel 4-bit codes with edgeq's ranges: drop --ptq converter, "
                    "--plan, --bias-correct and --granularity per-tensor"
                )
        if self.plan and spec.mode not in (Mode.INT8, Mode.INT8_ONLY):
            raise UsageError(
                "--plan converts with --int8 (layers kept float: float I/O, float fallback) or, for a plan of "
                "16-bit layers (analyze plan --fallback int16), --int8-only"
            )

    @property
    def spec(self) -> ModeSpec:
        return MODES[self.mode]


def convert(model: Any, out: str | Path | None = None, options: ConvertOptions | None = None) -> ConversionResult:
    """Convert a Keras model (object or .keras/.h5/SavedModel path) and verify the result.

    Returns the written model's description; raises ConversionError (IntegerOnlyError
    for float ops in an integer-only model) and leaves nothing on disk when it fails.
    """
    from edgeq.models.load import as_tf_keras, concatenated_outputs, output_specs, with_input_shape
    from edgeq.training.schemes import is_qat_model

    options = options or ConvertOptions()
    spec = options.spec
    calib, calib_samples = options.calib, options.calib_samples
    io_type, equalize, plan, bias_correct = options.io_type, options.equalize, options.plan, options.bias_correct
    keras_model, source_path = _load_source(model)
    source_name = str(source_path) if source_path else keras_model.name
    is_qat = is_qat_model(keras_model)
    if options.input_shape:
        if is_qat:
            raise UsageError(f"{source_name}: a QAT model keeps the shape it trained with: edgeq train --input-shape")
        keras_model = with_input_shape(keras_model, options.input_shape, source_name)
    reference_model = keras_model  # verification compares with this, whatever --equalize/--bias-correct change
    notes: list[str] = []
    if is_qat:
        keras_model, is_qat = _sixteen_bit_qat(keras_model, source_path, spec, notes)
    shapes, single_io = _checked_source(keras_model, source_name, is_qat, options)
    if equalize or plan or bias_correct:  # graph transforms work on tf_keras: a Keras 3 model is translated
        keras_model = as_tf_keras(keras_model)
    input_shape = next(iter(shapes.values())) if len(shapes) == 1 else shapes
    out = Path(out) if out else default_output(source_path or Path(f"{keras_model.name}.keras"), spec.mode)
    if out.suffix != ".tflite":
        raise UsageError(f"{out}: the output must end in .tflite")

    if plan:
        _check_wide_plan(keras_model, plan, options)
    dataset, data_spec = _calibration(source_path, input_shape, calib, calib_samples, is_qat, notes)
    hint = _input_rescaling_hint(keras_model, dataset, calib_samples) if dataset is not None and single_io else None
    if hint:
        notes.append(hint)
    keras_model = _pretransformed(keras_model, dataset, options, notes)
    _check_data(spec, dataset, data_spec, is_qat, source_name)

    searching = spec.calibrate and spec.mode != Mode.INT16X8 and not is_qat and options.ptq != "converter"
    outputs = output_specs(reference_model, options.task, source_path, dataset)
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
    route = {"searching": searching, "is_qat": is_qat, "source_name": source_name}
    # a model whose every output is classes: --ptq candidates are chosen by their answers (top-1 agreement)
    route["by_answers"] = all(TASKS[o.kind].classes for o in outputs)
    flatbuffer, ptq_record = _quantize(keras_model, reference_model, spec, dataset, options, held, route, notes)
    seconds = time.perf_counter() - started

    # verified with the kernels that run it on a device and in eval and profile (LiteRT's default, XNNPACK):
    # on a trained EfficientNetB0 the built-in int8 kernels read 57.10% on val where XNNPACK reads 59.43%
    tflite = TFLiteModel(model_content=flatbuffer)
    try:
        verification = _verify(
            tflite, reference_model, spec, held, data_spec, io_type, source_name, options.min_sqnr_db, outputs,
            _held_targets(dataset, held, outputs), options.max_drop,
        )  # fmt: skip
    except ConversionError as exc:
        if hint:  # the likeliest cause of a failed verification, said in the same line
            raise ConversionError(f"{exc}. Note: {hint}") from exc
        raise
    manifest = _manifest(
        out, flatbuffer, tflite, spec, options, outputs, dataset, data_spec, verification, notes,
        {"source_path": source_path, "is_qat": is_qat, "ptq": ptq_record, "seconds": seconds, "model": keras_model},
    )  # fmt: skip
    _commit(out, flatbuffer, manifest, notes, options.edgetpu)
    return ConversionResult(
        path=out,
        manifest=manifest_beside(out),
        mode=spec.mode.value,
        size_bytes=len(flatbuffer),
        seconds=round(seconds, 3),
        sha256=manifest["sha256"],
        input=manifest["input"],
        output=manifest["output"],
        outputs=tuple(manifest["outputs"]),
        ops=manifest["ops"],
        verification=verification,
        source_is_qat=is_qat,
        notes=tuple(notes),
        edgetpu=manifest.get("edgetpu"),
    )


def _checked_source(keras_model, source_name: str, is_qat: bool, options: ConvertOptions) -> tuple[dict, bool]:
    """The model's input shapes and whether it has one input and one output; refuses what
    these options cannot do with this model (a QAT model's bits, free input dimensions...)."""
    from edgeq.models.load import input_shapes

    transforms = options.equalize or options.plan or options.bias_correct
    if options.weight_bits != 8 and is_qat:
        raise UsageError(f"{source_name} is a QAT model: its weight bits are the ones it trained with (--weight-bits)")
    if transforms and is_qat:
        raise UsageError(
            f"{source_name}: --equalize, --bias-correct and --plan are post-training tools; give the FP32 model"
        )
    shapes = input_shapes(keras_model)
    free = {name: shape for name, shape in shapes.items() if any(d is None for d in shape)}
    if free:
        name, shape = next(iter(free.items()))
        example = "x".join(str(d if d is not None else 224) for d in shape)
        example = example if len(shapes) == 1 else f"{name}={example}"
        raise ConversionError(
            f"{source_name}: input {name!r} has shape {tuple(shape)}, with free dimensions (a fully convolutional "
            f"model): fix them for your camera with --input-shape {example}"
        )
    single_io = len(shapes) == 1 and len(keras_model.outputs) == 1
    if transforms and not single_io:
        raise UsageError(
            f"{source_name} has {len(shapes)} input(s) and {len(keras_model.outputs)} output(s): --equalize, "
            "--bias-correct and --plan take one-input one-output models; convert it without them "
            "(--ptq METHOD, --rounding and --weight-bits take any model)"
        )
    return shapes, single_io


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


def _manifest(out, flatbuffer, tflite, spec, options, outputs, dataset, data_spec, verification, notes, run) -> dict:
    """What the model's manifest records: the contract a device reads, how it was made, what was verified.

    ``run``: the conversion's own facts (``source_path``, ``is_qat``, ``ptq``, ``seconds``, ``model``).
    """
    source_path, is_qat, ptq_record, seconds = run["source_path"], run["is_qat"], run["ptq"], run["seconds"]
    keras_model, plan, granularity = run["model"], options.plan, options.granularity
    equalize, io_type, calib_samples = options.equalize, options.io_type, options.calib_samples
    op_counts = dict(Counter(op.op_name for op in tflite.ops()))
    if dataset is not None:
        normalization = dataset.normalization
    else:
        from edgeq.models.load import recorded_normalization

        normalization = recorded_normalization(source_path) or Normalization()
    manifest = {
        "kind": "edgeq.convert",
        "model": out.name,
        "mode": spec.mode.value,
        "mode_help": spec.help,
        "sha256": sha256_bytes(flatbuffer),
        "size_bytes": len(flatbuffer),
        "input": asdict(tflite.input),
        "output": asdict(tflite.output_named(outputs[0].name)),
        # every tensor by its name (the Keras model's = the .tflite signature's), with what it means
        "inputs": [{**asdict(t), "name": n, "tensor": t.name} for n, t in zip(tflite.input_names, tflite.inputs)],
        "outputs": [
            {
                **o.to_dict(),
                **{k: v for k, v in asdict(tflite.output_named(o.name)).items() if k != "name"},
                "tensor": tflite.output_named(o.name).name,
            }
            for o in outputs
        ],  # fmt: skip
        "normalization": normalization.to_dict(),
        # the input contract (edgeq.runtime.inputs): float sample = raw * scale + offset; the model's
        # integer input = clamp(round(float sample / input scale) + zero point), rounded like TFLite
        "input_rounding": INPUT_ROUNDING,
        "num_classes": _num_classes(outputs),
        # a detector: which heads, in which layout, decoded and NMS'd outside the int8 graph (edgeq.tasks.detection)
        "detection": _detection_record(outputs, dataset),
        "source": {
            "path": str(source_path) if source_path else None,
            "sha256": sha256_file(source_path) if source_path else None,
            "qat": is_qat,
        },
        "options": {
            "granularity": granularity,
            "int4_granularity": options.int4_granularity if spec.backend == "aeq" else None,
            "equalize": equalize,
            "plan": str(plan) if plan else None,
            "io_type": io_type if spec.integer_io else "float32",
            "calib": data_spec,
            "calib_samples": calib_samples if spec.calibrate else 0,
            "ptq": options.ptq if spec.calibrate and not is_qat else None,
            "weight_bits": options.weight_bits,
        },
        "calibration_data_sha256": dataset.fingerprint() if dataset is not None else None,
        "calibration_samples": _calibration_record(dataset, calib_samples) if spec.calibrate else None,
        "ptq": ptq_record,
        "ops": op_counts,
        # ops by what they compute in (QUANTIZE ops counted by their output): int8, int16 (16x8), float
        "precision": precision_counts(verify_tflite(flatbuffer, "the converted model")),
        "wide_layers": _plan_wide_layers(keras_model, plan) if plan else [],
        "verification": asdict(verification),
        "convert_seconds": round(seconds, 3),
        "notes": notes,
        "provenance": provenance(),
    }
    return manifest


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


def _check_held_out(held, dataset, choosing: bool, ptq: str) -> None:
    """Refuse, naming the sizes, data too small to verify on (or, for a --ptq search, to choose on too)."""
    from edgeq.data import size

    if size(held.x) and not (choosing and held.x_select is None):
        return
    need = f"--ptq {ptq} chooses ranges on one half of it and verification gates on the other" if choosing else (
        "verification needs at least one sample"
    )  # fmt: skip
    raise DataError(
        f"data {dataset.source!r} is too small: its {held.split} split holds {dataset.count(held.split)} sample(s) "
        f"({dataset.count('train')} train) and {need}; give more data, or --ptq converter"
    )


def _convert_searching_ranges(
    keras_model, reference_model, spec: ModeSpec, dataset, options: ConvertOptions, held: HeldOut, by_answers=False
):
    """Integer PTQ by each --ptq candidate; the best by SQNR against FP32 on held-out samples (``by_answers``,
    a classifier: by top-1 agreement with FP32, then SQNR: it is judged by its answers, not its logits).

    Every candidate is a real conversion, measured in LiteRT. ``converter`` is the converter's
    own calibration; each of edgeq's methods is the same conversion with every calibrated
    min/max re-chosen by that method (``ActivationRanges``: one calibration and one observation
    pass serve them all, as they serve ``analyze``). With edgeq's weights (--weight-ranges,
    --rounding, --weight-bits) every candidate carries the same chosen codes. Candidates are
    tried in order until one reaches the target; the best measured is kept, so ``auto`` is
    never worse than the converter on the samples checked. Those samples (``held.x_select``)
    are disjoint from the ones verification then gates and records.
    Returns the flatbuffer and the manifest's record of every candidate (and a note).
    """
    import contextlib

    from edgeq.models.load import keras_outputs
    from edgeq.quantize.calibration import ActivationRanges
    from edgeq.quantize.passes import with_weight_codes

    methods = PTQ_AUTO if options.ptq == "auto" else (options.ptq,)
    target = options.ptq_target_db
    if target is None:
        target = spec.min_sqnr_db if options.min_sqnr_db is None else float(options.min_sqnr_db)
    weights = _chosen_weights(keras_model, dataset, options)
    if weights is not None:  # the converter rounds to nearest, at 8 bits, by min/max: only edgeq's candidates
        methods = tuple(m for m in methods if m != "converter")
    model = weights.model if weights is not None else keras_model
    x_check, split = held.x_select, held.split
    reference = keras_outputs(reference_model, x_check)  # by output name
    ranges = ActivationRanges(dataset.calibration_samples(options.calib_samples))
    candidates, best, stopped_at = [], None, None
    for method in methods:
        start = time.perf_counter()
        try:
            with contextlib.nullcontext() if method == "converter" else ranges.ranged(method):
                flatbuffer, _ = _convert_tflite(model, spec, dataset, options, False)
            if weights is not None:
                flatbuffer, folded = with_weight_codes(flatbuffer, weights.kernels)
                weights.record["converter_folded"] = folded
            got = TFLiteModel(model_content=flatbuffer).predict_outputs(x_check)
            # several outputs (a detector's heads): the worst one decides, as in verification
            cmp = min((compare_outputs(reference[n], got[n]) for n in reference), key=lambda c: c.sqnr_db)
        except (UsageError, DataError):
            raise
        except Exception as exc:  # one candidate failing must not hide the others
            if len(methods) == 1:
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            candidates.append({"method": method, "error": first, "seconds": round(time.perf_counter() - start, 3)})
            continue
        candidates.append(_candidate(method, cmp, start, by_answers))
        key = (cmp.agreement, cmp.sqnr_db) if by_answers else (cmp.sqnr_db,)
        if best is None or key > best[1]:
            best = (method, key, flatbuffer)
        if cmp.sqnr_db >= target and method != methods[-1]:
            stopped_at = target  # good enough: the rest are not tried
            break
    if best is None:
        raise ConversionError(
            f"every --ptq candidate failed: {'; '.join(c['method'] + ': ' + c['error'] for c in candidates)}"
        )
    tried = ", ".join(_described(c) for c in candidates)
    by = f"top-1 agreement with FP32 ({best[1][0]:.1%}), then SQNR," if by_answers else "SQNR vs FP32"
    note = (
        f"--ptq {options.ptq}: {best[0]} ranges chosen by {by} on {_count(x_check)} {split} samples, "
        f"not those verification uses ({tried}"
        f"{'; stopped at the target ' + format(stopped_at, '.1f') + ' dB' if stopped_at is not None else ''})"
    )
    rounding = {"method": "nearest", "seed": None, "layers": []}
    if weights is not None:
        rounding, note = weights.record, note + _weights_note(weights.record)
    record = {
        "requested": options.ptq,
        "chosen": best[0],
        "target_db": target,
        "chosen_by": "agreement, sqnr_db" if by_answers else "sqnr_db",
        "weight_ranges": options.weight_ranges,
        "rounding": rounding,
        "checked_on": f"{len(x_check)} {split} samples",
        "checked_on_classes": held.classes_select,
        "candidates": candidates,
        "note": note,
    }
    return best[2], record


def _chosen_weights(keras_model, dataset, options: ConvertOptions):
    """edgeq's weight codes (edgeq.quantize.ptq) when the options ask for other than the converter's."""
    if options.weight_ranges == "minmax" and options.rounding == "nearest" and options.weight_bits == 8:
        return None
    from edgeq.models.load import as_tf_keras
    from edgeq.quantize.ptq import choose_weights

    return choose_weights(
        as_tf_keras(keras_model),
        dataset.calibration_samples(options.calib_samples),
        options.weight_ranges,
        options.rounding,
        options.seed,
        options.weight_bits,
        options.granularity == "per-tensor",
    )


def _weights_note(record: dict) -> str:
    layers = record["layers"]
    note = (
        f"; {record['weight_bits']}-bit weights, {record['weight_ranges']} ranges, rounded by {record['method']} "
        f"(seed {record['seed']}) in {len(layers)} layers"
    )
    if record.get("converter_weights"):
        kept = record["converter_weights"]
        note += f"; {len(kept)} other kernel(s) left to the converter (8-bit, min/max): {', '.join(kept[:4])}"
    if record.get("converter_folded"):
        folded = record["converter_folded"]
        note += (
            f"; the converter folded a scale into {len(folded)} filter(s), which keep its 8-bit codes: "
            f"{', '.join(folded[:4])}"
        )
    if record["method"] == "adaround" and layers:
        before = float(np.mean([la["output_mse_nearest"] for la in layers]))
        after = float(np.mean([la["output_mse"] for la in layers]))
        note += f", mean layer output MSE {before:.3g} -> {after:.3g} vs nearest"
    return note


def _calibration_record(dataset: Dataset, n: int) -> dict:
    """Which train samples calibration drew: how many, and how many classes they cover."""
    from edgeq.data import classes_covered

    indices = dataset.calibration_indices(n)
    return {
        "split": "train",
        "samples": len(indices),
        "classes": classes_covered(dataset.labels("train"), indices),
        "draw": "stratified by class, seed 0",
    }


def _candidate(method: str, cmp, start: float, classes: bool) -> dict:
    """A candidate converted and measured in LiteRT (seconds: since its work began); top-1 agreement
    only where the outputs are classes (a box or a value has no top-1)."""
    return {
        "method": method,
        "sqnr_db": round(cmp.sqnr_db, 3),
        "agreement": round(cmp.agreement, 6) if classes else None,
        "seconds": round(time.perf_counter() - start, 3),
    }


def _described(c: dict) -> str:
    return f"{c['method']} {c['sqnr_db']:.1f} dB" if "sqnr_db" in c else f"{c['method']} failed"


def _sixteen_bit_qat(keras_model, source_path, spec: ModeSpec, notes: list[str]):
    """A QAT model that simulates 16-bit activations converts only to 16x8, and only by PTQ.

    TF 2.21's converter quantizes no QAT graph to 16x8 ("not yet supported for op:
    DEQUANTIZE"), so the float weights QAT fine-tuned (qat_float.keras, beside qat.h5)
    are converted with 16x8 post-training quantization instead.
    """
    from edgeq.models.load import QAT_FLOAT_NAME, load_user_model
    from edgeq.training.schemes import activation_bits_of

    if 16 not in activation_bits_of(keras_model):
        return keras_model, True
    where = source_path or keras_model.name
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


def _commit(out: Path, flatbuffer: bytes, manifest: dict, notes: list[str], edgetpu: bool) -> None:
    """Write a verified conversion's files together: all of them, or none.

    Everything (model, manifest, and with --edgetpu the compiler's model and log) is written
    and fsynced in a hidden folder beside ``out`` first; a failure there (the compiler's
    included) leaves nothing behind. Then each file is renamed into place, the model last:
    a model on disk always has its companions beside it.
    """
    import os
    import tempfile

    from edgeq.artifacts import fsync_path

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as folder:
        stage = Path(folder)
        staged = stage / out.name
        write_bytes_atomic(staged, flatbuffer)
        if edgetpu:
            report = _edgetpu(staged, flatbuffer, notes)
            compiler = report.get("compiler")
            if compiler:  # name the files where they will be, not where they were made
                for key in ("output", "log"):
                    if compiler.get(key):
                        compiler[key] = str(out.parent / Path(compiler[key]).name)
            manifest["edgetpu"] = report
            manifest["notes"] = notes
        write_json_atomic(stage / manifest_beside(out).name, manifest)
        companions = sorted(p for p in stage.iterdir() if p.name != out.name and not p.name.startswith("."))
        for path in companions:
            fsync_path(path)
        for path in companions:
            os.replace(path, out.parent / path.name)
        os.replace(staged, out)
        fsync_path(out.parent)


def _edgetpu(path: Path, flatbuffer: bytes, notes: list[str]) -> dict:
    """Edge TPU compatibility from the flatbuffer; edgetpu_compiler's verdict when it is here."""
    from edgeq.runtime.edgetpu import check_edgetpu, find_edgetpu_compiler, run_edgetpu_compiler

    report = check_edgetpu(verify_tflite(flatbuffer, str(path)))
    first = report.first_fallback
    result: dict[str, Any] = {
        "compatible": report.compatible,
        "ops_checked": report.ops_checked,
        "ops_mappable": report.ops_mappable,
        "first_fallback": None
        if first is None
        else {"index": first.index, "op": first.op_type, "reasons": list(first.reasons)},
        "compiler": None,
    }
    if first is not None:
        notes.append(
            f"Edge TPU: op {first.index} ({first.op_type}) would fall back to the CPU: {'; '.join(first.reasons)}"
        )
    if find_edgetpu_compiler() is None:
        notes.append(
            "edgetpu_compiler is not on PATH (it runs on x86-64 Debian/Ubuntu; see deploy/CORAL.md): "
            f"compile there with `edgetpu_compiler {path.name}`"
        )
        return result
    compiled = run_edgetpu_compiler(path, path.parent)
    result["compiler"] = {
        "output": compiled.output_path,
        "log": compiled.log_path,
        "version": compiled.compiler_version,
        "ops_mapped": compiled.ops_mapped,
        "ops_not_mapped": compiled.ops_not_mapped,
    }
    notes.append(
        f"edgetpu_compiler: {compiled.ops_mapped} ops mapped to the Edge TPU, "
        f"{compiled.ops_not_mapped} not mapped -> {compiled.output_path}"
    )
    return result


def _min_sqnr(spec: ModeSpec, value, names: list[str]) -> dict[str, float]:
    """Each output's verification threshold: the mode's, ``--min-sqnr DB`` for all, or NAME=DB,..."""
    thresholds = dict.fromkeys(names, spec.min_sqnr_db)
    if value is None or value == "":
        return thresholds
    if isinstance(value, (int, float)):
        return dict.fromkeys(names, float(value))
    text = str(value)
    if "=" not in text:
        try:
            return dict.fromkeys(names, float(text))
        except ValueError:
            raise UsageError(f"--min-sqnr {text!r}: give dB (e.g. 12) or NAME=DB,NAME=DB") from None
    for item in text.split(","):
        name, _, db = item.partition("=")
        if name.strip() not in thresholds:
            raise UsageError(f"--min-sqnr names output {name.strip()!r}; the model's outputs are {', '.join(names)}")
        try:
            thresholds[name.strip()] = float(db)
        except ValueError:
            raise UsageError(f"--min-sqnr {item!r}: the threshold must be a number of dB") from None
    return thresholds


def _check_contract(tflite, spec: ModeSpec, io_type: str, source_name: str, names: list[str]) -> tuple[str, ...]:
    """What the mode promised before any number is compared: every output by its Keras name, the
    I/O dtypes, and no float op in an integer-only model. Returns the ops still in float."""
    missing = [n for n in names if n not in tflite.output_names]
    if missing:
        raise ConversionError(
            f"{source_name}: the .tflite has no output named {', '.join(missing)} (its outputs: "
            f"{', '.join(tflite.output_names)}); convert the model with edgeq, which names them as Keras does"
        )
    expected_io = io_type if spec.integer_io else "float32"
    tensors = [("input", n, t) for n, t in zip(tflite.input_names, tflite.inputs)]
    tensors += [("output", n, t) for n, t in zip(tflite.output_names, tflite.outputs)]
    for kind, name, tensor in tensors:
        # a mixed int8/int16 model whose last layer computes at 16 bits answers in int16
        wide_output = kind == "output" and tensor.dtype == "int16" and spec.mode == Mode.INT8_ONLY
        if tensor.dtype != expected_io and not wide_output:
            raise ConversionError(
                f"{source_name}: mode {spec.mode.value} promised {expected_io} {kind}s "
                f"but the converter wrote {tensor.dtype} for {kind} {name!r}"
            )
    floats = float_ops(tflite)
    post = sorted({f.split("#")[0] for f in floats if "NON_MAX_SUPPRESSION" in f or "Detection_PostProcess" in f})
    if spec.integer_only and post:
        raise IntegerOnlyError(
            f"{source_name}: the model ends in {', '.join(post)}, which has no integer kernel: export the model "
            "without its post-processing (its box and score heads as two outputs) and let edgeq decode and NMS "
            "them (edgeq.tasks.detection, layouts centre and plain), or convert with --int8 to keep it float"
        )
    if spec.integer_only and floats:
        raise IntegerOnlyError(
            f"{source_name}: not integer-only: {len(floats)} op(s) still run in float: {', '.join(floats[:12])}"
            f"{' ...' if len(floats) > 12 else ''}; replace those ops or convert with --int8 (float fallback)"
        )
    return tuple(floats)


def _held_targets(dataset, held, outputs) -> dict:
    """The labels of the held-out samples verification runs on, by output (none where the data has none)."""
    if dataset is None or held is None or held.indices is None or not dataset.labelled:
        return {}
    found = {}
    for o in outputs:
        targets = dataset.targets(held.split, o.name if len(outputs) > 1 else None)
        if targets is not None:
            found[o.name] = np.asarray(targets)[held.indices]
    return found


def _task_verdict(output, reference, got, targets, x, budget: float | None = None) -> dict | None:
    """What verification saw of the output's task metric on its labelled samples: both values, the
    change with n and its paired interval (edgeq.tasks.verdicts.Verdict); None where nothing scores it.
    With a budget (--max-drop), an output with a task metric that nothing scores is refused."""
    gated = budget is not None and bool(task(output.kind).primary) and not output.kind.startswith("detection")
    try:
        return judge(output, reference, got, targets, x if not isinstance(x, dict) else None, budget).to_dict()
    except NothingJudged as exc:
        if gated:
            raise NothingJudged(f"--max-drop {budget:g}: {exc} (the held-out samples verification uses)") from None
        return None


def _verify(
    tflite, keras_model, spec, held, data_spec, io_type, source_name, min_sqnr_db, outputs, targets=None, max_drop=None
) -> Verification:
    """The converted model against the source, output by output (matched by name, never position);
    with labels, each output's task metric too (n, change, paired interval)."""
    from edgeq.models.load import input_names, keras_outputs
    from edgeq.tasks.table import compare

    names = [o.name for o in outputs]
    floats = _check_contract(tflite, spec, io_type, source_name, names)
    classes = None
    if held is not None:
        x, classes = held.x, held.classes
        source = f"{held.split} samples of {data_spec} (calibration uses train; LiteRT's default kernels, XNNPACK)"
        if held.x_select is not None:
            source += f"; the --ptq choice used {len(held.x_select)} others"
        if classes is not None:
            source += f"; {classes} of {held.classes_in_split} classes"
    else:
        rng = np.random.default_rng(0)
        x = {
            n: rng.uniform(0.0, 1.0, size=(32, *tflite.input_named(n).shape[1:])).astype(np.float32)
            for n in input_names(keras_model)
        }
        x = next(iter(x.values())) if len(x) == 1 else x
        source = "random uniform [0, 1) inputs (no data given)"
    reference = keras_outputs(keras_model, x)
    got = tflite.predict_outputs(x, batch_size=1)
    thresholds = _min_sqnr(spec, min_sqnr_db, names)
    per_output, failed = [], []
    for o in outputs:
        ref = np.asarray(reference[o.name])
        if got[o.name].shape != ref.shape:
            raise ConversionError(
                f"{source_name}: TFLite output {o.name!r} has shape {got[o.name].shape}, Keras {ref.shape}"
            )
        if not np.all(np.isfinite(got[o.name])):
            raise ConversionError(f"{source_name}: the converted model's output {o.name!r} holds NaN/inf")
        cmp = compare(o, ref, got[o.name])
        verdict = _task_verdict(o, ref, got[o.name], (targets or {}).get(o.name), x, max_drop)
        # with --max-drop an output with a task metric is judged by it; the rest (and without it, all) by SQNR
        by_task = verdict is not None and verdict["passed"] is not None
        ok = verdict["passed"] if by_task else cmp.sqnr_db >= thresholds[o.name]
        per_output.append(
            {
                "name": o.name,
                "task": o.kind,
                "sqnr_db": cmp.sqnr_db,
                "min_sqnr_db": thresholds[o.name],
                "agreement": cmp.agreement if np.isfinite(cmp.agreement) else None,
                "max_abs_error": cmp.max_abs_error,
                "mean_abs_error": cmp.mae,
                "cosine": cmp.cosine,
                "passed": bool(ok),
                "judged_by": verdict["metric"] if by_task else "sqnr_db",
                "verdict": verdict,
            }
        )
        if not ok and by_task:
            failed.append(Verdict.from_dict(verdict).line())
        elif not ok:
            failed.append(f"{o.name} {cmp.sqnr_db:.1f} dB < {thresholds[o.name]:.1f}")
    if max_drop is not None and not any(p["judged_by"] != "sqnr_db" for p in per_output):
        raise NothingJudged(
            f"--max-drop {max_drop:g}: no output of {source_name} has a task metric its held-out samples score "
            f"({', '.join(f'{o.name}: {o.kind}' for o in outputs)}); give labels ('y' or 'y_<output>'), declare "
            "the task with --task, or verify by SQNR without --max-drop"
        )
    first = per_output[0]
    agreements = [p["agreement"] for p in per_output if p["agreement"] is not None]
    verification = Verification(
        samples=_count(x),
        data=source,
        agreement=agreements[0] if agreements else None,
        max_abs_error=max(p["max_abs_error"] for p in per_output),
        mean_abs_error=first["mean_abs_error"],
        sqnr_db=min(p["sqnr_db"] for p in per_output),
        min_sqnr_db=first["min_sqnr_db"] if len(set(thresholds.values())) == 1 else min(thresholds.values()),
        float_ops=tuple(floats),
        integer_only=not floats,
        passed=not failed,
        classes=classes,
        outputs=tuple(per_output),
    )
    if failed:
        raise ConversionError(_verification_failure(source_name, failed, verification, per_output, max_drop))
    return verification


def _verification_failure(source_name, failed, verification, per_output, max_drop) -> str:
    """The one line a failed verification ends with: what failed, on how many samples, and what to try."""
    n = verification.samples
    if max_drop is not None:
        return f"{source_name}: verification failed on {n} held-out samples: {'; '.join(failed)}; try QAT (edgeq train)"
    agreement = f", top-1 agreement {verification.agreement:.1%}" if verification.agreement is not None else ""
    answers = [Verdict.from_dict(p["verdict"]).line() for p in per_output if p.get("verdict") and not p["passed"]]
    judged = f"; by its task: {'; '.join(answers)}" if answers else ""
    hint = "; --max-drop PP judges a classifier by its answers" if answers or agreement else ""
    return (
        f"{source_name}: verification failed: output SQNR vs the Keras model below the threshold on {n} held-out "
        f"samples ({'; '.join(failed)}{agreement}){judged}; try QAT (edgeq train), per-channel, or --min-sqnr to "
        f"accept it{hint}"
    )


def _count(x) -> int:
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def _detection_record(outputs, dataset) -> dict | None:
    from dataclasses import replace

    from edgeq.tasks.detection import detection_spec_of

    spec = detection_spec_of(outputs)
    if spec is None:
        return None
    names = tuple(getattr(dataset, "class_names", ()) or ()) if dataset is not None else ()
    return replace(spec, class_names=names if len(names) == spec.classes else ()).to_dict()


def _num_classes(outputs) -> int | None:
    """Classes of the first classifier output (None: the model has none)."""
    for o in outputs:
        if o.kind == "classification":
            return int(np.prod(o.shape)) if o.shape else None
        if o.kind == "binary":
            return 2
    return None
