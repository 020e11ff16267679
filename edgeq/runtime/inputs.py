"""One input contract: raw data -> float sample -> the model's input tensor.

Every consumer of user data (training and calibration on the host, ``eval``, ``profile
--data``, ``verify``, and the device side) goes through this module, so that one file
means the same model inputs everywhere:

- A **float sample** is what the FP32 model was trained on: ``raw * scale + offset``
  (``Normalization``, recorded in ``run.json`` and in each conversion manifest).
- **Raw data** in an ``.npz`` is ``uint8`` (image pixels, or any 8-bit raw values):
  the recorded normalisation makes float samples of it.
- **Float data** is taken as float samples already. When the normalisation says what
  raw range it came from, float values far outside the float range it gives (0-255
  pixels for a model trained on 0-1) are refused with the fix, not quantized wrongly.
- **int8 data** for a model with an int8 input is that input's codes, used unchanged.
- A float sample becomes the model's int8/uint8 input with the input tensor's scale and
  zero point, rounded as LiteRT's own QUANTIZE op rounds with its default (optimized and
  XNNPACK) kernels: to nearest, halves to even; clamped to the dtype. (Only LiteRT's
  reference kernels round halves away from zero; tests/test_inputs.py checks both.)

numpy only: this runs on devices without TensorFlow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeq.errors import DataError

ROUNDING = "nearest, halves to even"  # LiteRT's default QUANTIZE kernels (the reference kernel: away from zero)
# Float data whose values reach this far beyond the recorded float range is taken as not normalised.
RANGE_SLACK = 0.5


@dataclass(frozen=True)
class Normalization:
    """model_input = raw * scale + offset; raw values span [0, raw_max] when known."""

    scale: float = 1.0
    offset: float = 0.0
    raw_max: float | None = None  # 255 for 8-bit images, 16 for scikit-learn digits; None: unknown

    def apply(self, raw: np.ndarray) -> np.ndarray:
        return (np.asarray(raw, dtype=np.float32) * np.float32(self.scale) + np.float32(self.offset)).astype(np.float32)

    def float_range(self) -> tuple[float, float] | None:
        """[lo, hi] of the float samples raw data in [0, raw_max] gives; None when the raw range is unknown."""
        if self.raw_max is None:
            return None
        ends = (self.offset, self.offset + self.scale * self.raw_max)
        return float(min(ends)), float(max(ends))

    def to_dict(self) -> dict:
        return {"scale": self.scale, "offset": self.offset, "raw_max": self.raw_max, "raw_dtype": "uint8"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Normalization:
        raw_max = d.get("raw_max")
        return cls(float(d.get("scale", 1.0)), float(d.get("offset", 0.0)), None if raw_max is None else float(raw_max))


UINT8_IMAGES = Normalization(scale=1.0 / 255.0, raw_max=255.0)


def quantize_input(x: np.ndarray, dtype: str, scale: float, zero_point: int) -> np.ndarray:
    """Float samples -> an integer input tensor's codes, as LiteRT's QUANTIZE computes them (float32)."""
    target = np.dtype(dtype)
    if not np.issubdtype(target, np.integer) or scale == 0.0:
        return np.asarray(x, dtype=target)
    limits = np.iinfo(target)
    scaled = np.asarray(x, dtype=np.float32) / np.float32(scale)
    q = np.rint(scaled).astype(np.int64) + int(zero_point)
    return np.clip(q, limits.min, limits.max).astype(target)


def dequantize_input(q: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    return ((np.asarray(q).astype(np.float32) - np.float32(zero_point)) * np.float32(scale)).astype(np.float32)


def float_samples(
    x: np.ndarray, normalization: Normalization | None, where: str, check_finite: bool = True
) -> np.ndarray:
    """Float samples from raw uint8 or float data, checked against ``normalization``.

    ``normalization`` is the model's recorded one (None: not known; uint8 is then taken as
    8-bit images, 0-255 -> 0-1). Other integer arrays (int16, int32, ...) are float samples
    stored as integers, checked the same way; int8 arrays are input codes (``samples``).
    """
    x = np.asarray(x)
    if x.dtype == np.uint8:
        norm = normalization if normalization is not None and normalization.raw_max is not None else UINT8_IMAGES
        if norm.raw_max is not None and x.size and int(x.max()) > norm.raw_max:
            raise DataError(
                f"{where}: raw uint8 values reach {int(x.max())}, but the model's raw data spans "
                f"[0, {norm.raw_max:g}] (normalisation raw * {norm.scale:g} + {norm.offset:g}); "
                "give data in the units the model was trained on"
            )
        return norm.apply(x)
    if x.dtype == np.int8 or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise DataError(
            f"{where}: the inputs' dtype is {x.dtype}; give raw uint8 data, float samples (normalised as in training) "
            "or, for a model with an int8 input, its int8 codes"
        )
    x = x.astype(np.float32)
    finite = np.isfinite(x)
    if check_finite and not np.all(finite):
        bad = ~finite.reshape(len(x), -1).all(axis=1) if x.ndim > 1 else ~finite
        raise DataError(
            f"{where}: {int(bad.sum())} sample(s) hold NaN or infinity (the first: sample {int(np.argmax(bad))}): "
            "clean or drop them"
        )
    expected = normalization.float_range() if normalization is not None else None
    if expected is not None and np.any(finite):
        lo, hi = expected
        slack = RANGE_SLACK * (hi - lo)
        got_lo, got_hi = float(x[finite].min()), float(x[finite].max())
        if got_hi > hi + slack or got_lo < lo - slack:
            raise DataError(
                f"{where}: float inputs span [{got_lo:g}, {got_hi:g}], but the model was trained on "
                f"[{lo:g}, {hi:g}] (raw * {normalization.scale:g} + {normalization.offset:g}); save raw data as "
                f"uint8 (edgeq normalises it), or normalise the floats the same way"
            )
    return x


def samples(
    x: np.ndarray,
    normalization: Normalization | None,
    where: str,
    int8_input: tuple[float, int] | None = None,
    check_finite: bool = True,
) -> np.ndarray:
    """The one meaning of an input array, on the host and on the device: float samples.

    uint8 is raw data (``normalization`` makes float samples of it); float, and integers
    other than int8, are float samples already (checked against ``normalization``'s
    range); int8 is the codes of an int8 model input, ``int8_input`` = (scale, zero point),
    dequantized here (quantizing them again gives back the same codes). Where no int8 input
    is known (training, calibration of a float model), int8 data is refused.
    """
    x = np.asarray(x)
    if x.dtype == np.int8:
        if int8_input is None:
            raise DataError(
                f"{where}: int8 arrays are the codes of an int8 model input, but no int8 model reads them here; "
                "give raw uint8 data or float samples"
            )
        return dequantize_input(x, *int8_input)
    return float_samples(x, normalization, where, check_finite=check_finite)


def class_labels(y: np.ndarray, count: int, where: str, key: str = "y") -> np.ndarray:
    """Class ids (N,) from ids (N,) or (N, 1), whole-valued floats, or one-hot rows (N, K)."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    elif y.ndim == 2 and y.shape[1] > 1:
        if not (np.all((y == 0) | (y == 1)) and np.all(y.sum(axis=1) == 1)):
            raise DataError(f"{where}: labels {key!r} of shape {y.shape} are not one-hot rows (one 1 per row)")
        y = np.argmax(y, axis=1)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise DataError(f"{where}: labels {key!r} must be class ids (N,) or one-hot (N, C), got {y.dtype} {y.shape}")
    if len(y) != count:
        raise DataError(f"{where}: {len(y)} labels in {key!r} for {count} inputs")
    if np.issubdtype(y.dtype, np.floating) and not np.all(np.mod(y, 1) == 0):
        raise DataError(f"{where}: labels {key!r} must hold integer class indices, got dtype {y.dtype}")
    y = y.astype(np.int64)
    if y.size and y.min() < 0:
        raise DataError(f"{where}: labels {key!r} must be class indices >= 0")
    return y


