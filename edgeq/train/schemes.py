"""From a float Keras model to a fake-quantized QAT model, with TF-MOT.

Uses TF-MOT's default 8-bit scheme when every layer is 8/8 and its n-bit scheme
otherwise, through one registry that picks each layer's bits from the layer-wise plan.
Layers kept float are simply not annotated. Conv-BN(-ReLU) patterns are handled by the
schemes' layout transforms so that BN folds into the convolution on conversion.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from edgeq.errors import UnsupportedLayerError, UsageError
from edgeq.models.compat import keras, tfmot
from edgeq.quantize.configs import (
    CUSTOM_OBJECTS,
    SAME_SCALE_WRAPPED,
    OutputQuantizeConfig,
    SameScaleQuantizeConfig,
    WeightsOnlyQuantizeConfig,
)
from edgeq.quantize.plan_file import LayerPrecision
from edgeq.transforms.tfops import replace_tf_ops

_q = tfmot.quantization.keras
# Public TF-MOT names only: the 8-bit and n-bit registries and layout transforms, the
# quantizers and the wrapper are all exported by tfmot.quantization.keras.
_8bit = _q.default_8bit
_n_bit = _q.experimental.default_n_bit
_quantizers = _q.quantizers
QuantizeWrapper = _q.QuantizeWrapper

GRANULARITIES = ("per-channel", "per-tensor")
ACTIVATION_MODES = ("asymmetric", "symmetric")

# Layers that carry no weights and need no quantizer of their own: never an obstacle.
_UNQUANTIZED = ("InputLayer", "Dropout", "SpatialDropout1D", "SpatialDropout2D", "GaussianNoise")


@dataclass(frozen=True)
class QuantSettings:
    """The quantization a QAT stage simulates."""

    weight_bits: int = 8
    activation_bits: int = 8
    granularity: str = "per-channel"
    activations: str = "asymmetric"
    layers: dict[str, LayerPrecision] = field(default_factory=dict)  # layer-wise overrides

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise UsageError(f"--granularity must be one of {', '.join(GRANULARITIES)}")
        if self.activations not in ACTIVATION_MODES:
            raise UsageError(f"--activations must be one of {', '.join(ACTIVATION_MODES)}")
        if not 2 <= self.weight_bits <= 8:
            raise UsageError(f"--weight-bits must be between 2 and 8, got {self.weight_bits}")
        if self.activation_bits not in (8, 16):
            raise UsageError(f"--activation-bits must be 8 or 16, got {self.activation_bits}")

    def precision_of(self, name: str) -> LayerPrecision:
        return self.layers.get(name, LayerPrecision(self.weight_bits, self.activation_bits))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = {k: v.to_dict() for k, v in self.layers.items()}
        return d


class LayerwiseRegistry(_q.QuantizeRegistry):
    """Delegates each layer to a TF-MOT registry built for that layer's bits."""

    def __init__(self, settings: QuantSettings, annotated: frozenset[str] = frozenset()):
        self.settings = settings
        self.annotated = annotated  # edgeq's own output-only configs apply to these layers only
        self._per_tensor = settings.granularity == "per-tensor"
        self._cache: dict[tuple[int, int], _q.QuantizeRegistry] = {}

    def _registry(self, weight_bits: int, activation_bits: int):
        key = (weight_bits, activation_bits)
        if key not in self._cache:
            if key == (8, 8):
                self._cache[key] = _8bit.Default8BitQuantizeRegistry(disable_per_axis=self._per_tensor)
            else:
                self._cache[key] = _n_bit.DefaultNBitQuantizeRegistry(
                    disable_per_axis=self._per_tensor, num_bits_weight=weight_bits, num_bits_activation=activation_bits
                )
        return self._cache[key]

    def _for(self, layer):
        p = self.settings.precision_of(layer.name)
        return self._registry(p.weight_bits, p.activation_bits)

    def supports(self, layer) -> bool:
        return self._for(layer).supports(layer) or (layer.name in self.annotated and output_only(layer))

    def get_quantize_config(self, layer):
        if type(layer).__name__ in SAME_SCALE_WRAPPED:
            return SameScaleQuantizeConfig()
        registry = self._for(layer)
        if registry.supports(layer):
            return registry.get_quantize_config(layer)
        p = self.settings.precision_of(layer.name)
        return OutputQuantizeConfig(p.activation_bits, symmetric=p.activation_bits == 16)


