"""Layer-wise quantization: which layers get which bits, or stay float.

A layer-config (or plan) file is JSON or TOML::

    {"default": {"weight_bits": 8, "activation_bits": 8},
     "layers": {"conv1": {"weight_bits": 4}, "re:pw[0-9]+": "float"}}

Keys are exact layer names, or regular expressions prefixed with ``re:`` (full match).
A key that matches no layer is an error that lists the real names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
from edgeq.errors import UsageError

VALID_WEIGHT_BITS = (2, 3, 4, 5, 6, 7, 8)
VALID_ACTIVATION_BITS = (8, 16)


@dataclass(frozen=True)
class LayerPrecision:
    weight_bits: int = 8
    activation_bits: int = 8
    keep_float: bool = False

    def to_dict(self) -> dict:
        if self.keep_float:
            return {"keep_float": True}
        return {"weight_bits": self.weight_bits, "activation_bits": self.activation_bits}


@dataclass(frozen=True)
class LayerConfig:
    """Rules in file order; the last rule that matches a layer wins."""

    rules: tuple[tuple[str, dict], ...] = ()
    source: str = ""

    @classmethod
    def load(cls, path: str | Path) -> LayerConfig:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"{path}: no such layer-config file")
        try:
            text = path.read_text(encoding="utf-8")
            raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:  # UnicodeDecodeError is a ValueError
            raise UsageError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({exc})") from exc
        layers = raw.get("layers") if isinstance(raw, dict) else None
        if not isinstance(layers, dict):
            raise UsageError(f'{path}: expected a "layers" table mapping layer names (or re:REGEX) to settings')
        rules = []
        for key, value in layers.items():
            if value == "float":
                value = {"keep_float": True}
            elif isinstance(value, int):
                value = {"weight_bits": value}
            if not isinstance(value, dict):
                raise UsageError(
                    f'{path}: layer {key!r}: use "float", a bit width, '
                    "or a table of weight_bits/activation_bits/keep_float"
                )
            unknown = set(value) - {"weight_bits", "activation_bits", "keep_float"}
            if unknown:
                raise UsageError(f"{path}: layer {key!r}: unknown setting(s) {', '.join(sorted(unknown))}")
            if "weight_bits" in value and value["weight_bits"] not in VALID_WEIGHT_BITS:
                raise UsageError(f"{path}: layer {key!r}: weight_bits must be one of {VALID_WEIGHT_BITS}")
            if "activation_bits" in value and value["activation_bits"] not in VALID_ACTIVATION_BITS:
                raise UsageError(f"{path}: layer {key!r}: activation_bits must be one of {VALID_ACTIVATION_BITS}")
            rules.append((str(key), dict(value)))
        return cls(tuple(rules), str(path))

    def resolve(self, layer_names: list[str], default: LayerPrecision) -> dict[str, LayerPrecision]:
        """Per-layer precision for every name; unknown keys raise with the real names."""
        result = {name: default for name in layer_names}
        for key, settings in self.rules:
            if key.startswith("re:"):
                try:
                    pattern = re.compile(key[3:])
                except re.error as exc:
                    raise UsageError(f"{self.source}: bad regular expression {key!r}: {exc}") from exc
                matched = [n for n in layer_names if pattern.fullmatch(n)]
            else:
                matched = [key] if key in layer_names else []
            if not matched:
                raise UsageError(
                    f"{self.source}: layer {key!r} is not in the model; its layers are: {', '.join(layer_names)}"
                )
            for name in matched:
                base = result[name]
                result[name] = LayerPrecision(
                    weight_bits=int(settings.get("weight_bits", base.weight_bits)),
                    activation_bits=int(settings.get("activation_bits", base.activation_bits)),
                    keep_float=bool(settings.get("keep_float", False)),
                )
        return result