def model_inputs(
    x: np.ndarray, dtype: str, scale: float, zero_point: int, normalization: Normalization | None, where: str
) -> np.ndarray:
    """What the model's input tensor gets for data ``x``: codes for an integer input, floats for a float one."""
    x = np.asarray(x)
    if x.dtype == np.int8:
        if np.dtype(dtype) != np.int8:
            raise DataError(
                f"{where}: int8 data are taken as the codes of an int8 model input, but this model takes {dtype}"
            )
        return x
    return quantize_input(float_samples(x, normalization, where), dtype, scale, zero_point)


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an .npz file, or one DataError naming the file and how to save it.

    The one reader of .npz data: `eval`/`train` (npz: sources), `profile --data` and `verify`.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such .npz file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
        broken = sorted(key for key, value in arrays.items() if not isinstance(value, np.ndarray))
        if broken:  # numpy hands back the raw bytes of a member whose .npy header it cannot read
            raise ValueError(f"array(s) {', '.join(broken)} are not .npy data")
    except Exception as exc:  # numpy and zipfile raise many types (BadZipFile, zlib.error, ...) for a bad file
        raise DataError(
            f"{path}: not a readable .npz file ({type(exc).__name__}: {' '.join(str(exc).split())[:120]}); "
            "save it with np.savez(x=..., y=...)"
        ) from exc
    return arrays


