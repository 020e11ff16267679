"""TF op layers (TFOpLambda) -> built-in Keras layers, so that TF-MOT can quantize them.

tf_keras records arithmetic on Keras tensors (``x + 3.0``, ``x * (1 / 6)``, ``a * b``) as
TFOpLambda layers, which TF-MOT can neither annotate nor clone (tf_keras'
MobileNetV3 builds its hard-sigmoid and hard-swish so). Each one that is a scalar
affine map of one tensor becomes ``Rescaling(scale, offset)``; each one that combines
two tensors becomes ``Add``/``Subtract``/``Multiply``; ``relu6`` becomes ``ReLU(6)``. The
outputs are the same to float rounding. Other TF ops are left as they are (the QAT dry
run then names them).

``SeparableConv2D`` (NASNet, Xception) becomes ``DepthwiseConv2D`` (NAME_depthwise) and a
1x1 ``Conv2D`` (NAME_pointwise) with the same weights: TF-MOT does this split itself, but
under generated names, so QAT's trained weights could not find their way back.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeq.models.compat import keras
from edgeq.transforms.graph import copy_weights, rebuild

_ADD = {"__operators__.add", "math.add"}
_SUB = {"math.subtract", "__operators__.sub"}
_MUL = {"math.multiply", "__operators__.mul"}
_DIV = {"math.truediv", "math.divide", "__operators__.truediv"}
_RELU6 = {"nn.relu6"}


@dataclass(frozen=True)
class Rewritten:
    layer: str  # the TFOpLambda's name
    op: str  # its TF symbol, e.g. __operators__.add
    became: str  # the built-in layer it is now


def _is_tensor(value) -> bool:
    return hasattr(value, "_keras_history") or hasattr(value, "node")


def _operands(node, args, kwargs):
    """(tensors, scalars) of a TF op call, in call order (x, y)."""
    values = list(args) + [kwargs[k] for k in ("x", "y") if k in kwargs]
    tensors = [v for v in values if _is_tensor(v)]
    scalars = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    first_is_tensor = bool(values) and _is_tensor(values[0])
    return tensors, scalars, first_is_tensor, len(values)


def _replacement(layer, node, args, kwargs):
    symbol = getattr(layer, "symbol", "")
    tensors, scalars, first_is_tensor, count = _operands(node, args, kwargs)
    name = layer.name.replace(".", "_")
    if symbol in _RELU6 and len(tensors) == 1 and count == 1:
        return keras.layers.ReLU(6.0, name=name), tensors
    if count != 2:
        return None, None
    if len(tensors) == 1 and len(scalars) == 1:
        c = float(scalars[0])
        if symbol in _ADD:
            return keras.layers.Rescaling(1.0, c, name=name), tensors
        if symbol in _SUB:
            scale, offset = (1.0, -c) if first_is_tensor else (-1.0, c)
            return keras.layers.Rescaling(scale, offset, name=name), tensors
        if symbol in _MUL:
            return keras.layers.Rescaling(c, 0.0, name=name), tensors
        if symbol in _DIV and first_is_tensor and c != 0:
            return keras.layers.Rescaling(1.0 / c, 0.0, name=name), tensors
    if len(tensors) == 2 and tuple(tensors[0].shape) == tuple(tensors[1].shape):
        for symbols, cls in ((_ADD, keras.layers.Add), (_SUB, keras.layers.Subtract), (_MUL, keras.layers.Multiply)):
            if symbol in symbols:
                return cls(name=name), [tensors]
    return None, None


def _split_separable(layer, args, pending: list):
    config = layer.get_config()
    name = layer.name
    depthwise = keras.layers.DepthwiseConv2D(
        kernel_size=config["kernel_size"],
        strides=config["strides"],
        padding=config["padding"],
        depth_multiplier=config["depth_multiplier"],
        data_format=config["data_format"],
        dilation_rate=config["dilation_rate"],
        use_bias=False,
        name=f"{name}_depthwise",
    )
    pointwise = keras.layers.Conv2D(
        config["filters"],
        1,
        data_format=config["data_format"],
        activation=config["activation"],
        use_bias=config["use_bias"],
        name=f"{name}_pointwise",
    )
    out = pointwise(depthwise(args[0]))
    weights = layer.get_weights()  # depthwise kernel, pointwise kernel[, bias]
    pending += [(depthwise, weights[:1]), (pointwise, weights[1:])]
    return out


_REWRITTEN = ("TFOpLambda", "SeparableConv2D")


def replace_tf_ops(model) -> tuple[object, list[Rewritten]]:
    """A copy of ``model`` with its TF op layers made built-in layers where they can be,
    and its SeparableConv2D layers split in two.

    Returns the model itself (and no rewrites) when there is nothing to rewrite.
    """
    if not any(type(layer).__name__ in _REWRITTEN for layer in model.layers):
        return model, []
    done: list[Rewritten] = []
    pending: list = []

    def rewrite(layer, node, args, kwargs):
        if type(layer).__name__ == "SeparableConv2D":
            done.append(Rewritten(layer.name, "SeparableConv2D", "DepthwiseConv2D+Conv2D"))
            return _split_separable(layer, args, pending)
        if type(layer).__name__ != "TFOpLambda":
            return None
        new_layer, inputs = _replacement(layer, node, args, kwargs)
        if new_layer is None:
            return None
        done.append(Rewritten(layer.name, getattr(layer, "symbol", "?"), type(new_layer).__name__))
        return new_layer(*inputs)

    rebuilt, clones = rebuild(model, rewrite)
    if not done:
        return model, []
    copy_weights(model, clones)
    for new_layer, weights in pending:
        new_layer.set_weights(weights)
    return rebuilt, done
