"""Rebuild a functional tf_keras model node by node, with some layers replaced.

The functional graph has no public walker: ``_nodes_by_depth`` and each node's
``call_args``/``call_kwargs`` are what Keras itself uses to clone a model, and the only
way to replace one layer by another of a different kind (or by nothing) in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edgeq.models.compat import keras, tf

# rewrite(layer, node, args, kwargs) -> the new outputs for this call, or None to clone
# the layer as it is. args/kwargs are the node's call arguments already mapped to the
# new graph's tensors.
Rewrite = Callable[[Any, Any, tuple, dict], Any]


def rebuild(model, rewrite: Rewrite | None = None, name: str | None = None):
    """A new functional model with the same graph, each layer cloned or rewritten.

    Returns (model, clones) where clones maps an old layer name to its clone (layers a
    rewrite replaced are absent); the caller sets weights. A layer called several times
    (shared) is cloned once and called as often.
    """
    mapped: dict[int, Any] = {}
    new_inputs = []
    for tensor in model.inputs:
        fresh = keras.Input(shape=tensor.shape[1:], dtype=tensor.dtype, name=tensor.name.split(":")[0])
        mapped[id(tensor)] = fresh
        new_inputs.append(fresh)

    def lookup(t):
        return mapped.get(id(t), t)

    clones: dict[str, Any] = {}
    nodes_by_depth = model._nodes_by_depth  # noqa: SLF001 - see the module docstring
    for depth in sorted(nodes_by_depth, reverse=True):
        for node in nodes_by_depth[depth]:
            layer = node.layer
            if type(layer).__name__ == "InputLayer":
                continue
            args = tf.nest.map_structure(lookup, node.call_args)
            kwargs = tf.nest.map_structure(lookup, node.call_kwargs)
            outputs = rewrite(layer, node, args, kwargs) if rewrite is not None else None
            if outputs is None:
                clone = clones.get(layer.name)
                if clone is None:
                    clone = clones[layer.name] = layer.__class__.from_config(layer.get_config())
                outputs = clone(*args, **kwargs)
            for old, new in zip(tf.nest.flatten(node.outputs), tf.nest.flatten(outputs)):
                mapped[id(old)] = new
    new_outputs = [mapped[id(t)] for t in model.outputs]
    rebuilt = keras.Model(new_inputs, new_outputs if len(new_outputs) > 1 else new_outputs[0], name=name or model.name)
    return rebuilt, clones


def copy_weights(model, clones: dict[str, Any], overrides: dict[str, list] | None = None) -> None:
    """Give each clone its original's weights (or ``overrides[name]``)."""
    overrides = overrides or {}
    for layer_name, clone in clones.items():
        weights = overrides.get(layer_name)
        clone.set_weights(weights if weights is not None else model.get_layer(layer_name).get_weights())
