"""The small pieces a Keras 3 -> tf_keras translation builds with: layer calls, merges, expanded activations."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from edgeq.models.compat import keras as tf_keras

if TYPE_CHECKING:
    pass

# Layer keyword arguments every tf_keras layer accepts (base Layer).
_BASE_LAYER_KWARGS = {
    "name",
    "trainable",
    "dtype",
    "dynamic",
    "input_dim",
    "input_shape",
    "batch_input_shape",
    "batch_size",
    "weights",
    "activity_regularizer",
    "autocast",
    "implementation",
}


class _Unsupported(Exception):
    """One layer or op that cannot be translated (collected, then reported together)."""


def _neutral(value: Any) -> bool:
    """A config value that means 'feature off' (safe to drop when tf_keras lacks it)."""
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0) or value in ((), [], {})


def _accepted_kwargs(cls: type) -> set[str]:
    """Keyword names a tf_keras layer class's constructor chain accepts."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is tf_keras.layers.Layer or klass is object:
            break
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names.update(n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return names - {"self"}
    return (names | _BASE_LAYER_KWARGS) - {"self"}


def _policy_name(value: Any) -> Any:
    if isinstance(value, dict):
        cfg = value.get("config") or {}
        name = cfg.get("name") or value.get("class_name")
        if value.get("class_name") not in ("DTypePolicy", "FloatDTypePolicy", "Policy") or not isinstance(name, str):
            raise _Unsupported(f"dtype policy {value.get('class_name')} has no tf_keras equivalent")
        return name
    return value


def _activation_name(value: Any) -> str:
    if callable(value):
        value = getattr(value, "__name__", repr(value))
    if isinstance(value, dict):  # a serialized function: only Keras' own by name
        if value.get("class_name") == "function" and str(value.get("module", "")).startswith("keras"):
            value = value.get("config")
        else:
            raise _Unsupported(f"custom activation {value.get('config', value.get('class_name'))!r}")
    if value is None:
        return "linear"
    if not isinstance(value, str):
        raise _Unsupported(f"activation {value!r} cannot be translated")
    return value


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


class _Layer:
    """A rebuilt tf_keras layer, called like the Keras 3 layer was (plus an optional tail)."""

    def __init__(self, layer: Any, post: Any):
        self.layer = layer
        self.post = post
        params = inspect.signature(layer.call).parameters
        self._any_kwarg = any(p.kind == p.VAR_KEYWORD for p in params.values())
        self._kwargs = set(params)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if not self._any_kwarg:  # e.g. a training= handed down from a flattened model
            kwargs = {k: v for k, v in kwargs.items() if k in self._kwargs or k not in ("training", "mask")}
        out = self.layer(*args, **kwargs)
        return self.post((out,), {}) if self.post is not None else out


class _Merge:
    """tensor (op) tensor as an Add/Subtract/Multiply layer."""

    def __init__(self, layer: Any):
        self.layer = layer

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return self.layer(list(args))


class _OneTensor:
    """tensor (op) constant as a Rescaling layer."""

    def __init__(self, layer: Any, index: int):
        self.layer = layer
        self.index = index

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return self.layer(args[self.index])


class _Expanded:
    """hard_sigmoid(x) = ReLU6(x + 3) / 6 and hard_swish(x) = x * hard_sigmoid(x), as layers."""

    def __init__(self, translator: Any, kind: str, base: str, final: str | None):
        fresh = translator._fresh
        sigmoid_name = final if (kind == "hard_sigmoid" and final) else None
        swish_name = final if (kind == "hard_swish" and final) else None
        if final:
            translator.used_names.add(final)
        self.kind = kind
        self.shift = tf_keras.layers.Rescaling(1.0, offset=3.0, name=fresh(f"{base}_plus3"))
        self.relu6 = tf_keras.layers.ReLU(max_value=6.0, name=fresh(f"{base}_relu6"))
        self.scale = tf_keras.layers.Rescaling(
            1.0 / 6.0, name=sigmoid_name or fresh(f"{base}_div6" if kind == "hard_swish" else base)
        )
        self.multiply = None
        if kind == "hard_swish":
            self.multiply = tf_keras.layers.Multiply(name=swish_name or fresh(base))

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        y = self.scale(self.relu6(self.shift(x)))
        return self.multiply([x, y]) if self.multiply is not None else y
