"""What each activation fake-quant of a QAT model would see, and ranges set from it.

A QAT model's activation fake-quants start at TF-MOT's default range [-6, 6] and move
towards the data by a slow moving average. Observing the float model's tensors on
calibration samples once gives each fake-quant its range before the first step
(``initialize_ranges``; ``edgeq train --init-ranges``). Post-training quantization does
not come here: it re-ranges the converter's own calibration (edgeq.quantize.calibration).
"""

from __future__ import annotations

import numpy as np

from edgeq.models.compat import keras
from edgeq.quantize.configs import SAME_SCALE_LAYERS
from edgeq.quantize.ranges import Observer, activation_range
from edgeq.train import schemes
from edgeq.transforms.tfops import replace_tf_ops


def suffix(variable, layer=None) -> str:
    """'quant_conv/kernel_min:0' -> 'kernel_min'; 'quantize_layer_1/quantize_layer_1_min:0' -> 'quantize_layer_min'.

    Keras numbers the names of repeated layers in one process, and TF-MOT's QuantizeLayer
    puts its own layer name into its variables' names.
    """
    name = variable.name.split("/")[-1].split(":")[0]
    if layer is not None and name.startswith(f"{layer.name}_") and layer.name.startswith("quantize_layer"):
        return "quantize_layer_" + name[len(layer.name) + 1 :]
    return name


def by_suffix(layer) -> dict:
    return {suffix(v, layer): v for v in layer.weights}


def _linear_twin(layer):
    """The layer with a linear activation and the same weights: its pre-activation output."""
    config = {**layer.get_config(), "activation": "linear", "name": f"{layer.name}__pre_activation"}
    twin = layer.__class__.from_config(config)
    twin.build(layer.input_shape)
    twin.set_weights(layer.get_weights())
    return twin


def activation_points(float_model, qat_model):
    """[(min variable, max variable, float tensor, layer name)] for every activation fake-quant.

    ``float_model`` is the model ``qat_model`` was built from, after ``replace_tf_ops``
    (layer names match).
    """
    points = []
    names = {la.name for la in float_model.layers}
    for layer in qat_model.layers:
        found = by_suffix(layer)
        if type(layer).__name__ == "QuantizeLayer":
            low, high = found["quantize_layer_min"], found["quantize_layer_max"]
            points.append((low, high, float_model.inputs[0], "input"))
            continue
        if not isinstance(layer, schemes.QuantizeWrapper):
            continue
        if layer.layer.name not in names:  # a layer TF-MOT's transforms made: no float twin to observe
            continue
        source = float_model.get_layer(layer.layer.name)
        for kind in ("output", "post_activation"):
            if f"{kind}_min" in found:
                points.append((found[f"{kind}_min"], found[f"{kind}_max"], source.output, source.name))
        if "pre_activation_min" in found:
            pre = _linear_twin(source)(source.input)
            points.append((found["pre_activation_min"], found["pre_activation_max"], pre, source.name))
    return points


def observe(float_model, points, x: np.ndarray, batch_size: int = 16, seed: int = 0) -> list[Observer]:
    """One pass of the float model over ``x``: an Observer per point."""
    probe = keras.Model(float_model.inputs, [tensor for _, _, tensor, _ in points])
    observers = [Observer(seed) for _ in points]
    for start in range(0, len(x), batch_size):
        outputs = probe(x[start : start + batch_size], training=False)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        for observer, value in zip(observers, outputs):
            observer.add(np.asarray(value))
    return observers


# Layers whose int8 kernels take one scale on input and output. With a fake-quant of their
# own, its range and their inputs' become one; without one (TF-MOT leaves an AveragePooling2D
# that feeds a concatenation unquantized), their output is observed for the same purpose.
_RANGE_PRESERVING = ("MaxPooling2D", "ZeroPadding2D", "Reshape", "Flatten", "Cropping2D", "Dropout")


def unquantized_same_scale(float_model, points, x: np.ndarray, batch_size: int = 16, seed: int = 0) -> dict:
    """{name: Observer of its output on ``x``} of the same-scale layers of ``float_model``
    without a fake-quant on their output among ``points``. Their ranges are chosen by the same
    method as every other tensor's (the converter's calibration records these outputs too)."""
    covered = {layer for low_var, _, _, layer in points if layer == "input" or _is_output(low_var)}
    layers = [la for la in float_model.layers if type(la).__name__ in SAME_SCALE_LAYERS and la.name not in covered]
    if not layers:
        return {}
    observers = observe(float_model, [(None, None, la.output, la.name) for la in layers], x, batch_size, seed)
    return {la.name: o for la, o in zip(layers, observers)}


def _is_output(low_var) -> bool:
    return suffix(low_var) in ("output_min", "post_activation_min")


