"""Training schedules: FP32, then QAT in one or more stages.

``default``: FP32 for ``epochs``, then QAT for ``qat_epochs`` at the requested bits.
``stepped`` (gradual quantization): with 4-bit weights, FP32 -> 8-bit QAT -> 4-bit QAT;
with 8-bit weights, FP32 -> QAT of the input half of the layers -> QAT of all layers.
A JSON/TOML file can list stages by hand.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
from edgeq.errors import UsageError


@dataclass(frozen=True)
class Stage:
    name: str
    kind: str  # "fp32" or "qat"
    epochs: int
    weight_bits: int = 8
    activation_bits: int = 8
    layer_fraction: float = 1.0  # share of quantizable layers, counted from the input

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Stage:
        return cls(**d)


def default_schedule(epochs: int, qat_epochs: int, weight_bits: int, activation_bits: int) -> list[Stage]:
    stages = []
    if epochs > 0:
        stages.append(Stage("fp32", "fp32", epochs))
    if qat_epochs > 0:
        stages.append(Stage(f"qat-w{weight_bits}a{activation_bits}", "qat", qat_epochs, weight_bits, activation_bits))
    return stages


def stepped_schedule(epochs: int, qat_epochs: int, weight_bits: int, activation_bits: int) -> list[Stage]:
    if qat_epochs < 2:
        raise UsageError("--schedule stepped needs --qat-epochs of at least 2 (one per quantization step)")
    first = qat_epochs // 2
    second = qat_epochs - first
    stages = [Stage("fp32", "fp32", epochs)] if epochs > 0 else []
    if weight_bits < 8:
        stages.append(Stage(f"qat-w8a{activation_bits}", "qat", first, 8, activation_bits))
        stages.append(Stage(f"qat-w{weight_bits}a{activation_bits}", "qat", second, weight_bits, activation_bits))
    else:
        stages.append(Stage("qat-input-half", "qat", first, weight_bits, activation_bits, layer_fraction=0.5))
        stages.append(Stage(f"qat-w{weight_bits}a{activation_bits}", "qat", second, weight_bits, activation_bits))
    return stages


def load_schedule(path: str | Path) -> list[Stage]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such schedule file; use --schedule default, stepped or a JSON/TOML file")
    text = path.read_text()
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{path}: not valid JSON/TOML ({exc})") from exc
    items = raw.get("stages") if isinstance(raw, dict) else None
    if not isinstance(items, list) or not items:
        raise UsageError(f'{path}: expected a non-empty "stages" list of {{name, kind, epochs, ...}}')
    stages = []
    for i, item in enumerate(items):
        try:
            stage = Stage.from_dict(dict(item))
        except TypeError as exc:
            raise UsageError(f"{path}: stage {i + 1}: {exc}") from exc
        if stage.kind not in ("fp32", "qat") or stage.epochs < 1 or not 0 < stage.layer_fraction <= 1:
            raise UsageError(f"{path}: stage {i + 1}: kind must be fp32 or qat, epochs >= 1, 0 < layer_fraction <= 1")
        stages.append(stage)
    return stages


def make_schedule(name: str, epochs: int, qat_epochs: int, weight_bits: int, activation_bits: int) -> list[Stage]:
    if name == "default":
        return default_schedule(epochs, qat_epochs, weight_bits, activation_bits)
    if name == "stepped":
        return stepped_schedule(epochs, qat_epochs, weight_bits, activation_bits)
    return load_schedule(name)