_WEIGHTED = ("Conv2D", "DepthwiseConv2D", "Dense")

# Layers TF-MOT has no config for, whose TFLite ops have int8 kernels and need only their
# output range: edgeq quantizes their output (edgeq.quantize.configs.OutputQuantizeConfig).
_OUTPUT_ONLY = (
    "TFOpLambda",
    "Multiply",
    "Rescaling",
    "Normalization",
    "Activation",
    "Subtract",
    "Minimum",
    "Maximum",
    "UpSampling2D",
    "ZeroPadding2D",
    "Cropping2D",
    "BatchNormalization",  # only where no conv/dense precedes it to fold into (DenseNet, NASNet)
)


def output_only(layer) -> bool:
    """Whether edgeq quantizes this layer's output itself (TF-MOT has no config for it)."""
    kind = type(layer).__name__
    trainable = [w for w in layer.weights if w.trainable]
    # A standalone BN is a per-channel affine map (MUL + ADD with int8 kernels); its gamma and
    # beta train in float and become the converter's constants.
    return kind in _OUTPUT_ONLY and (not trainable or kind == "BatchNormalization")


class _LayoutTransform:
    """TF-MOT's layout transforms, minus one silent loss of weight quantization.

    TF-MOT's LayerReLUQuantize gives any Conv2D/DepthwiseConv2D/Dense followed by a ReLU
    layer a NoOpQuantizeConfig, meant for Add+ReLU: the weights would then train in
    float and be quantized post-training (never at 4 bits, never per-tensor). Such
    layers get their weights quantized here, with the output left to the ReLU.
    """

    def __init__(self, inner, registry: LayerwiseRegistry):
        self.inner = inner
        self.registry = registry

    def apply(self, model, layer_quantize_map):
        model, quantize_map = self.inner.apply(model, layer_quantize_map)
        for layer in model.layers:
            entry = quantize_map.get(layer.name)
            config = entry.get("quantize_config") if entry else None
            if (
                type(config).__name__ == "NoOpQuantizeConfig"
                and type(layer).__name__ in _WEIGHTED
                and self.registry.supports(layer)
            ):
                entry["quantize_config"] = WeightsOnlyQuantizeConfig(self.registry.get_quantize_config(layer))
        return model, quantize_map


class LayerwiseScheme(_q.QuantizeScheme):
    def __init__(self, settings: QuantSettings, annotated: frozenset[str] = frozenset()):
        self.settings = settings
        self.registry = LayerwiseRegistry(settings, annotated)

    def get_layout_transformer(self):
        if self.settings.weight_bits == 8 and self.settings.activation_bits == 8:
            inner = _8bit.Default8BitQuantizeLayoutTransform()
        else:
            inner = _n_bit.DefaultNBitQuantizeLayoutTransform(
                num_bits_weight=self.settings.weight_bits, num_bits_activation=self.settings.activation_bits
            )
        return _LayoutTransform(inner, self.registry)

    def get_quantize_registry(self):
        return self.registry


def quantizable_layer_names(model) -> list[str]:
    """Layers with weights, in graph order: the units of layer-wise plans and stepped stages."""
    return [layer.name for layer in model.layers if layer.weights and type(layer).__name__ != "InputLayer"]


def _check_model_kind(model) -> None:
    if not isinstance(model, keras.Model) or not (
        isinstance(model, keras.Sequential) or getattr(model, "_is_graph_network", False)
    ):
        raise UnsupportedLayerError(
            f"model {getattr(model, 'name', '?')!r} is a subclassed Keras model; TF-MOT quantizes only "
            "Sequential and Functional models: rebuild it with the functional API"
        )
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            raise UnsupportedLayerError(
                f"layer {layer.name!r} is a nested model ({type(layer).__name__}); TF-MOT cannot quantize nested "
                "models: flatten it into one functional model"
            )


_UNSUPPORTED = re.compile(r"Layer (?P<name>[^:]+):<class '(?P<cls>[^']+)'> is not supported")


