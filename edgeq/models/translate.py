"""Keras 3 model -> tf_keras twin, so TF-MOT can wrap it; checked output for output."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeq.errors import ModelLoadError, UnsupportedLayerError
from edgeq.models.compat import keras as tf_keras
from edgeq.models.compat import tf
from edgeq.models.keras3 import _WHAT_TO_DO, _keras3, is_keras3_model
from edgeq.models.translate_layers import (
    _accepted_kwargs,
    _activation_name,
    _Expanded,
    _Layer,
    _Merge,
    _neutral,
    _OneTensor,
    _policy_name,
    _snake,
    _Unsupported,
)


@dataclass(frozen=True)
class Translation:
    """A Keras 3 model rebuilt in tf_keras, and what had to change on the way."""

    model: Any  # tf_keras.Model (Functional)
    seconds: float
    flattened: tuple[str, ...]  # nested models whose layers now sit in the outer graph
    renamed: tuple[tuple[str, str], ...]  # (Keras 3 name, tf_keras name) on name clashes
    expanded: tuple[tuple[str, str], ...]  # (op or layer, what it became in tf_keras)


def to_tf_keras(model: Any) -> Any:
    """Translate a Keras 3 Functional/Sequential model into an equivalent tf_keras model.

    A tf_keras model is returned unchanged. Raises UnsupportedLayerError (one error that
    lists every layer that cannot be translated) and ModelLoadError for non-models.
    """
    if isinstance(model, tf_keras.Model):
        return model
    return translate(model).model


def translate(model: Any) -> Translation:
    """Like :func:`to_tf_keras`, with the notes of what was flattened, renamed or expanded."""
    if isinstance(model, tf_keras.Model):
        return Translation(model, 0.0, (), (), ())
    if not is_keras3_model(model):
        raise ModelLoadError(f"not a Keras model: {type(model).__module__}.{type(model).__qualname__}")
    start = time.perf_counter()
    translator = _Translator(model)
    result = translator.run()
    return Translation(
        model=result,
        seconds=time.perf_counter() - start,
        flattened=tuple(translator.flattened),
        renamed=tuple(translator.renamed),
        expanded=tuple(translator.expanded),
    )


def max_abs_difference(keras3_model: Any, tf_keras_model: Any, batch: int = 2, seed: int = 0) -> float:
    """Largest absolute output difference of two models on the same random inputs."""
    rng = np.random.default_rng(seed)
    inputs = []
    for tensor in tf_keras_model.inputs:
        shape = [batch] + [d if d is not None else 32 for d in tensor.shape[1:]]
        dtype = tensor.dtype.as_numpy_dtype
        if np.issubdtype(dtype, np.integer):
            inputs.append(rng.integers(0, 10, size=shape).astype(dtype))
        else:
            inputs.append(rng.uniform(-1.0, 1.0, size=shape).astype(dtype))
    feed = inputs[0] if len(inputs) == 1 else inputs
    a = keras3_model(feed, training=False)
    b = tf_keras_model(feed, training=False)
    keras = _keras3()
    flat_a = keras.tree.flatten(a) if keras is not None else tf.nest.flatten(a)
    flat_b = tf.nest.flatten(b)
    if len(flat_a) != len(flat_b):
        raise ValueError(f"the models have {len(flat_a)} and {len(flat_b)} outputs")
    return max(
        float(np.max(np.abs(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64))))
        for x, y in zip(flat_a, flat_b)
    )


# Keras 3 activation names that mean exactly the same function in tf_keras.
_SAME_ACTIVATIONS = {
    "linear": "linear",
    "relu": "relu",
    "relu6": "relu6",
    "leaky_relu": "leaky_relu",
    "elu": "elu",
    "selu": "selu",
    "softplus": "softplus",
    "softsign": "softsign",
    "silu": "swish",
    "swish": "swish",
    "gelu": "gelu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "exponential": "exponential",
    "mish": "mish",
    "softmax": "softmax",
    "log_softmax": "log_softmax",
}


# Keras 3 activations tf_keras lacks (or defines differently: its hard_sigmoid is
# 0.2x+0.5), rebuilt from Rescaling/ReLU/Multiply layers.
_EXPANDED_ACTIVATIONS = {"hard_sigmoid": "hard_sigmoid", "hard_silu": "hard_swish", "hard_swish": "hard_swish"}


# Keras 3 config keys renamed in tf_keras, per class.
_RENAMED_KEYS = {"LeakyReLU": {"negative_slope": "alpha"}}


class _Translator:
    def __init__(self, model: Any):
        self.keras = _keras3()
        from keras.src.models.functional import Functional
        from keras.src.models.sequential import Sequential

        self.Functional = Functional
        self.Sequential = Sequential
        self.model = model
        self.layers: dict[int, Any] = {}  # id(Keras 3 layer) -> _Built
        self.problems: list[str] = []
        self.problem_ids: set[int] = set()
        self.used_names: set[str] = set()
        self.flattened: list[str] = []
        self.renamed: list[tuple[str, str]] = []
        self.expanded: list[tuple[str, str]] = []
        self.weight_pairs: list[tuple[Any, Any]] = []
        self.reserved = self._all_names(model)

    # -- graph ---------------------------------------------------------------------------

    def _functional_of(self, model: Any) -> Any:
        """The Functional graph behind a Keras 3 model, or an _Unsupported for the rest."""
        if isinstance(model, self.Sequential):
            graph = getattr(model, "_functional", None)
            if graph is None:
                raise _Unsupported("a Sequential model without a known input shape (start it with keras.Input(shape))")
            return graph
        if isinstance(model, self.Functional):
            own_call = None
            for klass in type(model).__mro__:
                if klass is self.Functional:
                    break
                if "call" in klass.__dict__:
                    own_call = klass.__dict__["call"]
                    break
            if own_call is not None:
                raise _Unsupported("a Functional model subclass with its own call()")
            return model
        raise _Unsupported("a subclassed model (its call() is Python code, not a graph)")

    def _all_names(self, model: Any, seen: set[int] | None = None) -> set[str]:
        names: set[str] = set()
        seen = set() if seen is None else seen
        try:
            graph = self._functional_of(model)
        except _Unsupported:
            return names
        for op in graph.operations:
            if id(op) in seen:
                continue
            seen.add(id(op))
            if isinstance(op, self.keras.Model):
                names |= self._all_names(op, seen)
            elif isinstance(op, self.keras.layers.Layer):
                names.add(op.name)
        return names

    def _unique(self, name: str) -> str:
        candidate, i = name, 1
        while candidate in self.used_names or (candidate != name and candidate in self.reserved):
            candidate = f"{name}_{i}"
            i += 1
        self.used_names.add(candidate)
        return candidate

    def _fresh(self, name: str) -> str:
        """A name for a helper layer: clashes neither with used nor with Keras 3 names."""
        candidate, i = name, 1
        while candidate in self.used_names or candidate in self.reserved:
            candidate = f"{name}_{i}"
            i += 1
        self.used_names.add(candidate)
        return candidate

    def _problem(self, op: Any, why: str) -> None:
        if id(op) in self.problem_ids:
            return
        self.problem_ids.add(id(op))
        self.problems.append(f"'{op.name}' ({type(op).__name__}: {why})")

    def run(self) -> Any:
        model = self.model
        try:
            graph = self._functional_of(model)
        except _Unsupported as exc:
            err = UnsupportedLayerError(
                f"cannot translate Keras 3 model '{model.name}' ({type(model).__name__}) to tf_keras: {exc}; "
                "rebuild it as a Functional or Sequential model, or convert it post-training with edgeq convert "
                "(PTQ works on Keras 3 models directly)"
            )
            err.layers = (f"'{model.name}' ({type(model).__name__}: {exc})",)
            raise err from None
        inputs = []
        for tensor in graph.inputs:
            layer = tensor._keras_history.operation
            inputs.append(self._input(layer, tensor))
        outputs = self._run_graph(graph, inputs, training=None)
        if self.problems:
            self._raise()
        out_struct = getattr(graph, "_outputs_struct", None)
        packed_outputs: Any = outputs[0] if len(outputs) == 1 else list(outputs)
        if isinstance(out_struct, dict):
            packed_outputs = self.keras.tree.pack_sequence_as(out_struct, outputs)
        packed_inputs: Any = inputs[0] if len(inputs) == 1 else list(inputs)
        in_struct = getattr(graph, "_inputs_struct", None)
        if isinstance(in_struct, dict):
            packed_inputs = self.keras.tree.pack_sequence_as(in_struct, inputs)
        result = tf_keras.Model(inputs=packed_inputs, outputs=packed_outputs, name=model.name)
        self._copy_weights()
        return result

    def _raise(self) -> None:
        n = len(self.problems)
        what = "1 layer" if n == 1 else f"{n} layers"
        err = UnsupportedLayerError(
            f"cannot translate Keras 3 model '{self.model.name}' to tf_keras: {what} with no tf_keras equivalent: "
            + ", ".join(self.problems)
            + f"; {_WHAT_TO_DO}"
        )
        err.layers = tuple(self.problems)
        raise err

    def _input(self, layer: Any, tensor: Any) -> Any:
        cfg = layer.get_config()
        shape = cfg.get("batch_shape") or cfg.get("batch_input_shape") or ((None,) + tuple(tensor.shape[1:]))
        if cfg.get("optional"):
            self._problem(layer, "an optional input")
        if cfg.get("ragged"):
            self._problem(layer, "a ragged input")
        try:
            dtype = _policy_name(cfg.get("dtype")) or tensor.dtype
        except _Unsupported as exc:
            self._problem(layer, str(exc))
            dtype = tensor.dtype
        return tf_keras.Input(
            batch_shape=tuple(shape),
            dtype=dtype,
            sparse=bool(cfg.get("sparse", False)),
            name=self._unique(layer.name),
        )

    def _run_graph(self, graph: Any, inputs: list[Any], training: Any) -> list[Any]:
        """Rebuild the nodes of a Keras 3 Functional graph on tf_keras tensors."""
        keras = self.keras
        tensor_dict = {id(k): v for k, v in zip(graph.inputs, inputs)}
        for depth in sorted(graph._nodes_by_depth, reverse=True):
            for node in graph._nodes_by_depth[depth]:
                if not node.operation or node.is_input:
                    continue
                if any(id(x) not in tensor_dict for x in node.input_tensors):
                    continue
                args, kwargs = node.arguments.fill_in(tensor_dict)
                if training is not None and "training" not in kwargs:
                    kwargs = dict(kwargs, training=training)
                poisoned = any(tensor_dict[id(x)] is None for x in node.input_tensors)
                outputs = self._call(node, args, kwargs, poisoned)
                flat = keras.tree.flatten(outputs) if outputs is not None else [None] * len(node.outputs)
                for x, y in zip(node.outputs, flat):
                    tensor_dict[id(x)] = y
        return [tensor_dict.get(id(x)) for x in graph.outputs]

    def _call(self, node: Any, args: tuple, kwargs: dict, poisoned: bool) -> Any:
        """Rebuild one node; ``poisoned``: an input comes from a layer already reported."""
        keras = self.keras
        op = node.operation
        if isinstance(op, keras.Model):
            try:
                graph = self._functional_of(op)
            except _Unsupported as exc:
                self._problem(op, str(exc))
                return None
            if op.name not in self.flattened:
                self.flattened.append(op.name)
            inner = [x for x in keras.tree.flatten(args[0] if args else kwargs.get("inputs"))]
            training = kwargs.get("training")
            return self._run_graph(graph, inner, training)
        if isinstance(op, keras.layers.Layer):
            built = self._layer(op)
        else:
            built = self._op(op, node.arguments.args)
        if built is None or poisoned or self.problems:
            return None
        return built(args, kwargs)

    # -- layers --------------------------------------------------------------------------

    def _layer(self, layer: Any) -> Any:
        key = id(layer)
        if key in self.layers:
            return self.layers[key]
        built = None
        try:
            built = self._build_layer(layer)
        except _Unsupported as exc:
            self._problem(layer, str(exc))
        self.layers[key] = built
        return built

    def _build_layer(self, layer: Any) -> Any:
        cls = type(layer)
        name = cls.__name__
        if not cls.__module__.startswith("keras."):
            raise _Unsupported("a custom layer")
        if name == "Lambda":
            raise _Unsupported("its Python function cannot be rebuilt safely")
        if name == "InputLayer":
            raise _Unsupported("an input layer in the middle of the graph")
        target = getattr(tf_keras.layers, name, None)
        if target is None or not (isinstance(target, type) and issubclass(target, tf_keras.layers.Layer)):
            raise _Unsupported("no tf_keras equivalent")
        cfg = dict(layer.get_config())
        tf_name = self._unique(layer.name)
        if tf_name != layer.name:
            self.renamed.append((layer.name, tf_name))
        cfg["name"] = tf_name
        post = None
        if name == "Activation":
            act = _activation_name(cfg.get("activation"))
            if act in _EXPANDED_ACTIVATIONS:
                kind = _EXPANDED_ACTIVATIONS[act]
                self.expanded.append((layer.name, f"{kind} from Rescaling/ReLU/Multiply layers"))
                self.used_names.discard(tf_name)
                return _Expanded(self, kind, base=tf_name, final=tf_name)
        elif "activation" in cfg:
            act = _activation_name(cfg["activation"])
            if act in _EXPANDED_ACTIVATIONS:
                kind = _EXPANDED_ACTIVATIONS[act]
                cfg["activation"] = "linear"
                post = _Expanded(self, kind, base=f"{tf_name}_{kind}", final=None)
                self.expanded.append((layer.name, f"linear {name} + {kind} from Rescaling/ReLU/Multiply layers"))
        cfg = self._translate_config(target, name, cfg)
        try:
            new = target.from_config(cfg)
        except (TypeError, ValueError) as exc:
            raise _Unsupported(f"tf_keras {name} rejects its config: {str(exc).splitlines()[0]}") from None
        self.weight_pairs.append((layer, new))
        return _Layer(new, post)

    def _translate_config(self, target: type, class_name: str, cfg: dict) -> dict:
        renames = _RENAMED_KEYS.get(class_name, {})
        cfg = {renames.get(k, k): v for k, v in cfg.items()}
        accepted = _accepted_kwargs(target)
        out: dict = {}
        for key, value in cfg.items():
            if key not in accepted:
                if _neutral(value):
                    continue
                raise _Unsupported(f"option {key}={value!r} has no tf_keras equivalent")
            if key == "dtype":
                value = _policy_name(value)
            elif key == "activation":
                act = _activation_name(value)
                if act not in _SAME_ACTIVATIONS:
                    raise _Unsupported(f"activation {act!r} has no tf_keras equivalent")
                value = _SAME_ACTIVATIONS[act]
            elif key.endswith("_initializer"):
                value = self._object(tf_keras.initializers, value, key)
            elif key.endswith("_regularizer"):
                value = self._object(tf_keras.regularizers, value, key)
            elif key.endswith("_constraint"):
                value = self._object(tf_keras.constraints, value, key)
            out[key] = value
        return out

    @staticmethod
    def _object(module: Any, value: Any, key: str) -> Any:
        """A Keras 3 serialized initializer/regularizer/constraint as a tf_keras object."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, dict) or "class_name" not in value:
            raise _Unsupported(f"{key} {value!r} cannot be translated")
        if value.get("registered_name") not in (None, value["class_name"]) or not str(
            value.get("module") or "keras"
        ).startswith("keras"):
            raise _Unsupported(f"{key} is a custom {value['class_name']}")
        cls = getattr(module, value["class_name"], None)
        if not isinstance(cls, type):
            raise _Unsupported(f"{key} {value['class_name']} has no tf_keras equivalent")
        params = inspect.signature(cls.__init__).parameters
        cfg = {}
        for k, v in (value.get("config") or {}).items():
            if k in params:
                cfg[k] = v
            elif not _neutral(v):
                raise _Unsupported(f"{key} {value['class_name']}({k}={v!r}) has no tf_keras equivalent")
        try:
            return cls(**cfg)
        except (TypeError, ValueError) as exc:
            raise _Unsupported(f"{key} {value['class_name']}: {exc}") from None

    # -- raw ops ---------------------------------------------------------------------------

    def _op(self, op: Any, args: tuple) -> Any:
        """A tf_keras stand-in for a raw Keras 3 op; ``args`` are the op's Keras 3 arguments."""
        key = id(op)
        if key in self.layers:
            return self.layers[key]
        built = None
        try:
            built = self._build_op(op, args)
        except _Unsupported as exc:
            self._problem(op, str(exc))
        self.layers[key] = built
        return built

    def _build_op(self, op: Any, args: tuple) -> Any:
        kind = type(op).__name__
        module = type(op).__module__
        if module.endswith("ops.numpy") and kind in ("Add", "Subtract", "Multiply", "Divide", "TrueDivide"):
            return self._arithmetic(op, kind, args)
        if module.endswith("ops.nn") or module.endswith("ops.numpy"):
            name = self._fresh(op.name)
            if kind == "Relu":
                layer = tf_keras.layers.ReLU(name=name)
            elif kind == "Relu6":
                layer = tf_keras.layers.ReLU(max_value=6.0, name=name)
            elif kind == "Sigmoid":
                layer = tf_keras.layers.Activation("sigmoid", name=name)
            elif kind == "Tanh":
                layer = tf_keras.layers.Activation("tanh", name=name)
            elif kind == "Silu":
                layer = tf_keras.layers.Activation("swish", name=name)
            elif kind == "Softmax" and isinstance(getattr(op, "axis", -1), int):
                layer = tf_keras.layers.Softmax(axis=getattr(op, "axis", -1), name=name)
            elif kind in ("HardSigmoid", "HardSilu"):
                self.used_names.discard(name)
                what = "hard_sigmoid" if kind == "HardSigmoid" else "hard_swish"
                self.expanded.append((op.name, f"{what} from Rescaling/ReLU/Multiply layers"))
                return _Expanded(self, what, base=name, final=name)
            else:
                raise _Unsupported(f"the op keras.ops.{_snake(kind)} has no built-in tf_keras layer")
            self.expanded.append((op.name, f"{type(layer).__name__} '{name}'"))
            return _Layer(layer, None)
        raise _Unsupported("an op that is not a layer and has no built-in tf_keras layer")

    def _arithmetic(self, op: Any, kind: str, args: tuple) -> Any:
        if len(args) != 2:
            raise _Unsupported(f"keras.ops.{_snake(kind)} with {len(args)} arguments")
        tensors = [isinstance(a, self.keras.KerasTensor) for a in args]
        name = self._fresh(op.name)
        if all(tensors):
            merge = {
                "Add": tf_keras.layers.Add,
                "Subtract": tf_keras.layers.Subtract,
                "Multiply": tf_keras.layers.Multiply,
            }
            if kind not in merge:
                raise _Unsupported("a division of two tensors has no built-in tf_keras layer")
            self.expanded.append((op.name, f"{merge[kind].__name__} '{name}'"))
            return _Merge(merge[kind](name=name))
        if not any(tensors):
            raise _Unsupported("an op on constants only")
        const = args[1] if tensors[0] else args[0]
        if np.ndim(const) != 0 or isinstance(const, (bool, np.bool_)):
            raise _Unsupported(f"keras.ops.{_snake(kind)} with a non-scalar constant")
        c = float(const)
        tensor_first = tensors[0]
        if kind == "Add":
            scale, offset = 1.0, c
        elif kind == "Subtract":
            scale, offset = (1.0, -c) if tensor_first else (-1.0, c)
        elif kind == "Multiply":
            scale, offset = c, 0.0
        elif tensor_first and c != 0.0:  # x / c
            scale, offset = 1.0 / c, 0.0
        else:
            raise _Unsupported("a constant divided by a tensor has no built-in tf_keras layer")
        self.expanded.append((op.name, f"Rescaling '{name}' (scale={scale:g}, offset={offset:g})"))
        return _OneTensor(tf_keras.layers.Rescaling(scale=scale, offset=offset, name=name), 0 if tensor_first else 1)

    # -- weights -----------------------------------------------------------------------------

    def _copy_weights(self) -> None:
        for k3, new in self.weight_pairs:
            src = [v for v in k3.weights if "seed_generator" not in getattr(v, "path", v.name)]
            dst = new.weights
            if len(src) != len(dst):
                raise UnsupportedLayerError(
                    f"cannot translate layer '{k3.name}' ({type(k3).__name__}): {len(src)} Keras 3 weights "
                    f"but {len(dst)} in tf_keras; {_WHAT_TO_DO}"
                )
            src_names = [v.name.split("/")[-1].split(":")[0] for v in src]
            dst_names = [v.name.split("/")[-1].split(":")[0] for v in dst]
            if sorted(src_names) == sorted(dst_names) and len(set(src_names)) == len(src_names):
                by_name = dict(zip(src_names, src))
                ordered = [by_name[n] for n in dst_names]
            else:
                ordered = src
            values = []
            for s, d in zip(ordered, dst):
                value = np.asarray(s.numpy())
                if tuple(value.shape) != tuple(d.shape):
                    raise UnsupportedLayerError(
                        f"cannot translate layer '{k3.name}' ({type(k3).__name__}): weight {s.name} has shape "
                        f"{tuple(value.shape)} in Keras 3 but {tuple(d.shape)} in tf_keras; {_WHAT_TO_DO}"
                    )
                values.append(value)
            if values:
                new.set_weights(values)
