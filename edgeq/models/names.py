"""The names of a Keras model's inputs and outputs, as edgeq's .tflite signatures carry them.

No TensorFlow import: attribute reads on a model of either Keras. Everything that matches
outputs (convert's verification, eval, the converter's signature) asks here.
"""

from __future__ import annotations


def producer_of(tensor):
    """The layer that produced a Keras tensor (None when unknown)."""
    history = getattr(tensor, "_keras_history", None)
    return history[0] if history else None


def _tensor_name(tensor, fallback: str) -> str:
    name = getattr(tensor, "name", None) or fallback
    return str(name).split(":")[0].replace("/", "_")


def input_names(model) -> list[str]:
    """The model's input names, in its own order: what the .tflite signature calls them too."""
    names = getattr(model, "input_names", None)
    if names and len(names) == len(model.inputs):
        return [str(n) for n in names]
    return [_tensor_name(t, f"input_{i}") for i, t in enumerate(model.inputs)]


def output_names(model) -> list[str]:
    """The model's output names, in its own order (edgeq's .tflite signature uses the same).

    A QAT model's output layers are TF-MOT wrappers named ``quant_<layer>``: the output keeps
    the float layer's name, so a QAT model's .tflite and its FP32 reference name it alike.
    """
    names = getattr(model, "output_names", None)
    if not names or len(names) != len(model.outputs):
        # a Keras 3 Sequential has no output_names: its output is its last layer's, as in its tf_keras twin
        layers = [getattr(producer_of(t), "name", None) for t in model.outputs]
        if all(layers) and len(set(layers)) == len(layers):
            return [str(n) for n in layers]
        return [f"output_{i}" for i in range(len(model.outputs))]
    result = []
    for name, tensor in zip(names, model.outputs):
        layer = producer_of(tensor)
        inner = getattr(layer, "layer", None)
        if type(layer).__name__.startswith("QuantizeWrapper") and inner is not None and name == layer.name:
            name = inner.name
        result.append(str(name))
    return result
