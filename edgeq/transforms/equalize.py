"""Cross-layer equalization (Nagel et al., 2019): balance per-channel ranges across pairs.

For a layer L1 whose output channel i feeds input channel i of the next layer L2 through
positively homogeneous, channel-wise ops (ReLU, max/average pooling, dropout), scaling
L1's channel i by 1/s and L2's input channel i by s leaves the FP32 function unchanged.
Choosing s_i = sqrt(r1_i / r2_i) gives both the same range sqrt(r1_i * r2_i), so one
per-tensor scale fits every channel of the weights and of the activation between them.
BatchNormalization must be folded first (edgeq.transforms.fold).

ReLU6 is not homogeneous: after the scaling, channel i clips at 6 * s_i in the original
units. As in the DFQ paper, the clip is re-checked on data: a channel whose producer
output never exceeds 6 on the calibration samples keeps the function exactly when its
total scale s_i >= max_i / 6; a channel that does reach the clip keeps s_i = 1. Without
data, pairs with a ReLU6 between them are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_PRODUCERS = ("Conv2D", "DepthwiseConv2D", "Dense")
_CONSUMERS = ("Conv2D", "DepthwiseConv2D", "Dense")
_THROUGH = (
    "ReLU",
    "MaxPooling2D",
    "AveragePooling2D",
    "GlobalAveragePooling2D",
    "GlobalMaxPooling2D",
    "Dropout",
    "Activation",
)


@dataclass(frozen=True)
class EqualizedPair:
    first: str
    second: str
    range_spread_before: float  # max/median per-channel range of the first layer's weights
    range_spread_after: float


def _single_consumer(layer):
    nodes = layer._outbound_nodes  # noqa: SLF001 - no public graph walker in Keras 2
    return nodes[0].outbound_layer if len(nodes) == 1 else None


def _clip(layer) -> float | None:
    """The clip value of a ReLU6-like layer (ReLU(max_value=6), Activation('relu6')), else None."""
    kind = type(layer).__name__
    plain = kind == "ReLU" and float(layer.negative_slope) == 0.0 and float(layer.threshold) == 0.0
    if plain and layer.max_value is not None:
        return float(layer.max_value)
    if kind == "Activation" and getattr(layer.activation, "__name__", "") == "relu6":
        return 6.0
    return None


def _homogeneous(layer, clipped_ok: bool = False) -> bool:
    kind = type(layer).__name__
    if clipped_ok and _clip(layer) is not None:
        return True
    if kind == "ReLU":
        return layer.max_value is None and float(layer.negative_slope) == 0.0 and float(layer.threshold) == 0.0
    if kind == "Activation":
        return getattr(layer.activation, "__name__", "") in ("relu", "linear")
    return kind in _THROUGH


def _activation_ok(layer) -> bool:
    return getattr(getattr(layer, "activation", None), "__name__", "linear") in ("relu", "linear")


def find_pairs(model, clipped_ok: bool = False) -> list[tuple[str, str, float | None]]:
    """(first, second, clip) for every equalizable pair; clip is the ReLU6 value between them, if any."""
    pairs = []
    for layer in model.layers:
        if type(layer).__name__ not in _PRODUCERS or not _activation_ok(layer):
            continue
        if type(layer).__name__ == "DepthwiseConv2D" and layer.depth_multiplier != 1:
            continue
        clip = None
        nxt = _single_consumer(layer)
        while nxt is not None and type(nxt).__name__ not in _CONSUMERS and _homogeneous(nxt, clipped_ok):
            clip = _clip(nxt) if _clip(nxt) is not None else clip
            nxt = _single_consumer(nxt)
        if nxt is None or type(nxt).__name__ not in _CONSUMERS:
            continue
        if type(nxt).__name__ == "DepthwiseConv2D" and nxt.depth_multiplier != 1:
            continue
        pairs.append((layer.name, nxt.name, clip))
    return pairs


def _output_maxima(model, names: list[str], x) -> dict[str, np.ndarray]:
    """Per-channel maximum of each named layer's output on the samples x."""
    from edgeq.models.compat import keras

    if not names:
        return {}
    probe = keras.Model(model.inputs, [model.get_layer(n).output for n in names])
    outputs = probe.predict(x, batch_size=32, verbose=0)
    outputs = outputs if isinstance(outputs, list) else [outputs]
    return {n: np.asarray(o).reshape(-1, o.shape[-1]).max(axis=0) for n, o in zip(names, outputs)}


