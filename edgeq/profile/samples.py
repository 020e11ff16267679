"""The samples a device profiles on: a split exported to .npz, with its targets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeq.artifacts import sha256_bytes
from edgeq.errors import DataError
from edgeq.profile.results import DataInfo
from edgeq.runtime.inputs import (
    Normalization,
    class_labels,
    holds_class_ids,
    read_npz,
    samples,
    samples_for,
)
from edgeq.runtime.interpreter import TensorInfo
from edgeq.tasks.detection import GROUND_TRUTH


@dataclass(frozen=True)
class DeviceSamples:
    """The samples ``edgeq profile`` reads from an .npz on the device (numpy only; the host's
    edgeq.data.splits.Dataset, with splits and sources, needs TensorFlow)."""

    x: np.ndarray | dict  # float32, batch first, in the model's float range; a dict by input name for several
    y: np.ndarray | dict | None  # class ids or float targets; a dict by output name; None without labels
    info: DataInfo

    @property
    def count(self) -> int:
        return len(next(iter(self.x.values()))) if isinstance(self.x, dict) else len(self.x)

    def targets(self, output: str, outputs: int):
        if self.y is None:
            return None
        if isinstance(self.y, dict):
            return self.y.get(output)
        return self.y if outputs == 1 or output == "" else None


def load_npz(
    path: str | Path,
    model_input: TensorInfo | dict,
    labels: str | None = None,
    inputs: str = "x",
    normalization: Normalization | None = None,
) -> DeviceSamples:
    """Load inputs (and labels) from an .npz and check that they fit the model's input(s).

    ``model_input``: the input's TensorInfo, or {input name: TensorInfo} for several inputs,
    read from ``x_<name>`` arrays. Inputs are read by the input contract (edgeq.runtime.inputs):
    raw uint8 normalised as ``normalization`` (the model's manifest) says, float samples
    checked against it, or int8 codes of an int8 input. Labels are ``labels`` if given (then
    required), else ``y`` (or ``y_<output name>`` for each output) if present: class ids (N,),
    one-hot (N, classes), or float targets.
    """
    path = Path(path)
    arrays = read_npz(path)
    content = path.read_bytes()
    infos = model_input if isinstance(model_input, dict) else {"": model_input}

    def read(key: str, info: TensorInfo) -> np.ndarray:
        x = samples_for(arrays, key, tuple(info.shape[1:]), path)
        # the one input contract: raw uint8, float samples, or the codes of an int8 input (dequantized
        # here; predict quantizes them back to the same codes). A --compare FP32 model gets these too.
        int8_input = (info.scale, info.zero_point) if info.dtype == "int8" else None
        return samples(x, normalization, str(path), int8_input=int8_input)

    if len(infos) == 1:
        x = read(inputs, next(iter(infos.values())))
        count = len(x)
    else:
        x = {name: read(f"{inputs}_{name}", info) for name, info in infos.items()}
        counts = {len(v) for v in x.values()}
        if len(counts) != 1:
            raise DataError(f"{path}: the input arrays hold different numbers of samples ({sorted(counts)})")
        count = counts.pop()
    named = {k[2:]: v for k, v in arrays.items() if k.startswith("y_")}
    truth = {k: arrays[k] for k in GROUND_TRUTH if k in arrays}  # a detector's ground truth
    key = labels if labels is not None else ("y" if "y" in arrays else ("y_*" if named or truth else None))
    y = None
    if key == "y_*":
        y = {name: _targets(v, count, path, f"y_{name}") for name, v in named.items()}
        y |= {k: np.asarray(v, np.float32 if k == "gt_boxes" else np.int64) for k, v in truth.items()}
    elif key is not None:
        if key not in arrays:
            raise DataError(f"{path}: labels missing: no array {key!r} (it has {', '.join(sorted(arrays))})")
        y = _targets(arrays[key], count, path, key)
    info = DataInfo(str(path), sha256_bytes(content), int(count), key)
    return DeviceSamples(x, y, info)


def _targets(y: np.ndarray, count: int, path: Path, key: str) -> np.ndarray:
    """Class ids (runtime.inputs.holds_class_ids), or float targets (regression)."""
    y = np.asarray(y)
    if holds_class_ids(y):
        return class_labels(y, count, str(path), key)
    if len(y) != count:
        raise DataError(f"{path}: {len(y)} labels in {key!r} for {count} inputs")
    if not np.issubdtype(y.dtype, np.number):
        raise DataError(f"{path}: labels {key!r} must be class ids (N,), one-hot (N, C) or float targets")
    return y.astype(np.float32)
