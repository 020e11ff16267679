"""What `edgeq convert` can be asked: modes, range methods, roundings, ``ConvertOptions``, and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from edgeq.data.splits import DEFAULT_CALIBRATION_SAMPLES
from edgeq.errors import UsageError
from edgeq.quantize.numerics import ROUNDINGS
from edgeq.quantize.ranges import ACTIVATION_METHODS, WEIGHT_METHODS


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
    # --input-range LO:HI, for a .tflite: the float range its input takes 8-bit images to (MediaPipe: -1:1)
    input_range: str | None = None
    # --split-outputs, for a .tflite: an output a CONCATENATION writes (YOLO's boxes and scores) becomes its parts
    split_outputs: bool | None = None  # None: split where the parts' ranges differ (convert.from_tflite)
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