def _producers(layer) -> list[str]:
    names = []
    for node in getattr(layer, "_inbound_nodes", [])[:1]:
        inbound = node.inbound_layers
        for producer in inbound if isinstance(inbound, (list, tuple)) else [inbound]:
            names.append(producer.name)
    return names


def layers_to_quantize(model, settings: QuantSettings, only_layers: set[str] | None = None) -> set[str]:
    """Names of the layers to annotate, in one pass over the graph in order.

    Layers with weights follow the plan (keep-float) and the stage (``only_layers``).
    BatchNormalization follows its producer: TF-MOT quantizes BN only folded into the
    conv/dense before it. Other weightless layers are quantized in full stages, and in
    partial stages only after a quantized layer.
    """
    keep_float = {name for name, p in settings.layers.items() if p.keep_float}
    chosen: set[str] = set()
    for layer in model.layers:
        kind = type(layer).__name__
        if kind in _UNQUANTIZED or layer.name in keep_float:
            continue
        producers = _producers(layer)
        if kind.startswith("BatchNormalization"):
            if producers and all(p in chosen for p in producers):
                chosen.add(layer.name)
        elif layer.weights:
            if only_layers is None or layer.name in only_layers:
                chosen.add(layer.name)
        elif only_layers is None or any(p in chosen for p in producers):
            chosen.add(layer.name)
    return chosen


# The activations TF-MOT 0.8.1's QuantizeAwareActivation accepts inside a wrapped layer
# (its _PRE_QUANT / _POST_QUANT sets); any other raises a ValueError naming no layer.
_QAT_ACTIVATIONS = frozenset({"linear", "relu", "swish", "gelu", "softmax", "sigmoid", "tanh"})


def _check_layers(model, settings: QuantSettings) -> None:
    """Layers no QAT can take, all named in one error: Python functions, custom classes, TF ops left."""
    keep_float = {name for name, p in settings.layers.items() if p.keep_float}
    problems = []
    for layer in model.layers:
        kind = type(layer).__name__
        if layer.name in keep_float:
            continue
        if kind == "Lambda":
            problems.append(f"{layer.name!r} (Lambda: a Python function TF-MOT cannot clone)")
        elif kind == "TFOpLambda":
            problems.append(f"{layer.name!r} (TF op {getattr(layer, 'symbol', '?')})")
        elif not type(layer).__module__.startswith(("tf_keras.", "keras.", "tensorflow_model_optimization.")):
            problems.append(f"{layer.name!r} ({kind}: a custom layer)")
        elif kind != "Activation" and callable(getattr(layer, "activation", None)):
            name = getattr(layer.activation, "__name__", type(layer.activation).__name__)
            if name not in _QAT_ACTIVATIONS:
                problems.append(f"{layer.name!r} ({kind} with activation {name!r}, which TF-MOT's QAT does not take)")
    if problems:
        raise UnsupportedLayerError(
            f"model {model.name!r} cannot be QAT-trained: {'; '.join(problems)}: rebuild those with built-in "
            "layers, keep them float with --layer-config, or quantize without training (edgeq convert --int8-only)"
        )


def float_layers(qat_model) -> list[str]:
    """Layers of a QAT model that run in float: neither wrapped nor pass-through."""
    return [
        layer.name
        for layer in qat_model.layers
        if not isinstance(layer, QuantizeWrapper)
        and type(layer).__name__ not in (*_UNQUANTIZED, "QuantizeLayer")
        and not isinstance(layer, keras.layers.InputLayer)
    ]