def _out_ranges(layer, kernel):
    kind = type(layer).__name__
    if kind == "DepthwiseConv2D":
        return np.abs(kernel[:, :, :, 0]).reshape(-1, kernel.shape[2]).max(axis=0)
    return np.abs(kernel).reshape(-1, kernel.shape[-1]).max(axis=0)


def _in_ranges(layer, kernel):
    kind = type(layer).__name__
    if kind == "Dense":
        return np.abs(kernel).max(axis=1)
    if kind == "DepthwiseConv2D":
        return np.abs(kernel[:, :, :, 0]).reshape(-1, kernel.shape[2]).max(axis=0)
    return np.moveaxis(np.abs(kernel), 2, 0).reshape(kernel.shape[2], -1).max(axis=1)


def _spread(r):
    med = float(np.median(r))
    return float(r.max() / med) if med > 0 else float("inf")


def equalize(model, iterations: int = 4, x=None) -> list[EqualizedPair]:
    """Equalize every pair in place; returns the pairs with their range spread before/after.

    ``x``: calibration samples, needed to equalize across a ReLU6 (see the module docstring).
    """
    by_name = {layer.name: layer for layer in model.layers}
    pairs = find_pairs(model, clipped_ok=x is not None)
    maxima = _output_maxima(model, [a for a, _, clip in pairs if clip is not None], x)
    total = {a: np.ones_like(m) for a, m in maxima.items()}  # each clipped channel's scale so far
    before = {}
    for _ in range(iterations):
        for first_name, second_name, clip in pairs:
            first, second = by_name[first_name], by_name[second_name]
            w1 = first.get_weights()
            w2 = second.get_weights()
            r1, r2 = _out_ranges(first, w1[0]), _in_ranges(second, w2[0])
            if r1.shape != r2.shape:  # e.g. Flatten between them: channels do not line up
                continue
            before.setdefault(first_name, _spread(r1))
            s = np.where((r1 > 0) & (r2 > 0), np.sqrt(r1 / np.where(r2 > 0, r2, 1)), 1.0).astype(np.float32)
            if clip is not None:  # keep the clip where it was: see the module docstring
                peak = maxima[first_name]
                wanted = np.where(peak <= clip, np.maximum(total[first_name] * s, peak / clip), 1.0)
                s = (wanted / total[first_name]).astype(np.float32)
                total[first_name] = wanted
            if type(first).__name__ == "DepthwiseConv2D":
                w1[0] = w1[0] / s[None, None, :, None]
            else:
                w1[0] = w1[0] / s
            if len(w1) > 1:
                w1[1] = w1[1] / s
            if type(second).__name__ == "Dense":
                w2[0] = w2[0] * s[:, None]
            elif type(second).__name__ == "DepthwiseConv2D":
                w2[0] = w2[0] * s[None, None, :, None]
            else:
                w2[0] = w2[0] * s[None, None, :, None]
            first.set_weights(w1)
            second.set_weights(w2)
    return [
        EqualizedPair(a, b, before.get(a, float("nan")), _spread(_out_ranges(by_name[a], by_name[a].get_weights()[0])))
        for a, b, _ in pairs
        if a in before
    ]


def equalized_copy(model, x=None):
    """Fold BN, then equalize, on a copy; the FP32 function is unchanged (on ``x``, across ReLU6)."""
    from edgeq.transforms.fold import folded_copy

    folded = folded_copy(model)
    return folded, equalize(folded, x=x)
