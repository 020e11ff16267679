"""Batch-norm folding in Keras: Conv/Depthwise/Dense + BatchNormalization -> one layer.

TF-MOT's own scheme keeps BN during QAT and leaves the fold to the converter, which is
right for per-channel weights. With per-tensor weights the converter folds BN's
per-channel scale into weights already quantized with one scale, and the model it
writes is wrong (tensorflow/model-optimization#865, #1131). Folding first, in Keras,
makes the fake-quantized weights the very weights that get deployed.
"""

from __future__ import annotations

import numpy as np

from edgeq.models.compat import keras
from edgeq.transforms.graph import copy_weights, rebuild

_FOLDABLE = ("Conv2D", "DepthwiseConv2D", "Dense", "Conv1D")


def _inbound(layer):
    nodes = layer._inbound_nodes  # noqa: SLF001 - the functional graph has no public walker
    if len(nodes) != 1:
        raise ValueError(f"layer {layer.name!r} is used {len(nodes)} times; folding needs each layer used once")
    return nodes[0]


def foldable_pairs(model) -> dict[str, str]:
    """{bn layer name: producer layer name} for every BN that can be folded."""
    pairs = {}
    for layer in model.layers:
        if type(layer).__name__ != "BatchNormalization" or len(layer._inbound_nodes) != 1:  # noqa: SLF001
            continue  # a BN applied twice has one set of statistics for two inputs: left as it is
        node = _inbound(layer)
        producers = node.inbound_layers if isinstance(node.inbound_layers, list) else [node.inbound_layers]
        if len(producers) != 1:
            continue
        producer = producers[0]
        axis = list(np.atleast_1d(layer.axis))
        rank = len(layer.input_shape)
        if type(producer).__name__ not in _FOLDABLE or axis not in ([-1], [rank - 1]):
            continue
        if len(producer._inbound_nodes) != 1:  # noqa: SLF001 - a shared conv: its other uses have no BN
            continue
        if len(producer._outbound_nodes) != 1 or getattr(producer, "activation", None) not in (  # noqa: SLF001
            None,
            keras.activations.linear,
        ):
            continue
        pairs[layer.name] = producer.name
    return pairs


def needs_fold_before_qat(model) -> list[str]:
    """BN layers that follow a Dense or Conv1D: TF-MOT folds BN into Conv2D/DepthwiseConv2D only,
    so with these unfolded the QAT model quantizes a different graph than the converter folds
    (a Dense-BN autoencoder's QAT .tflite read 0.9 dB against its QAT model). They are folded first."""
    by_name = {layer.name: layer for layer in model.layers}
    return [
        bn for bn, producer in foldable_pairs(model).items() if type(by_name[producer]).__name__ in ("Dense", "Conv1D")
    ]


def _folded_weights(producer, bn):
    weights = producer.get_weights()
    kernel = weights[0]
    bias = weights[1] if producer.use_bias else np.zeros(bn.moving_mean.shape, kernel.dtype)
    gamma = bn.gamma.numpy() if bn.scale else np.ones(bn.moving_mean.shape, kernel.dtype)
    beta = bn.beta.numpy() if bn.center else np.zeros(bn.moving_mean.shape, kernel.dtype)
    mean, var = bn.moving_mean.numpy(), bn.moving_variance.numpy()
    scale = gamma / np.sqrt(var + bn.epsilon)
    if type(producer).__name__ == "DepthwiseConv2D":
        kernel = kernel * scale.reshape(kernel.shape[2], kernel.shape[3])
    else:
        kernel = kernel * scale  # last axis is the output channel
    if type(producer).__name__ == "DepthwiseConv2D" and producer.use_bias:
        bias = weights[1]
    return [kernel.astype(np.float32), ((bias - mean) * scale + beta).astype(np.float32)]


def fold_batchnorm(model):
    """A new functional model with every foldable BN folded into the layer before it.

    Outputs match the original to float rounding (inference mode). Returns the model
    unchanged in structure when there is nothing to fold.
    """
    pairs = foldable_pairs(model)
    if not pairs:
        return model
    producers = set(pairs.values())
    by_name = {layer.name: layer for layer in model.layers}
    folded_bn_of = {producer: bn for bn, producer in pairs.items()}

    def rewrite(layer, node, args, kwargs):
        if layer.name in pairs:  # BN: its output is the folded producer's output
            return args[0]
        if layer.name in producers:
            config = {**layer.get_config(), "use_bias": True}
            clone = clones_with_bias[layer.name] = layer.__class__.from_config(config)
            return clone(*args, **kwargs)
        return None

    clones_with_bias: dict[str, object] = {}
    folded, clones = rebuild(model, rewrite)
    clones.update(clones_with_bias)
    copy_weights(
        model,
        clones,
        {name: _folded_weights(by_name[name], by_name[folded_bn_of[name]]) for name in producers},
    )
    return folded


def folded_copy(model):
    """``fold_batchnorm(model)``, always a new model: with nothing to fold, a clone with the same
    weights, so a caller that then edits weights never changes the model it was given."""
    folded = fold_batchnorm(model)
    if folded is model:
        folded = keras.models.clone_model(model)
        folded.set_weights(model.get_weights())
    return folded