def build_qat_model(model, settings: QuantSettings, only_layers: set[str] | None = None):
    """Return the fake-quantized twin of ``model`` (weights copied; ``model`` untouched).

    Args:
        model: float Functional/Sequential tf_keras model.
        settings: bits, granularity, symmetric/asymmetric activations, layer-wise plan.
        only_layers: quantize just these layers (stepped schedules); None means all.
    """
    _check_model_kind(model)
    model, _ = replace_tf_ops(model)
    _check_layers(model, settings)
    to_quantize = layers_to_quantize(model, settings, only_layers)

    def annotate(layer):
        fresh = layer.__class__.from_config(layer.get_config())
        return _q.quantize_annotate_layer(fresh) if layer.name in to_quantize else fresh

    try:
        annotated = keras.models.clone_model(model, clone_function=annotate)
    except ValueError as exc:
        raise UnsupportedLayerError(f"TF-MOT cannot annotate model {model.name!r}: {str(exc).splitlines()[0]}") from exc
    annotated.set_weights(model.get_weights())
    try:
        with _q.quantize_scope(CUSTOM_OBJECTS):
            qat = _q.quantize_apply(annotated, scheme=LayerwiseScheme(settings, frozenset(to_quantize)))
    except RuntimeError as exc:
        match = _UNSUPPORTED.search(str(exc))
        if not match:
            raise
        cls = match.group("cls").rsplit(".", 1)[-1]
        raise UnsupportedLayerError(
            f"layer {match.group('name')!r} ({cls}) cannot be quantized by TF-MOT: leave it float with "
            f'--layer-config FILE containing {{"layers": {{"{match.group("name")}": "float"}}}}'
        ) from exc
    if settings.activation_bits == 16:
        # TFLite's 16x8 kernels take symmetric int16 activations only (zero point 0).
        set_symmetric_activations(qat, include_inputs=True)
    elif settings.activations == "symmetric":
        set_symmetric_activations(qat)
    return qat


def set_symmetric_activations(qat_model, include_inputs: bool = False) -> int:
    """Make every activation quantizer symmetric (zero point 0); returns how many changed.

    TF-MOT's activation quantizers take ``symmetric`` as a plain attribute read when the
    graph is traced, so switching it before the first fit/convert is enough. The model's
    input quantizer stays asymmetric: with a symmetric one the converter re-quantizes the
    int8 input through float (DEQUANTIZE -> QUANTIZE), and the model is no longer
    integer-only.
    """
    changed = 0
    seen = set()
    for layer in qat_model.layers:
        candidates = []
        if isinstance(layer, QuantizeWrapper):
            candidates += [a.quantizer for a in getattr(layer, "_quantize_activations", [])]
            candidates += list(getattr(layer, "_output_quantizers", []) or [])
        if include_inputs and type(layer).__name__ == "QuantizeLayer":
            candidates.append(layer.quantizer)
        for quantizer in candidates:
            if id(quantizer) in seen:
                continue
            seen.add(id(quantizer))
            if isinstance(quantizer, (_quantizers.MovingAverageQuantizer, _quantizers.AllValuesQuantizer)):
                quantizer.symmetric = True
                changed += 1
    return changed


def activation_bits_of(qat_model) -> set[int]:
    """Bit widths of the activation quantizers in a QAT model."""
    bits = set()
    for layer in qat_model.layers:
        quantizers = []
        if isinstance(layer, QuantizeWrapper):
            quantizers += [a.quantizer for a in getattr(layer, "_quantize_activations", [])]
            quantizers += list(getattr(layer, "_output_quantizers", []) or [])
        for quantizer in quantizers:
            if isinstance(quantizer, _quantizers.MovingAverageQuantizer):
                bits.add(int(quantizer.num_bits))
    return bits


def copy_float_weights(qat_model, float_model) -> None:
    """Copy the trained float weights inside the QAT wrappers back into the float model."""
    by_name = {layer.name: layer for layer in qat_model.layers}
    for layer in float_model.layers:
        if not layer.weights:
            continue
        source = by_name.get(f"quant_{layer.name}", by_name.get(layer.name))
        if source is None:
            raise RuntimeError(f"layer {layer.name} has no counterpart in the QAT model")
        if not isinstance(source, QuantizeWrapper):  # a layer the stage left float
            layer.set_weights(source.get_weights())
            continue
        # Inside a QuantizeWrapper the wrapped layer's variables are tracked by the
        # wrapper, beside the quantizers' own (min/max, optimizer_step): match by name.
        available = {v.name.split("/", 1)[-1]: v for v in source.weights if not v.name.startswith(source.name + "/")}
        values = []
        for weight in layer.weights:
            key = weight.name.split("/", 1)[-1]
            if key not in available:
                raise RuntimeError(f"weight {weight.name} of layer {layer.name} not found in {source.name}")
            values.append(available[key].numpy())
        layer.set_weights(values)
