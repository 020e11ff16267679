"""Quantization-aware training on Keras 3 layers: no TF-MOT, no tf_keras translation, no legacy switch.

A functional Keras 3 model is rebuilt with fake quantization where the TFLite converter reads it:

- Conv2D, DepthwiseConv2D and Dense become one ``QuantizedOp`` each, with the BatchNormalization after
  them folded in as the converter folds it (frozen statistics: kernel x gamma/sqrt(var+eps), the shift
  into the bias) and the ReLU/ReLU6 after them fused. Its weights are fake-quantized symmetric per
  channel (narrow range, as TFLite's int8 kernels want), its output asymmetric per tensor.
- The inputs, Add, Concatenate, Multiply, Subtract, Average, Maximum, Minimum, Rescaling, Normalization
  and every activation that is not fused get an ``ActivationQuantizer`` on their output: asymmetric per
  tensor, its range an exponential moving average of each batch's min and max.
- Layers that keep their input's scale (pooling, padding, reshapes, dropout, max) get none; sigmoid and
  softmax neither (TFLite fixes their output scale).

Fake quantization is ``keras.quantizers.fake_quant_with_min_max_vars``: on the TensorFlow backend it is
TF's FakeQuantWithMinMaxVars(PerChannel), which the converter turns into the int8 file's scales, so
``convert --int8-only`` of the trained model gives the trained ranges.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from edgeq.errors import UsageError

PACKAGE = "edgeq"
EMA = 0.99  # per batch: the range follows the last few hundred batches

_FOLDABLE = ("Conv2D", "DepthwiseConv2D", "Dense")
_QUANTIZED_OUTPUT = (
    "Add", "Concatenate", "Multiply", "Subtract", "Average", "Maximum", "Minimum", "Rescaling",
    "Normalization", "ReLU", "Activation", "LeakyReLU", "PReLU", "ELU", "Conv1D", "UpSampling2D",
    "GlobalAveragePooling2D", "GlobalAveragePooling1D", "AveragePooling2D",
)  # fmt: skip
_SAME_SCALE = (
    "InputLayer", "MaxPooling2D", "MaxPooling1D", "GlobalMaxPooling2D", "ZeroPadding2D", "Flatten",
    "Reshape", "Dropout", "SpatialDropout2D", "Permute", "Cropping2D", "Identity", "Softmax",
)  # fmt: skip
_RESCALERS = ("Rescaling", "Normalization")
# ops on tensors that keep their input's scale (the rest, x + 3.0 or x * y, get a quantizer on their output)
_SAME_SCALE_OPS = ("Reshape", "Transpose", "Squeeze", "ExpandDims", "GetItem", "Flatten", "Sigmoid", "Softmax")
_FIXED_OUTPUT = ("sigmoid", "softmax", "tanh", "hard_sigmoid")
_FUSED_ACTIVATIONS = ("linear", "relu", "relu6")


@keras.saving.register_keras_serializable(package=PACKAGE)
class ActivationQuantizer(keras.layers.Layer):
    """Asymmetric per-tensor fake quantization; the range an EMA of batch min/max while training.
    Not ``enabled`` (a stage that leaves this part float, a float layer), it passes its input through and
    keeps following the range, so a later stage starts from the data's."""

    def __init__(self, num_bits: int = 8, ema: float = EMA, enabled: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.num_bits = int(num_bits)
        self.ema = float(ema)
        self.enabled = bool(enabled)

    def build(self, input_shape):
        self.range_min = self.add_weight(name="range_min", shape=(), initializer="zeros", trainable=False)
        self.range_max = self.add_weight(name="range_max", shape=(), initializer="zeros", trainable=False)
        self.seen = self.add_weight(name="seen", shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            low = ops.minimum(ops.min(ops.stop_gradient(x)), 0.0)
            high = ops.maximum(ops.max(ops.stop_gradient(x)), 0.0)
            first = ops.cast(self.seen < 0.5, x.dtype)
            keep = self.ema * (1.0 - first)
            self.range_min.assign(keep * self.range_min + (1.0 - keep) * low)
            self.range_max.assign(keep * self.range_max + (1.0 - keep) * high)
            self.seen.assign(ops.ones_like(self.seen))
        if not self.enabled:
            return x
        high = ops.maximum(self.range_max, self.range_min + 1e-6)
        return keras.quantizers.fake_quant_with_min_max_vars(
            x, self.range_min, high, num_bits=self.num_bits, narrow_range=False
        )

    def compute_output_spec(self, x, training=None):
        # dense, whatever an op's symbolic output claimed (x * 0.5 on a scalar is marked sparse): it is dense
        return keras.KerasTensor(x.shape, dtype=x.dtype)

    def get_config(self):
        return {**super().get_config(), "num_bits": self.num_bits, "ema": self.ema, "enabled": self.enabled}


@keras.saving.register_keras_serializable(package=PACKAGE)
class QuantizedOp(keras.layers.Layer):
    """A Conv2D, DepthwiseConv2D or Dense with its BatchNormalization folded (frozen statistics), its
    ReLU fused, its weights fake-quantized symmetric per output channel and its output per tensor.
    ``enabled`` False keeps its weights float (a float layer of a layer-wise plan, or a stage that has not
    reached it); its output quantizer has its own flag, ``output_enabled``."""

    def __init__(self, op: dict, batchnorm: dict | None = None, activation: str = "linear",
                 num_bits: int = 8, enabled: bool = True, output_enabled: bool = True, **kwargs):  # fmt: skip
        super().__init__(**kwargs)
        self.enabled = bool(enabled)
        self.op_config = op
        self.bn_config = batchnorm
        self.activation = activation
        self.num_bits = int(num_bits)
        self.inner = keras.layers.deserialize(op)
        self.kind = type(self.inner).__name__
        self.epsilon = float(batchnorm["config"]["epsilon"]) if batchnorm else 0.0
        self.output_quantizer = ActivationQuantizer(num_bits=num_bits, enabled=output_enabled, name="output_quantizer")

    def build(self, input_shape):
        if not self.inner.built:
            self.inner.build(input_shape)
        channels = self._channels()
        if self.bn_config:
            self.gamma = self.add_weight(name="gamma", shape=(channels,), initializer="ones")
            self.beta = self.add_weight(name="beta", shape=(channels,), initializer="zeros")
            self.moving_mean = self.add_weight(name="moving_mean", shape=(channels,), initializer="zeros",
                                               trainable=False)  # fmt: skip
            self.moving_variance = self.add_weight(name="moving_variance", shape=(channels,), initializer="ones",
                                                   trainable=False)  # fmt: skip
        if not self.output_quantizer.built:
            self.output_quantizer.build(None)

    def _kernel(self):
        return self.inner.kernel

    def _channels(self) -> int:
        shape = tuple(self._kernel().shape)
        return shape[2] * shape[3] if self.kind == "DepthwiseConv2D" else shape[-1]

    def folded(self):
        """The kernel and bias the int8 file holds, before fake quantization."""
        kernel = self._kernel()
        bias = self.inner.bias if self.inner.use_bias else ops.zeros((self._channels(),))
        if not self.bn_config:
            return kernel, bias
        scale = self.gamma / ops.sqrt(self.moving_variance + self.epsilon)
        if self.kind == "DepthwiseConv2D":  # (kh, kw, in, multiplier): one scale per in x multiplier channel
            kernel = kernel * ops.reshape(scale, (1, 1, kernel.shape[2], kernel.shape[3]))
        else:
            kernel = kernel * scale
        return kernel, (bias - self.moving_mean) * scale + self.beta

    def call(self, x, training=None):
        kernel, bias = self.folded()
        if self.enabled:
            kernel = self._fake_quantized(kernel)
        inner = self.inner
        if self.kind == "Conv2D":
            y = ops.conv(x, kernel, inner.strides, inner.padding, inner.data_format, inner.dilation_rate)
        elif self.kind == "DepthwiseConv2D":
            y = ops.depthwise_conv(x, kernel, inner.strides, inner.padding, inner.data_format, inner.dilation_rate)
        else:
            y = ops.matmul(x, kernel)
        y = y + bias
        if self.activation == "relu":
            y = ops.relu(y)
        elif self.activation == "relu6":
            y = ops.relu6(y)
        y = self.output_quantizer(y, training=training)
        # an activation of its own that is not fused (softmax, swish): after the quantized sum, as the converter
        # runs it (its own output quantizer follows, where TFLite does not fix that scale)
        return y if self.activation != "linear" else self.inner.activation(y)

    def _fake_quantized(self, kernel):
        """Symmetric, narrow range, per output channel (Dense: per tensor)."""
        if self.kind == "DepthwiseConv2D":
            shape = tuple(kernel.shape)
            flat = ops.reshape(kernel, (*shape[:2], 1, shape[2] * shape[3]))
            limit = ops.max(ops.abs(flat), axis=(0, 1, 2))
        elif self.kind == "Dense":  # per tensor: the converter transposes a MatMul's kernel, not its channel axis
            flat = kernel
            limit = ops.max(ops.abs(flat))
        else:
            flat = kernel
            limit = ops.max(ops.abs(flat), axis=tuple(range(len(kernel.shape) - 1)))
        limit = ops.stop_gradient(ops.maximum(limit, 1e-8))  # a range, as TF-MOT's last-value quantizer: no gradient
        flat = keras.quantizers.fake_quant_with_min_max_vars(
            flat, -limit, limit, num_bits=self.num_bits, narrow_range=True, axis=None if self.kind == "Dense" else -1
        )
        return ops.reshape(flat, kernel.shape)

    def compute_output_shape(self, input_shape):
        return self.inner.compute_output_shape(input_shape)

    def get_config(self):
        return {**super().get_config(), "op": self.op_config, "batchnorm": self.bn_config,
                "activation": self.activation, "num_bits": self.num_bits, "enabled": self.enabled,
                "output_enabled": self.output_quantizer.enabled}  # fmt: skip


@keras.saving.register_keras_serializable(package=PACKAGE)
class FlatReshape(keras.layers.Layer):
    """Reshape to ``(-1, *target_shape)``: one constant shape. Keras's Reshape reads the batch from the
    tensor (SHAPE, STRIDED_SLICE, PACK in the .tflite: ops outside XNNPACK that split its graph)."""

    def __init__(self, target_shape, **kwargs):
        super().__init__(**kwargs)
        self.target_shape = tuple(int(d) for d in target_shape)

    def call(self, x):
        return ops.reshape(x, (-1, *self.target_shape))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], *self.target_shape)

    def get_config(self):
        return {**super().get_config(), "target_shape": list(self.target_shape)}


