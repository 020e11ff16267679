"""Registry of reference Keras architectures and their recipes (``edgeq/models/recipes/*.toml``).

Builders are Keras 2 (tf_keras) functional models by default (Keras 3 on request) made only of layers TF-MOT can
quantize: convolutions without bias before BatchNormalization, ReLU/ReLU6 layers, Add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
from edgeq.errors import UsageError


@dataclass(frozen=True)
class Recipe:
    """How a reference model is trained and what it must reach."""

    name: str
    architecture: str
    description: str
    data: str
    model: dict[str, Any] = field(default_factory=dict)
    epochs: int = 10
    batch_size: int = 32
    learning_rate: float = 1e-3
    qat_epochs: int = 3
    qat_learning_rate: float = 1e-4
    max_drop_pp: float = 1.0
    fp32_min_accuracy: float = 0.0
    task: str | None = None  # what the model's output is (edgeq.tasks.table); None: inferred from the data


# Small datasets give few steps per epoch: with Keras' default momentum (0.99) the moving
# statistics lag the weights and inference-mode accuracy sits at chance.
BN_MOMENTUM = 0.9


def _layers(keras_module=None):
    """The Keras that builds: tf_keras by default, or the module given (``keras`` for Keras 3)."""
    if keras_module is None:
        from edgeq.models.compat import keras as keras_module
    return keras_module, keras_module.layers


def digits_cnn(input_shape=(8, 8, 1), num_classes=10, width: int = 32, keras_module=None):
    """Conv-BN-ReLU x3 for 8x8 digits; BN folds into the convolutions on conversion."""
    keras, L = _layers(keras_module)
    inputs = L.Input(input_shape, name="input")
    h = inputs
    for i, channels in enumerate((width, 2 * width, 2 * width)):
        h = L.Conv2D(channels, 3, padding="same", use_bias=False, name=f"conv{i + 1}")(h)
        h = L.BatchNormalization(momentum=BN_MOMENTUM, name=f"bn{i + 1}")(h)
        h = L.ReLU(name=f"relu{i + 1}")(h)
        if i == 1:
            h = L.MaxPooling2D(name="pool")(h)
    h = L.GlobalAveragePooling2D(name="gap")(h)
    outputs = L.Dense(num_classes, activation="softmax", name="logits")(h)
    return keras.Model(inputs, outputs, name="digits_cnn")


def mobilenetv2(input_shape=(96, 96, 3), num_classes=10, alpha: float = 0.35, keras_module=None):
    """MobileNetV2 from tf_keras.applications, random weights (nothing is downloaded)."""
    keras, _ = _layers(keras_module)
    return keras.applications.MobileNetV2(
        input_shape=tuple(input_shape), alpha=alpha, weights=None, classes=num_classes, include_top=True
    )


def ds_cnn(input_shape=(49, 10, 1), num_classes=12, filters: int = 64, keras_module=None):
    """Keyword spotting DS-CNN (MLPerf Tiny KWS shape): 49x10 MFCC in, 12 classes out."""
    keras, L = _layers(keras_module)
    inputs = L.Input(input_shape, name="input")
    h = L.Conv2D(filters, (10, 4), strides=(2, 2), padding="same", use_bias=False, name="conv1")(inputs)
    h = L.BatchNormalization(momentum=BN_MOMENTUM, name="bn1")(h)
    h = L.ReLU(name="relu1")(h)
    for i in range(4):
        h = L.DepthwiseConv2D(3, padding="same", use_bias=False, name=f"dw{i + 1}")(h)
        h = L.BatchNormalization(momentum=BN_MOMENTUM, name=f"dw{i + 1}_bn")(h)
        h = L.ReLU(name=f"dw{i + 1}_relu")(h)
        h = L.Conv2D(filters, 1, use_bias=False, name=f"pw{i + 1}")(h)
        h = L.BatchNormalization(momentum=BN_MOMENTUM, name=f"pw{i + 1}_bn")(h)
        h = L.ReLU(name=f"pw{i + 1}_relu")(h)
    h = L.AveragePooling2D(pool_size=tuple(int(d) for d in h.shape[1:3]), name="avgpool")(h)
    h = L.Flatten(name="flatten")(h)
    outputs = L.Dense(num_classes, activation="softmax", name="logits")(h)
    return keras.Model(inputs, outputs, name="ds_cnn")


def resnet8(input_shape=(32, 32, 3), num_classes=10, keras_module=None):
    """ResNet-8 (MLPerf Tiny image classification shape): three residual stacks."""
    keras, L = _layers(keras_module)
    inputs = L.Input(input_shape, name="input")
    h = L.Conv2D(16, 3, padding="same", use_bias=False, name="conv1")(inputs)
    h = L.BatchNormalization(momentum=BN_MOMENTUM, name="bn1")(h)
    h = L.ReLU(name="relu1")(h)
    for stack, (channels, stride) in enumerate(((16, 1), (32, 2), (64, 2)), start=1):
        shortcut = h
        y = L.Conv2D(channels, 3, strides=stride, padding="same", use_bias=False, name=f"s{stack}_conv1")(h)
        y = L.BatchNormalization(momentum=BN_MOMENTUM, name=f"s{stack}_bn1")(y)
        y = L.ReLU(name=f"s{stack}_relu1")(y)
        y = L.Conv2D(channels, 3, padding="same", use_bias=False, name=f"s{stack}_conv2")(y)
        y = L.BatchNormalization(momentum=BN_MOMENTUM, name=f"s{stack}_bn2")(y)
        if stride != 1 or int(shortcut.shape[-1]) != channels:
            shortcut = L.Conv2D(channels, 1, strides=stride, name=f"s{stack}_shortcut")(shortcut)
        h = L.Add(name=f"s{stack}_add")([y, shortcut])
        h = L.ReLU(name=f"s{stack}_relu2")(h)
    h = L.AveragePooling2D(pool_size=tuple(int(d) for d in h.shape[1:3]), name="avgpool")(h)
    h = L.Flatten(name="flatten")(h)
    outputs = L.Dense(num_classes, activation="softmax", name="logits")(h)
    return keras.Model(inputs, outputs, name="resnet8")


def ad_autoencoder(input_shape=(640,), num_classes=None, width: int = 128, code: int = 8, keras_module=None):
    """MLPerf Tiny's anomaly-detection autoencoder: Dense-BN-ReLU 4 x 128, an 8-wide code,
    4 x 128 back, and a linear Dense to the input's 640 values; the anomaly score is the
    reconstruction error (``num_classes`` is not used: the output is the input again)."""
    keras, L = _layers(keras_module)
    size = int(np.prod(input_shape))
    inputs = L.Input(tuple(input_shape), name="input")
    h = L.Flatten(name="flatten")(inputs) if len(input_shape) > 1 else inputs
    for i, units in enumerate([width] * 4 + [code] + [width] * 4):
        h = L.Dense(units, name=f"dense{i + 1}")(h)
        h = L.BatchNormalization(momentum=BN_MOMENTUM, name=f"bn{i + 1}")(h)
        h = L.ReLU(name=f"relu{i + 1}")(h)
    outputs = L.Dense(size, name="reconstruction")(h)
    if len(input_shape) > 1:
        outputs = L.Reshape(tuple(input_shape), name="reshape")(outputs)
    return keras.Model(inputs, outputs, name="ad_autoencoder")


def regression_mlp(input_shape=(10,), num_classes=None, width: int = 64, targets: int = 1, keras_module=None):
    """A small regressor: Dense-ReLU x2 and a linear output of ``targets`` values."""
    keras, L = _layers(keras_module)
    inputs = L.Input(tuple(input_shape), name="input")
    h = L.Flatten(name="flatten")(inputs) if len(input_shape) > 1 else inputs
    h = L.Dense(width, activation="relu", name="dense1")(h)
    h = L.Dense(width, activation="relu", name="dense2")(h)
    return keras.Model(inputs, L.Dense(int(targets), name="prediction")(h), name="regression_mlp")


def centre_detector(input_shape=(96, 96, 3), num_classes=3, alpha: float = 0.35, head: int = 64, keras_module=None):
    """A single-shot detector small enough to train on 2 cores in minutes: MobileNetV2 (alpha 0.35,
    random init) up to stride 8, one Conv-BN-ReLU, then two heads kept apart (each gets its own
    int8 scale): ``scores`` (S, S, K) per-class centre probabilities and ``boxes`` (S, S, 4) = the
    centre within its cell and the size as a fraction of the image, both sigmoid (edgeq.tasks.detection,
    layout ``centre``). Decoding and NMS run outside the int8 graph, in edgeq."""
    keras, L = _layers(keras_module)
    backbone = keras.applications.MobileNetV2(
        input_shape=tuple(input_shape), alpha=alpha, include_top=False, weights=None
    )
    for layer in backbone.layers:  # the application's 0.999 lags a few hundred steps of training by far
        if type(layer).__name__ == "BatchNormalization":
            layer.momentum = BN_MOMENTUM
    features = backbone.get_layer("block_6_expand_relu").output  # stride 8
    h = L.Conv2D(head, 3, padding="same", use_bias=False, name="head_conv")(features)
    h = L.BatchNormalization(momentum=BN_MOMENTUM, name="head_bn")(h)
    h = L.ReLU(name="head_relu")(h)
    scores = L.Conv2D(int(num_classes), 1, activation="sigmoid", name="scores")(h)
    boxes = L.Conv2D(4, 1, activation="sigmoid", name="boxes")(h)
    return keras.Model(backbone.input, [boxes, scores], name="centre_detector")


ARCHITECTURES: dict[str, Callable[..., Any]] = {
    "digits-cnn": digits_cnn,
    "mobilenetv2": mobilenetv2,
    "ds-cnn": ds_cnn,
    "resnet8": resnet8,
    "ad-autoencoder": ad_autoencoder,
    "regression-mlp": regression_mlp,
    "centre-detector": centre_detector,
}


def list_recipes() -> list[str]:
    return sorted(
        p.name[:-5] for p in resources.files("edgeq.models").joinpath("recipes").iterdir() if p.name.endswith(".toml")
    )


def load_recipe(name: str) -> Recipe:
    file = resources.files("edgeq.models").joinpath("recipes", f"{name}.toml")
    if not file.is_file():
        raise UsageError(f"no reference model {name!r}; choose one of: {', '.join(list_recipes())}, or a model file")
    raw = tomllib.loads(file.read_text())
    train, qat, budget = raw.get("train", {}), raw.get("qat", {}), raw.get("budget", {})
    return Recipe(
        name=name,
        architecture=raw["architecture"],
        description=raw.get("description", ""),
        data=raw["data"],
        model=dict(raw.get("model", {})),
        epochs=int(train.get("epochs", 10)),
        batch_size=int(train.get("batch_size", 32)),
        learning_rate=float(train.get("learning_rate", 1e-3)),
        qat_epochs=int(qat.get("epochs", 3)),
        qat_learning_rate=float(qat.get("learning_rate", 1e-4)),
        max_drop_pp=float(budget.get("max_drop_pp", 1.0)),
        fp32_min_accuracy=float(budget.get("fp32_min_accuracy", 0.0)),
        task=raw.get("task"),
    )


def build(name: str, input_shape: tuple | None = None, num_classes: int | None = None, **options):
    """Build reference architecture ``name`` for the given input shape and classes.

    ``keras_module=keras`` builds it with Keras 3 instead of tf_keras (what a user of
    ``pip install tensorflow`` would write); edgeq takes either.
    """
    if name not in ARCHITECTURES:
        raise UsageError(f"unknown architecture {name!r}; choose one of: {', '.join(sorted(ARCHITECTURES))}")
    kwargs = dict(options)
    if input_shape is not None:
        kwargs["input_shape"] = tuple(int(d) for d in input_shape)
    if num_classes is not None:
        kwargs["num_classes"] = int(num_classes)
    return ARCHITECTURES[name](**kwargs)
