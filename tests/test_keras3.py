"""Keras 3 models in, tf_keras models out: same names, same weights, same outputs."""

import edgeq.models.compat  # noqa: F401, I001  (TensorFlow first, quietly; tf_keras and TF-MOT when a test reaches them)

import json
import time
import zipfile

import h5py
import keras
import numpy as np
import pytest

from edgeq.models.compat import keras as tf_keras
from edgeq.models.compat import tf, tfmot
from edgeq.errors import ModelLoadError, UnsupportedLayerError
from edgeq.models.keras3 import KERAS3, SAVEDMODEL, TF_KERAS, is_keras3_model, keras_flavour_of_file
from edgeq.models.translate import max_abs_difference, to_tf_keras, translate

L = keras.layers
TOLERANCE = 1e-5


def randomize_statistics(model, seed=0):
    """Give BatchNormalization layers non-trivial statistics, so a missed copy shows."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            randomize_statistics(layer, seed + 1)
        elif isinstance(layer, L.BatchNormalization):
            layer.set_weights([rng.uniform(0.5, 1.5, w.shape).astype("float32") for w in layer.get_weights()])


def outputs_of_both(k3_model, tfk_model, shape, seed=0):
    x = np.random.default_rng(seed).uniform(-1, 1, size=(2, *shape)).astype("float32")
    return np.asarray(k3_model(x, training=False)), np.asarray(tfk_model(x, training=False))


def assert_same_model(k3_model, tfk_model, shape):
    assert isinstance(tfk_model, tf_keras.Model) and not is_keras3_model(tfk_model)
    expected, got = outputs_of_both(k3_model, tfk_model, shape)
    assert expected.shape == got.shape
    assert np.max(np.abs(expected - got)) <= TOLERANCE
    assert max_abs_difference(k3_model, tfk_model) <= TOLERANCE


def sequential_cnn():
    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            L.Conv2D(8, 3, padding="same", use_bias=False, name="conv"),
            L.BatchNormalization(name="bn"),
            L.ReLU(name="relu"),
            L.DepthwiseConv2D(3, padding="same", name="dw"),
            L.BatchNormalization(name="dw_bn"),
            L.ReLU(6.0, name="relu6"),
            L.GlobalAveragePooling2D(name="gap"),
            L.Dropout(0.2, name="drop"),
            L.Dense(10, activation="softmax", name="logits"),
        ],
        name="seq_cnn",
    )


def functional_cnn():
    x = keras.Input((16, 16, 3), name="image")
    y = L.Rescaling(1 / 127.5, offset=-1.0, name="scale")(x)
    y = L.Conv2D(8, 3, padding="same", name="stem")(y)
    y = L.BatchNormalization(name="stem_bn")(y)
    y = L.ReLU(name="stem_relu")(y)
    branch = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(y)
    branch = L.BatchNormalization(name="dw_bn")(branch)
    y = L.Add(name="residual")([y, branch])
    y = L.Concatenate(name="concat")([y, branch])
    y = L.Conv2D(12, 1, activation="relu", name="project")(y)
    y = L.GlobalAveragePooling2D(name="gap")(y)
    y = L.Dropout(0.1, name="drop")(y)
    out = L.Dense(10, name="logits")(y)
    return keras.Model(x, out, name="func_cnn")


def test_flavour_of_in_memory_models():
    k3 = sequential_cnn()
    assert is_keras3_model(k3)
    assert not is_keras3_model(to_tf_keras(k3))
    assert not is_keras3_model(tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)]))
    assert not is_keras3_model("model.keras") and not is_keras3_model(L.Dense(2))


def test_sequential_cnn_translates_with_names_and_weights():
    model = sequential_cnn()
    randomize_statistics(model)
    result = translate(model)
    tfk = result.model
    assert tfk.name == "seq_cnn" and result.seconds > 0
    assert [layer.name for layer in tfk.layers[1:]] == [layer.name for layer in model.layers]
    for layer in model.layers:
        for a, b in zip(layer.get_weights(), tfk.get_layer(layer.name).get_weights()):
            np.testing.assert_array_equal(a, b)
    assert_same_model(model, tfk, (16, 16, 3))


def test_functional_cnn_translates():
    model = functional_cnn()
    randomize_statistics(model)
    tfk = to_tf_keras(model)
    assert {layer.name for layer in model.layers} == {layer.name for layer in tfk.layers}
    assert type(tfk.get_layer("residual")).__name__ == "Add"
    assert tfk.get_layer("scale").get_config()["offset"] == -1.0
    assert_same_model(model, tfk, (16, 16, 3))


def test_raw_ops_and_hard_activations_become_builtin_layers():
    x = keras.Input((8, 8, 3))
    y = L.Conv2D(6, 3, name="conv")(x)
    gate = L.ReLU(6.0, name="gate_relu")(y + 3.0) * (1.0 / 6.0)  # MobileNetV3's hard_sigmoid
    y = L.Multiply(name="gated")([y, gate])
    y = y - y / 4.0
    y = 2.0 - keras.ops.relu6(y)
    y = L.Activation("hard_swish", name="hswish")(y)
    y = L.Dense(4, activation="hard_sigmoid", name="head")(keras.ops.hard_silu(y))
    model = keras.Model(x, y)
    result = translate(model)
    classes = {type(layer).__name__ for layer in result.model.layers}
    assert classes <= {"InputLayer", "Conv2D", "ReLU", "Rescaling", "Multiply", "Subtract", "Dense"}
    assert type(result.model.get_layer("hswish")).__name__ == "Multiply"  # x * hard_sigmoid(x)
    expanded = dict(result.expanded)
    assert {"hswish", "head", "hard_silu"} <= set(expanded)
    assert_same_model(model, result.model, (8, 8, 3))


def test_nested_models_are_flattened():
    block = keras.Sequential(
        [keras.Input((8, 8, 3)), L.Conv2D(4, 3, name="inner_conv"), L.BatchNormalization(name="inner_bn")],
        name="block",
    )
    x = keras.Input((8, 8, 3))
    features = keras.Model(x, L.GlobalAveragePooling2D(name="pool")(block(x)), name="features")
    inp = keras.Input((8, 8, 3), name="outer_in")
    out = L.Dense(10, name="head")(features(inp, training=False))
    model = keras.Model(inp, out, name="outer")
    randomize_statistics(model)
    result = translate(model)
    names = [layer.name for layer in result.model.layers]
    assert names == ["outer_in", "inner_conv", "inner_bn", "pool", "head"]
    assert set(result.flattened) == {"features", "block"}
    assert_same_model(model, result.model, (8, 8, 3))


def test_shared_layers_and_models_share_weights_and_several_inputs_and_outputs():
    shared = L.Dense(4, name="shared")
    tower = keras.Sequential(
        [keras.Input((4,)), L.Dense(3, name="tower_fc"), L.LeakyReLU(0.1, name="leaky")], name="tower"
    )
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    ta, tb = tower(shared(a)), tower(shared(b))
    model = keras.Model([a, b], [L.Add(name="sum")([ta, tb]), L.Dense(2, name="other")(tb)])
    tfk = to_tf_keras(model)
    assert [t.name.split(":")[0] for t in tfk.inputs] == ["a", "b"] and len(tfk.outputs) == 2
    assert [layer.name for layer in tfk.layers].count("shared") == 1
    assert len(tfk.trainable_weights) == len(model.trainable_weights)
    assert tfk.get_layer("leaky").get_config()["alpha"] == pytest.approx(0.1)
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(3, 4)).astype("float32") for _ in range(2)]
    for expected, got in zip(model(x), tfk(x)):
        np.testing.assert_allclose(np.asarray(expected), np.asarray(got), atol=TOLERANCE)
    assert max_abs_difference(model, tfk) <= TOLERANCE


def test_name_clash_between_nested_and_outer_layers_is_renamed():
    inner = keras.Sequential([keras.Input((4,)), L.Dense(4, name="fc")], name="inner")
    x = keras.Input((4,))
    model = keras.Model(x, L.Dense(2, name="head")(inner(L.Dense(4, name="fc")(x))))
    result = translate(model)
    assert result.renamed == (("fc", "fc_1"),)
    assert [layer.name for layer in result.model.layers][1:] == ["fc", "fc_1", "head"]
    assert max_abs_difference(model, result.model) <= TOLERANCE


def test_sequential_without_input_shape_is_refused():
    with pytest.raises(UnsupportedLayerError, match="keras.Input"):
        to_tf_keras(keras.Sequential([L.Dense(2)], name="shapeless"))


def test_keras3_file_loads_and_translates(tmp_path):
    model = functional_cnn()
    randomize_statistics(model)
    model.save(tmp_path / "k3.keras")
    assert keras_flavour_of_file(tmp_path / "k3.keras") == KERAS3
    loaded = keras.saving.load_model(tmp_path / "k3.keras")
    assert_same_model(model, to_tf_keras(loaded), (16, 16, 3))


def test_translated_model_saves_and_loads_in_tf_keras(tmp_path):
    model = functional_cnn()
    tfk = to_tf_keras(model)
    path = tmp_path / "translated.keras"
    tfk.save(path)
    assert keras_flavour_of_file(path) == TF_KERAS
    loaded = tf_keras.models.load_model(path)
    assert_same_model(model, loaded, (16, 16, 3))


def test_translated_model_takes_tfmot_qat():
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            L.Conv2D(4, 3, use_bias=False, name="conv"),
            L.BatchNormalization(name="bn"),
            L.ReLU(name="relu"),
            L.Flatten(name="flat"),
            L.Dense(3, name="fc"),
        ]
    )
    qat = tfmot.quantization.keras.quantize_model(to_tf_keras(model))
    assert any(layer.name == "quant_conv" for layer in qat.layers)


def test_mobilenet_v3_small_translates():
    model = keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=10)
    randomize_statistics(model)
    result = translate(model)
    tfk_names = {layer.name for layer in result.model.layers}
    assert {layer.name for layer in model.layers} <= tfk_names
    assert not any(type(layer).__name__ in ("Lambda", "TFOpLambda") for layer in result.model.layers)
    assert result.model.count_params() == model.count_params()
    assert_same_model(model, result.model, (32, 32, 3))


def test_tf_keras_model_passes_through_and_others_are_refused():
    tfk = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)])
    assert to_tf_keras(tfk) is tfk
    with pytest.raises(ModelLoadError, match="not a Keras model"):
        to_tf_keras(object())


def test_lambda_layer_is_refused():
    x = keras.Input((4,))
    y = L.Dense(3, name="d")(x)
    y = L.Lambda(lambda t: t * 2, name="double")(y)
    with pytest.raises(UnsupportedLayerError) as info:
        to_tf_keras(keras.Model(x, L.Dense(2)(y)))
    message = str(info.value)
    assert "'double' (Lambda" in message and "edgeq convert" in message
    assert "\n" not in message


class Scale(keras.layers.Layer):
    def call(self, x):
        return x * 2.0


def test_every_untranslatable_layer_is_listed_in_one_error():
    x = keras.Input((4,))
    y = Scale(name="my_scale")(x)
    y = L.Lambda(lambda t: t + 1, name="plus_one")(y)
    y = L.Dense(2, name="d")(y)
    y = y / L.Dense(2, name="e")(x)  # tensor / tensor: no built-in tf_keras layer
    with pytest.raises(UnsupportedLayerError) as info:
        to_tf_keras(keras.Model(x, y))
    message = str(info.value)
    assert "3 layers" in message
    assert "'my_scale' (Scale: a custom layer)" in message
    assert "'plus_one' (Lambda" in message
    assert "TrueDivide" in message
    assert len(info.value.layers) == 3


def test_subclassed_model_is_refused():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.dense = L.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(np.zeros((1, 3), "float32"))
    with pytest.raises(UnsupportedLayerError, match="model 'net' \\(Net\\) to tf_keras: a subclassed model"):
        to_tf_keras(net)


# ------------------------------------------------------------------------------------
# Which Keras wrote a file
# ------------------------------------------------------------------------------------


def test_flavour_of_keras3_files(tmp_path):
    model = keras.Sequential([keras.Input((4,)), L.Dense(2)])
    model.save(tmp_path / "k3.keras")
    model.save(tmp_path / "k3.h5")
    assert keras_flavour_of_file(tmp_path / "k3.keras") == KERAS3
    assert keras_flavour_of_file(str(tmp_path / "k3.h5")) == KERAS3


def test_flavour_of_tf_keras_files(tmp_path):
    model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(2)])
    model.save(tmp_path / "tfk.keras")
    model.save(tmp_path / "tfk.h5")
    assert keras_flavour_of_file(tmp_path / "tfk.keras") == TF_KERAS
    assert keras_flavour_of_file(tmp_path / "tfk.h5") == TF_KERAS


def test_flavour_of_savedmodel_folder(tmp_path):
    module = tf.Module()
    module.v = tf.Variable(1.0)
    tf.saved_model.save(module, str(tmp_path / "sm"))
    assert keras_flavour_of_file(tmp_path / "sm") == SAVEDMODEL


def _write_junk(tmp_path, kind):
    if kind == "npz":
        path = tmp_path / "x.npz"
        np.savez(path, a=np.zeros(3))
    elif kind == "text.keras":
        path = tmp_path / "x.keras"
        path.write_text("not a zip")
    elif kind == "zip.keras":
        path = tmp_path / "x.keras"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("config.json", "{}")
    elif kind == "noversion.keras":
        path = tmp_path / "x.keras"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("metadata.json", json.dumps({"date_saved": "today"}))
    elif kind == "plain.h5":
        path = tmp_path / "x.h5"
        with h5py.File(path, "w") as h:
            h["data"] = np.zeros(3)
    elif kind == "text.h5":
        path = tmp_path / "x.h5"
        path.write_text("hello")
    elif kind == "folder":
        path = tmp_path / "empty_dir"
        path.mkdir()
    else:
        path = tmp_path / "missing.keras"
    return path


@pytest.mark.parametrize(
    "kind, fragment",
    [
        ("npz", "x.npz: not a Keras model (.keras, .h5 or a SavedModel folder)"),
        ("text.keras", "x.keras: not a zip file"),
        ("zip.keras", "x.keras: a zip without metadata.json, not a Keras file"),
        ("noversion.keras", "x.keras: metadata.json has no keras_version"),
        ("plain.h5", "x.h5: an HDF5 file without keras_version"),
        ("text.h5", "x.h5: not an HDF5 file"),
        ("folder", "empty_dir: a folder without saved_model.pb"),
        ("missing", "missing.keras: no such file or folder"),
    ],
)
def test_flavour_of_junk_is_one_line_error(tmp_path, kind, fragment):
    path = _write_junk(tmp_path, kind)
    with pytest.raises(ModelLoadError) as info:
        keras_flavour_of_file(path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------
# The architecture table (slow: EDGEQ_SLOW=1)
# ------------------------------------------------------------------------------------

ARCHITECTURES = [
    "MobileNet",
    "MobileNetV2",
    "MobileNetV3Small",
    "MobileNetV3Large",
    "EfficientNetB0",
    "EfficientNetV2B0",
    "ResNet50",
    "DenseNet121",
    "NASNetMobile",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_keras_applications_translate(name):
    model = getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=10)
    start = time.perf_counter()
    tfk = to_tf_keras(model)
    seconds = time.perf_counter() - start
    assert {layer.name for layer in model.layers} <= {layer.name for layer in tfk.layers}
    assert tfk.count_params() == model.count_params()
    assert_same_model(model, tfk, (32, 32, 3))
    print(f"{name}: translated in {seconds:.1f} s")
    keras.backend.clear_session()
    tf_keras.backend.clear_session()