def samples_for(arrays: dict[str, np.ndarray], name: str, shape: tuple[int, ...], path: str | Path) -> np.ndarray:
    """Array ``name`` as a batch of samples of ``shape`` (one unbatched sample gets its batch axis)."""
    if name not in arrays:
        raise DataError(f"{path}: no array {name!r} (it has {', '.join(sorted(arrays)) or 'none'})")
    x = arrays[name]
    if tuple(x.shape) == tuple(shape):
        x = x[None]
    if len(shape) >= 2 and shape[-1] == 1 and tuple(x.shape[1:]) == tuple(shape[:-1]):
        x = x[..., None]  # (N, H, W) grey images for a model that takes (H, W, 1)
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != tuple(shape):
        raise DataError(
            f"{path}: {name} has shape {tuple(x.shape)} but the model takes (N, {', '.join(map(str, shape))})"
        )
    if len(x) == 0:
        raise DataError(f"{path}: {name} is empty")
    return x


def manifest_beside(model_path: str | Path) -> Path:
    """Where ``edgeq convert`` writes the manifest of MODEL.tflite: MODEL.manifest.json."""
    path = Path(model_path)
    return path.with_name(f"{path.stem}.manifest.json")


def recorded_beside(model_path: str | Path, key: str):
    """What the manifest beside ``model_path`` records under ``key``; None without a manifest or the key."""
    manifest = manifest_beside(model_path)
    if not manifest.is_file():
        return None
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError) as exc:
        raise DataError(f"{manifest}: not a readable edgeq manifest ({exc}); remove it or convert again") from exc


def normalization_beside(model_path: str | Path) -> Normalization | None:
    """The normalisation the manifest beside ``model_path`` records; None without one."""
    recorded = recorded_beside(model_path, "normalization")
    if not isinstance(recorded, dict):
        return None
    try:
        return Normalization.from_dict(recorded)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{manifest_beside(model_path)}: bad normalization record {recorded!r}") from exc


def outputs_beside(model_path: str | Path) -> list[dict]:
    """The outputs (name, task, ...) the manifest beside ``model_path`` records, in the model's order ([]: none)."""
    recorded = recorded_beside(model_path, "outputs")
    return [o for o in recorded if isinstance(o, dict) and "name" in o] if isinstance(recorded, list) else []


def holds_class_ids(y: np.ndarray) -> bool:
    """Whether labels are class ids rather than float targets: integers (N,) or (N, 1), whole
    floats (N,), or one-hot rows (N, K). A float (N, 1) or (N, K) array is regression targets."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] > 1:
        return bool(np.all((y == 0) | (y == 1)) and np.all(y.sum(axis=1) == 1))
    if np.issubdtype(y.dtype, np.integer):
        return y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)
    return y.ndim == 1 and np.issubdtype(y.dtype, np.floating) and bool(np.all(np.mod(y, 1) == 0))


def detection_beside(model_path: str | Path) -> dict | None:
    """The detection spec (heads, layout, classes) the manifest beside ``model_path`` records; None if none."""
    recorded = recorded_beside(model_path, "detection")
    return recorded if isinstance(recorded, dict) else None