def _activation_of(layer) -> str | None:
    """'relu', 'relu6' or 'linear' for a layer that is only that activation, else None."""
    name = type(layer).__name__
    if name == "ReLU":
        c = layer.get_config()
        if c.get("negative_slope", 0) == 0 and c.get("threshold", 0) == 0:
            return "relu" if c.get("max_value") is None else ("relu6" if c.get("max_value") == 6 else None)
        return None
    if name == "Activation":
        fn = keras.activations.serialize(layer.activation)
        fn = fn if isinstance(fn, str) else fn.get("config", fn.get("class_name"))
        return fn if fn in _FUSED_ACTIVATIONS else None
    return None


def _activation_name(layer) -> str:
    fn = keras.activations.serialize(layer.activation)
    return fn if isinstance(fn, str) else str(fn.get("config", fn.get("class_name")))


class _Graph:
    """Who consumes each layer's output, in a functional model of single-use layers."""

    def __init__(self, model):
        self.consumers: dict[str, list] = {op.name: [] for op in model.operations}
        self.outputs = {t._keras_history[0].name for t in model.outputs}
        # the nodes of this graph only: a layer of a Sequential model, or one a model was rebuilt around, also
        # keeps the nodes of the graphs it was called in before
        self.nodes: dict[str, list] = {op.name: [] for op in model.operations}
        for nodes in model._nodes_by_depth.values():
            for node in nodes:
                self.nodes[node.operation.name].append(node)
                for parent in node.parent_nodes:
                    self.consumers[parent.operation.name].append(node.operation)
        self.shared = [op for op in model.operations if len(self.nodes[op.name]) > 1]

    def only_consumer(self, layer):
        users = self.consumers.get(layer.name, [])
        return users[0] if len(users) == 1 and layer.name not in self.outputs else None


