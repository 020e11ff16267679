"""INT4-valued weight copies of a float model: what a layer-wise INT4 plan would do to it."""

from __future__ import annotations

from edgeq.models.compat import keras
from edgeq.quantize.numerics import QuantSpec, fake_quantize


def int4_weight_copy(model, layers: list[str]):
    """A copy of ``model`` whose ``layers`` carry per-channel INT4 weights (16 levels), for measuring."""
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    spec = QuantSpec(bits=4, symmetric=True, narrow_range=True, axis=-1)
    for name in layers:
        layer = clone.get_layer(name)
        weights = layer.get_weights()
        kernel = weights[0]
        if type(layer).__name__ == "DepthwiseConv2D":  # (kh, kw, C, multiplier): a channel is (C, m)
            flat = kernel.reshape(*kernel.shape[:2], -1)
            weights[0] = fake_quantize(flat, spec).reshape(kernel.shape).astype(kernel.dtype)
        else:  # Conv2D (kh, kw, in, out) and Dense (in, out): a channel is an output
            weights[0] = fake_quantize(kernel, spec).astype(kernel.dtype)
        layer.set_weights(weights)
    return clone