def same_scale_ranges(
    float_model, points, ranges: list[tuple[float, float]], unquantized: dict | None = None
) -> list[tuple[float, float]]:
    """``ranges`` (one per point of ``activation_points``) with the inputs and output of every
    concatenation and pooling given one range.

    TFLite's int8 CONCATENATION, AVERAGE_POOL_2D and MAX_POOL_2D (and a PAD before them) take
    one scale for all their tensors. The converter's own calibration sets them so; fake-quant
    ranges set per tensor make it insert a QUANTIZE op, a second rounding, for each input
    whose range differs (20 of them in a DenseNet121). A chain of concatenations, one feeding
    the next, becomes one group. As the converter does, a group with concatenations takes the
    range of their outputs (their union); a group without one (conv -> pad -> pooling) the
    union of its members' ranges, but a tensor that feeds only an average pooling takes the
    pooling's narrower output range instead of widening the group's. With min/max ranges the
    two rules agree (a concatenation's output holds every input value); with a clipping
    method they do not, and the converter's is the one its post-training quantization builds
    for the same method. ``unquantized`` gives the chosen output range of same-scale layers without a
    fake-quant (from ``unquantized_same_scale``).
    """
    unquantized = unquantized or {}
    outputs = {}  # layer name -> index of the node on its output
    for i, (low_var, _, _, layer) in enumerate(points):
        if layer == "input" or _is_output(low_var):
            outputs.setdefault(layer, i)
    nodes = list(ranges)
    for name, observed in unquantized.items():
        outputs.setdefault(name, len(nodes))
        nodes.append(observed)
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    inputs = {id(t) for t in float_model.inputs}
    followers = set()  # nodes that take their group's range and do not widen it
    concatenated = set()  # nodes on a concatenation's output: their range is their group's
    for layer in float_model.layers:
        if type(layer).__name__ not in SAME_SCALE_LAYERS or layer.name not in outputs:
            continue
        feeds = layer.input if isinstance(layer.input, (list, tuple)) else [layer.input]
        found = [_range_of(tensor, outputs, inputs) for tensor in feeds]
        if any(node is None for node, _ in found):  # a producer without a range: leave this layer alone
            continue
        if type(layer).__name__ == "Concatenate":
            concatenated.add(outputs[layer.name])
        for node, only_here in found:
            if type(layer).__name__ == "AveragePooling2D" and only_here:
                followers.add(node)
            parent[root(node)] = root(outputs[layer.name])
    groups: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        groups.setdefault(root(i), []).append(i)
    unified = list(ranges)
    for members in groups.values():
        if len(members) < 2:
            continue
        leaders = [i for i in members if i in concatenated] or [i for i in members if i not in followers] or members
        low = min(nodes[i][0] for i in leaders)
        high = max(nodes[i][1] for i in leaders)
        for i in members:
            if i < len(unified):
                unified[i] = (low, high)
    return unified


def _range_of(tensor, outputs: dict, inputs: set) -> tuple[int | None, bool]:
    """The node whose range ``tensor`` has (its producer's, or through pass-through and
    unquantized same-scale layers the nearest quantized one's before; None when there is
    none), and whether every tensor on the way has one consumer only."""
    only = True
    while id(tensor) not in inputs:
        producer = tensor._keras_history.layer
        only = only and len(producer._outbound_nodes) == 1
        if producer.name in outputs:
            return outputs[producer.name], only
        if type(producer).__name__ not in _RANGE_PRESERVING + SAME_SCALE_LAYERS:
            return None, only
        tensor = producer.input
    return outputs.get("input"), only


# Preprocessing layers: a fixed affine map of the input, with no weights that train.
_PREPROCESSING = ("Rescaling", "Normalization")


def input_preprocessing(float_model) -> set[str]:
    """Names of the Rescaling/Normalization layers fed only by the input or by each other.

    Their outputs are the input under a fixed affine map: EfficientNet's ``x / 255`` on an
    input already in [0, 1] spans 0.004, far below one step of TF-MOT's [-6, 6] start, so
    their fake-quants would output zeros everywhere, and training-mode batch norms
    amplify the zero-variance batches' gradients to infinity.
    """
    chain: set[str] = set()
    inputs = {id(t) for t in float_model.inputs}
    for layer in float_model.layers:
        if type(layer).__name__ not in _PREPROCESSING:
            continue
        try:
            feeds = layer.input if isinstance(layer.input, (list, tuple)) else [layer.input]
        except AttributeError:  # a layer called more than once has no single input
            continue
        sources = [t._keras_history.layer.name if id(t) not in inputs else None for t in feeds]
        if all(name is None or name in chain for name in sources):
            chain.add(layer.name)
    return chain


def initialize_ranges(
    qat_model,
    float_model,
    x: np.ndarray,
    method: str = "mse",
    bits: int = 8,
    symmetric: bool = False,
    only: set[str] | None = None,
) -> int:
    """Set every activation fake-quant range of a freshly built ``qat_model`` from ``x``.

    Returns how many ranges were set. Symmetric activations get [-m, m]. ``method`` is one
    of edgeq.quantize.ranges.ACTIVATION_METHODS. ``only`` limits it to the outputs of those layers.
    """
    float_model, _ = replace_tf_ops(float_model)
    points = activation_points(float_model, qat_model)
    if only is not None:
        points = [point for point in points if point[3] in only]
    if not points:
        return 0
    ranges = []
    for observer in observe(float_model, points, x):
        if not (np.isfinite(observer.low) and np.isfinite(observer.high)) or observer.high - observer.low < 1e-6:
            ranges.append((np.inf, -np.inf))  # a dead or exploding tensor: TF-MOT's start is the safer one
            continue
        # 16-bit activations lose nothing to outliers worth clipping: keep every value
        ranges.append(activation_range(observer.values(), method if bits <= 8 else "minmax", bits=bits))
    if only is None:  # what TFLite's concatenation and pooling kernels need: one range for their tensors
        observed = unquantized_same_scale(float_model, points, x)
        chosen = {
            name: activation_range(o.values(), method if bits <= 8 else "minmax", bits=bits)
            for name, o in observed.items()
        }
        ranges = same_scale_ranges(float_model, points, ranges, chosen)
    done = 0
    for (low_var, high_var, _, _), (low, high) in zip(points, ranges):
        if not low < high:
            continue
        if symmetric:
            low, high = -max(-low, high), max(-low, high)
        low_var.assign(low)
        high_var.assign(high)
        done += 1
    return done