def _plan(model) -> tuple[dict, set]:
    """{conv/dense name: (bn layer or None, fused activation, its own unfused activation or None)} and the
    layers folded away."""
    graph = _Graph(model)
    fused, absorbed = {}, set()
    for layer in model.layers:
        kind = type(layer).__name__
        if kind not in _FOLDABLE:
            continue
        own = _activation_name(layer)
        if own not in _FUSED_ACTIVATIONS:
            fused[layer.name] = (None, "linear", own)
            continue
        bn, activation = None, own
        nxt = graph.only_consumer(layer)
        if own == "linear" and nxt is not None and type(nxt).__name__ == "BatchNormalization" and kind != "Dense":
            axis = nxt.axis if isinstance(nxt.axis, int) else nxt.axis[0]
            if axis in (-1, len(layer.output.shape) - 1) and nxt.center and nxt.scale:
                bn = nxt
                absorbed.add(nxt.name)
                nxt = graph.only_consumer(nxt)
        if activation == "linear" and nxt is not None and _activation_of(nxt):
            activation = _activation_of(nxt)
            absorbed.add(nxt.name)
        fused[layer.name] = (bn, activation, None)
    return fused, absorbed


def _unsupported(model, absorbed) -> str | None:
    graph = _Graph(model)
    if graph.shared:
        shared = graph.shared
        times = len(graph.nodes[shared[0].name])
        return f"layer {shared[0].name!r} is called {times} times (it quantizes layers used once)"
    for layer in model.layers:
        kind = type(layer).__name__
        known = kind in _FOLDABLE or kind in _QUANTIZED_OUTPUT or kind in _SAME_SCALE
        if layer.name in absorbed or known or (kind == "BatchNormalization"):
            continue
        return f"layer {layer.name!r} ({kind}) has no quantizer on it"
    return None


