"""Quantized vs FP32: accuracy, drop, agreement and output error.

``evaluate`` loads the models, and needs TensorFlow only when the reference is a Keras
model; the output measures themselves are ``edgeq.metrics`` (numpy only).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgeq.errors import ModelLoadError, QualityGateError
from edgeq.metrics import accuracy, compare_outputs


@dataclass(frozen=True)
class EvalResult:
    model: str
    reference: str
    data: str
    samples: int
    accuracy: float
    reference_accuracy: float
    drop_pp: float  # reference accuracy - model accuracy, in percentage points
    agreement: float
    mae: float
    mse: float
    max_abs_error: float
    sqnr_db: float
    cosine: float
    size_bytes: int
    reference_size_bytes: int  # the FP32 TFLite size (converted in memory for a Keras reference)
    size_ratio: float
    model_dtype: str
    max_drop_pp: float | None = None
    passed: bool = True

    def to_dict(self) -> dict:
        d = {"kind": "edgeq.eval", **asdict(self)}
        for k, v in d.items():
            if isinstance(v, float) and math.isinf(v):
                d[k] = "inf" if v > 0 else "-inf"
        return d


def _reference_predictions(reference: Path, x: np.ndarray) -> tuple[np.ndarray, int]:
    """Predictions of the reference and the size of its FP32 TFLite form."""
    if reference.suffix == ".tflite":
        from edgeq.runtime.interpreter import TFLiteModel

        ref = TFLiteModel(reference)
        return ref.predict(x, batch_size=1), reference.stat().st_size
    from edgeq.model_io import load_user_model

    model = load_user_model(reference)
    from edgeq.shims.tflite import keras_converter, native_output_silenced

    converter = keras_converter(model)
    with native_output_silenced():
        fp32_size = len(converter.convert())
    return model.predict(x, batch_size=256, verbose=0), fp32_size


def evaluate(
    model: str | Path,
    reference: str | Path,
    data: str,
    split: str = "test",
    max_drop_pp: float | None = None,
) -> EvalResult:
    """Accuracy of both models on a data split, and how far their outputs differ."""
    from edgeq.data import load_dataset

    model, reference = Path(model), Path(reference)
    for path in (model, reference):
        if not path.exists():
            raise ModelLoadError(f"{path}: no such model file")
    if model.suffix != ".tflite":
        raise ModelLoadError(f"{model}: edgeq eval compares a .tflite model; convert it first (edgeq convert)")
    from edgeq.runtime.interpreter import TFLiteModel

    quantized = TFLiteModel(model)
    input_shape = tuple(quantized.input.shape[1:])
    from edgeq.runtime.inputs import normalization_beside

    # raw files in the model's units (its manifest), float files checked against them
    inp = quantized.input
    dataset = load_dataset(
        data,
        input_shape=input_shape,
        normalization=normalization_beside(model),
        int8_input=(inp.scale, inp.zero_point) if inp.dtype == "int8" else None,  # int8 x: this input's codes
    )
    dataset.check_fits(input_shape, where=f"model {model}")
    x, y = dataset.split(split)
    got = quantized.predict(x, batch_size=1)
    ref, ref_size = _reference_predictions(reference, x)
    cmp = compare_outputs(ref, got)
    acc = accuracy(got, y, str(model))
    ref_acc = accuracy(ref, y, str(reference))
    drop = round((ref_acc - acc) * 100.0, 4)
    size = model.stat().st_size
    result = EvalResult(
        model=str(model),
        reference=str(reference),
        data=f"{data} ({split})",
        samples=len(x),
        accuracy=acc,
        reference_accuracy=ref_acc,
        drop_pp=drop,
        agreement=cmp.agreement,
        mae=cmp.mae,
        mse=cmp.mse,
        max_abs_error=cmp.max_abs_error,
        sqnr_db=cmp.sqnr_db,
        cosine=cmp.cosine,
        size_bytes=size,
        reference_size_bytes=ref_size,
        size_ratio=size / ref_size if ref_size else float("nan"),
        model_dtype=quantized.input.dtype,
        max_drop_pp=max_drop_pp,
        passed=max_drop_pp is None or drop <= max_drop_pp,
    )
    return result


def check_gate(result: EvalResult) -> None:
    if not result.passed:
        raise QualityGateError(
            f"{result.model}: accuracy drop {result.drop_pp:.2f} pp exceeds --max-drop {result.max_drop_pp:g} pp "
            f"({result.reference_accuracy:.2%} -> {result.accuracy:.2%})"
        )