def _functional(model):
    """A Sequential model as a functional one over the same layers and nodes (calling its layers again
    would give each a second inbound node)."""
    if isinstance(model, keras.Sequential):
        return keras.Model(model.inputs, model.outputs, name=model.name)
    return model


def unquantizable(model) -> str | None:
    """Why this engine cannot quantize the model (the first layer it has no quantizer for), or None."""
    model = _functional(model)
    _, absorbed = _plan(model)
    return _unsupported(model, absorbed)


def fused_ops(model) -> set[str]:
    """The Conv2D, DepthwiseConv2D and Dense layers that become one ``QuantizedOp`` each."""
    return set(_plan(_functional(model))[0])


def check_quantizable(model) -> None:
    """Refuse, in one line, a model this engine cannot quantize: before any training starts."""
    why = unquantizable(model)
    if why:
        raise UsageError(f"{why}: the Keras 3 QAT engine does not do this yet; use --qat-engine tfmot")


def is_keras3_qat(model) -> bool:
    """Whether this engine built the model (its quantizers are there)."""
    return any(isinstance(layer, (ActivationQuantizer, QuantizedOp)) for layer in _all_layers(model))


def _clone(layer, fused: dict, absorbed: set):
    """The layer of the QAT model that stands for ``layer``."""
    kind = type(layer).__name__
    if layer.name in fused:
        bn, activation, _ = fused[layer.name]
        op = keras.layers.serialize(layer)
        if bn is not None or activation != "linear":
            op["config"] = {**op["config"], "activation": "linear"}
        return QuantizedOp(op, keras.layers.serialize(bn) if bn is not None else None, activation, name=layer.name)
    if layer.name in absorbed:
        return keras.layers.Identity(name=layer.name)
    if kind == "Reshape" and all(d is not None and d > 0 for d in layer.target_shape):
        return FlatReshape(layer.target_shape, name=layer.name)
    if kind == "Flatten" and all(d is not None for d in layer.input.shape[1:]):
        return FlatReshape((int(np.prod(layer.input.shape[1:])),), name=layer.name)
    return layer.__class__.from_config(layer.get_config())


def _quantized_output(original, out, fused: dict, absorbed: set, num_bits: int):
    """``out`` with the quantizer the converter needs after ``original`` (a layer or an op), or as it is."""
    kind, name = type(original).__name__, original.name
    if not isinstance(original, keras.layers.Layer):
        return out if kind in _SAME_SCALE_OPS else ActivationQuantizer(num_bits, name=f"{name}_quant")(out)
    if name in fused:
        own = fused[name][2]
        if own is not None and own not in _FIXED_OUTPUT:  # a conv with its own swish etc.: after it
            return ActivationQuantizer(num_bits, name=f"{name}_act_quant")(out)
        return out
    if name in absorbed or kind in _SAME_SCALE:
        return out
    if kind == "Activation" and _activation_name(original) in _FIXED_OUTPUT:
        return out
    return ActivationQuantizer(num_bits, name=f"{name}_quant")(out)


def _quantized_inputs(model, num_bits: int) -> tuple[list, dict]:
    """New inputs, and each old input's tensor in the QAT model: quantized, unless a Rescaling follows it
    (its output quantizer is the first; one before it leaves a float requantize in the file)."""
    inputs = [keras.Input(shape=t.shape[1:], dtype=t.dtype, name=t._keras_history[0].name) for t in model.inputs]
    graph = _Graph(model)
    mapped = {}
    for t, i in zip(model.inputs, inputs):
        first = graph.only_consumer(t._keras_history[0])
        rescaled = first is not None and type(first).__name__ in _RESCALERS
        mapped[id(t)] = i if rescaled else ActivationQuantizer(num_bits, name=f"{i.name}_quant")(i)
    return inputs, mapped


def quantize_model(model, num_bits: int = 8):
    """The QAT model of a functional (or Sequential) Keras 3 float model, its float weights copied in.
    Layer names stay the float model's; each quantizer is named after the layer it follows."""
    from keras import tree

    check_quantizable(model)
    model = _functional(model)
    fused, absorbed = _plan(model)
    inputs, mapped = _quantized_inputs(model, num_bits)
    graph = _Graph(model)

    def new(value):
        return mapped[id(value)] if isinstance(value, keras.KerasTensor) else value

    for layer in model.operations:  # in the graph's order; ops on tensors (x + 3.0, x * y) are operations too
        if type(layer).__name__ == "InputLayer":
            continue
        node = graph.nodes[layer.name][0]
        args = tree.map_structure(new, node.arguments.args)
        kwargs = tree.map_structure(new, node.arguments.kwargs)
        copy = _clone(layer, fused, absorbed) if isinstance(layer, keras.layers.Layer) else layer
        if isinstance(copy, (QuantizedOp, keras.layers.Identity, FlatReshape)):
            kwargs = {}  # a fused op or a folded BN/ReLU takes the tensor alone
        out = _quantized_output(layer, copy(*args, **kwargs), fused, absorbed, num_bits)
        for old, value in zip(tree.flatten(node.output_tensors), tree.flatten(out)):
            mapped[id(old)] = value
    outputs = [mapped[id(t)] for t in model.outputs]
    qat = keras.Model(inputs if len(inputs) > 1 else inputs[0], outputs if len(outputs) > 1 else outputs[0],
                      name=model.name)  # fmt: skip
    copy_float_weights(qat, model, fused)
    return qat


def copy_float_weights(qat, model, fused=None) -> None:
    """The float model's weights into the QAT model: each fused op gets its conv's and BN's."""
    fused = fused if fused is not None else _plan(_functional(model))[0]
    by_name = {layer.name: layer for layer in _functional(model).layers}
    for layer in _all_layers(qat):
        if isinstance(layer, QuantizedOp):
            original = by_name[layer.name]
            layer.inner.set_weights(original.get_weights())
            bn = fused[layer.name][0]
            if bn is not None:
                gamma, beta, mean, var = bn.get_weights()
                for variable, value in zip((layer.gamma, layer.beta, layer.moving_mean, layer.moving_variance),
                                           (gamma, beta, mean, var)):  # fmt: skip
                    variable.assign(value)
        elif layer.name in by_name and layer.weights and not isinstance(layer, ActivationQuantizer):
            layer.set_weights(by_name[layer.name].get_weights())


def _all_layers(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _all_layers(layer)
        else:
            yield layer


def quantizers(model) -> dict[str, ActivationQuantizer]:
    """Every activation quantizer of a QAT model, by the name of the layer or op it follows."""
    found = {}
    for layer in _all_layers(model):
        if isinstance(layer, ActivationQuantizer):
            found[layer.name] = layer
        elif isinstance(layer, QuantizedOp):
            found[layer.name] = layer.output_quantizer
    return found


def units(model) -> list[str]:
    """The quantizable units of a QAT model from the input on: each fused op (its weights and output) and
    each activation quantizer, by the name ``quantizers`` gives them."""
    return list(quantizers(model))


def set_quantized(model, quantized: set[str] | None = None) -> None:
    """Which units fake-quantize: those in ``quantized`` (None: all). A unit that is off computes in float (a
    fused op: float weights and output, as TF-MOT leaves a layer it does not wrap) and keeps observing ranges.
    The model's traced steps are dropped, as compile drops them: a traced step keeps the flags it saw."""
    model.train_function = model.test_function = model.predict_function = None
    for layer in _all_layers(model):
        if isinstance(layer, QuantizedOp):
            layer.enabled = layer.output_quantizer.enabled = quantized is None or layer.name in quantized
        elif isinstance(layer, ActivationQuantizer):
            layer.enabled = quantized is None or layer.name in quantized


def float_layers(model) -> list[str]:
    """The fused ops and the activation quantizers that are off (compute in float)."""
    units = (QuantizedOp, ActivationQuantizer)
    return [layer.name for layer in _all_layers(model) if isinstance(layer, units) and not layer.enabled]


def calibrate(model, batches) -> None:
    """Start every range at the data's: the quantizers see ``batches`` (training mode for them only;
    fused BatchNormalization statistics are frozen, and the rest of the graph runs as at inference)."""
    for x in batches:
        model(x, training=True)


def ranges(model) -> dict[str, list[float]]:
    """{quantizer: [min, max]}: what run.json records and the int8 file's scales come from."""
    return {name: [float(q.range_min.numpy()), float(q.range_max.numpy())] for name, q in quantizers(model).items()}
