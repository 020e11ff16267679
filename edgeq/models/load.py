"""Loading and saving Keras models, the run record beside them, and the names of a run's files.

Every stage that reads a model a user gives (train, convert, eval, analyze) loads it here,
so that what "a model edgeq accepts" means is decided in one place. Which Keras wrote a
file is read from the file itself (``edgeq.keras3.keras_flavour_of_file``): a Keras 3
model loads with Keras 3 and converts directly (PTQ); what needs tf_keras (TF-MOT QAT,
graph transforms, analysis) gets the translation, ``as_tf_keras``.
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from pathlib import Path

from edgeq.errors import ModelLoadError
from edgeq.models import compat
from edgeq.models.keras3 import is_keras3_model, keras_flavour_of_file
from edgeq.models.names import input_names, output_names, producer_of
from edgeq.models.spec import KERAS3, TF_KERAS, ModelSpec, TensorSpec

log = logging.getLogger(__name__)

# The files of a training run (edgeq train --out DIR).
FP32_NAME = "fp32.keras"
QAT_NAME = "qat.h5"
QAT_FLOAT_NAME = "qat_float.keras"  # the float weights QAT fine-tuned, without fake-quant (e.g. for --int16x8)
RUN_RECORD_NAME = "run.json"


def is_model_path(spec: str) -> bool:
    """Whether ``spec`` names a model file or folder rather than a reference model of the zoo."""
    return spec.endswith((".keras", ".h5", ".hdf5")) or "/" in spec or Path(spec).exists()


def load_keras_model(path: str | os.PathLike, compile: bool = False):
    """Load a Keras 2 model (.keras, .h5 or SavedModel dir), QAT wrappers included."""
    from edgeq.quantize.configs import quantize_scope  # TF-MOT's configs: only the tf_keras path imports them

    with quantize_scope():
        return compat.keras.models.load_model(str(path), compile=compile)


def load_user_model(path: str | Path):
    """Load a float model from .keras, .h5 or a SavedModel folder, in the Keras that wrote it.

    A Keras 3 file gives a Keras 3 model; everything else a tf_keras model (QAT wrappers
    included). Errors name the file and what was found in it.
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model file or folder")
    flavour = keras_flavour_of_file(path)
    try:
        if flavour == "keras3":
            import keras as keras3

            _check_backend(keras3, path)
            import edgeq.quantize.keras3_qat  # noqa: F401  (registers the Keras 3 QAT engine's layers)

            model = keras3.saving.load_model(str(path), compile=False)
        else:
            model = load_keras_model(path)
    except Exception as exc:  # Keras raises many types for a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        writer = "Keras 3" if flavour == "keras3" else "tf_keras (Keras 2)"
        raise ModelLoadError(
            f"{path}: written by {writer}, but it does not load ({first}); a custom layer must be importable "
            "and registered (keras.saving.register_keras_serializable)"
        ) from exc
    if not (is_keras3_model(model) or isinstance(model, compat.keras.Model)):
        raise ModelLoadError(f"{path}: loaded, but it is not a Keras model (SavedModel without Keras metadata?)")
    return model


def _check_backend(keras3, path: Path) -> None:
    """edgeq trains and converts Keras 3 models on the TensorFlow backend (``models.compat`` sets it)."""
    backend = keras3.backend.backend()
    if backend != "tensorflow":
        raise ModelLoadError(
            f"{path}: Keras was imported on the {backend} backend before edgeq; edgeq trains and converts on the "
            "TensorFlow backend: set KERAS_BACKEND=tensorflow before importing keras (a .keras file saved on any "
            "backend loads there)"
        )
    given = compat.KERAS_BACKEND_GIVEN
    if given not in (None, "", "tensorflow") and not _NOTED_BACKEND:
        _NOTED_BACKEND.append(given)
        log.warning("KERAS_BACKEND=%s: edgeq runs Keras 3 on the TensorFlow backend, which loads %s", given, path.name)


_NOTED_BACKEND: list[str] = []


def as_tf_keras(model):
    """The model as tf_keras: itself, or its translation from Keras 3 (same names and weights)."""
    if not is_keras3_model(model):
        return model
    from edgeq.models.translate import to_tf_keras  # tf_keras: only the TF-MOT path reaches it

    return to_tf_keras(model)


def _leaf_layers(model):
    for layer in model.layers:
        if getattr(layer, "layers", None):  # a nested model
            yield from _leaf_layers(layer)
        elif layer.weights:
            yield layer


def copy_weights_into(source, target) -> None:
    """Copy every layer's weights from ``source`` into the layer of the same name in ``target``.

    Used to hand a model trained as its tf_keras translation back in the user's Keras 3
    form; nested models are matched layer by layer.
    """
    by_name = {layer.name: layer for layer in _leaf_layers(source)}
    for layer in _leaf_layers(target):
        twin = by_name.get(layer.name)
        if twin is None:
            raise ModelLoadError(f"layer {layer.name!r} has no counterpart in the trained model; cannot copy it back")
        layer.set_weights(twin.get_weights())


def load_tf_keras_model(path: str | Path):
    """``load_user_model`` for what needs tf_keras: TF-MOT, graph transforms, analysis."""
    return as_tf_keras(load_user_model(path))


def run_record_for(model_path: str | Path) -> dict | None:
    """The run.json that sits beside a model trained by edgeq, if any."""
    candidate = Path(model_path).parent / RUN_RECORD_NAME
    if candidate.is_file():
        try:
            return json.loads(candidate.read_text())
        except ValueError:
            return None
    return None


def recorded_normalization(model_path: str | Path | None):
    """The input normalisation the training run of ``model_path`` recorded (run.json); None without one.

    Every command that reads data for a model it did not train (convert, analyze) reads raw
    files in these units, as eval and profile do from a conversion's manifest.
    """
    return _normalization(run_record_for(model_path) or {}) if model_path else None


# ----------------------------------------------------------------- a Keras model, described once


def is_qat_model(model) -> bool:
    """Whether TF-MOT wrapped the model for quantization-aware training, or edgeq's Keras 3 engine built it."""
    if is_keras3_model(model):
        from edgeq.quantize.keras3_qat import is_keras3_qat

        return is_keras3_qat(model)
    return any(
        type(layer).__name__ == "QuantizeLayer" or any(c.__name__ == "QuantizeWrapper" for c in type(layer).__mro__)
        for layer in model.layers
    )


def _output_activation(model, name: str, tensor) -> str | None:
    """The final activation of one output ("softmax", "sigmoid", "linear", ...; None when unknown)."""
    layer = producer_of(tensor)
    if layer is None:
        try:
            layer = model.get_layer(name)
        except (ValueError, KeyError):
            layer = None
    layer = getattr(layer, "layer", layer)  # TF-MOT's QuantizeWrapper
    if layer is not None and type(layer).__name__ == "Softmax":
        return "softmax"
    activation = getattr(layer, "activation", None)
    activation = getattr(activation, "activation", activation)  # TF-MOT's QuantizeAwareActivation
    return getattr(activation, "__name__", None) if activation is not None else None


def _dims(tensor) -> tuple[int | None, ...]:
    return tuple(None if d is None else int(d) for d in tensor.shape[1:])


def _dtype(tensor) -> str:
    dtype = getattr(tensor, "dtype", "float32")
    return str(getattr(dtype, "name", dtype))


def describe(model, path: str | Path | None = None) -> ModelSpec:
    """The ``ModelSpec`` of a Keras model (either Keras), with what its file and training run say.

    ``path`` is the file it was loaded from: its run.json (normalisation, each output's task) and
    its compile config (each output's loss) are read once, here.
    """
    ins, outs = input_names(model), output_names(model)
    record = (run_record_for(path) or {}) if path else {}
    recorded = {o["name"]: o for o in record.get("outputs", []) if isinstance(o, dict) and "name" in o}
    static = model.inputs[0].shape[0] if model.inputs else None
    compile_config = compile_config_of(path) or {}
    return ModelSpec(
        name=str(path) if path else model.name,
        format=KERAS3 if is_keras3_model(model) else TF_KERAS,
        inputs=tuple(TensorSpec(n, _dims(t), _dtype(t)) for n, t in zip(ins, model.inputs)),
        outputs=tuple(
            TensorSpec(n, _dims(t), _dtype(t), _output_activation(model, n, t)) for n, t in zip(outs, model.outputs)
        ),
        path=Path(path) if path else None,
        is_qat=is_qat_model(model),
        batch=int(static) if static else None,
        normalization=_normalization(record),
        trained_on=(record.get("data") or {}).get("source"),
        recorded=recorded,
        compiled=compiled_tasks(compile_config, outs),
        compile_config=compile_config,
    )


def _normalization(record: dict):
    from edgeq.runtime.inputs import Normalization

    recorded = record.get("normalization")
    return Normalization.from_dict(recorded) if isinstance(recorded, dict) else None


def task_targets(dataset, names: list[str]) -> dict:
    """Each output's targets on the data's val split (its train split when it has no val): what
    an output's task is inferred from when nothing declares it."""
    if dataset is None or not getattr(dataset, "labelled", True):
        return {}
    split = "val" if dataset.count("val") else "train"
    return {name: dataset.targets(split, name if len(names) > 1 else None) for name in names}


def model_feed(model, x):
    """``x`` (one array, or one per input name) as ``model.predict`` takes it."""
    names = input_names(model)
    if not isinstance(x, dict):
        return x
    missing = [n for n in names if n not in x]
    if missing:
        raise ModelLoadError(f"no data for the model's input(s) {', '.join(missing)} (given: {', '.join(x)})")
    return x[names[0]] if len(names) == 1 else [x[n] for n in names]


def _batch_for(model, batch_size: int) -> int:
    """A model whose Input fixes the batch (batch_size=1, as for an Edge TPU) predicts in batches of it."""
    static = model.inputs[0].shape[0] if model.inputs else None
    return int(static) if static else batch_size


def keras_outputs_in_order(model, x, batch_size: int = 64) -> list:
    """Every output of a Keras model on ``x``, in the model's output order (a QAT model's too)."""
    import numpy as np

    got = model.predict(model_feed(model, x), batch_size=_batch_for(model, batch_size), verbose=0)
    if isinstance(got, dict):
        return [np.asarray(got[n]) for n in output_names(model)]
    return [np.asarray(v) for v in got] if isinstance(got, (list, tuple)) else [np.asarray(got)]


def keras_outputs(model, x, batch_size: int = 64) -> dict:
    """Every output of a Keras model on ``x``, by output name (as the .tflite names them)."""
    import numpy as np

    got = model.predict(model_feed(model, x), batch_size=_batch_for(model, batch_size), verbose=0)
    names = output_names(model)
    if isinstance(got, dict):
        return {str(k): np.asarray(v) for k, v in got.items()}
    if isinstance(got, (list, tuple)):
        return {name: np.asarray(v) for name, v in zip(names, got)}
    return {names[0]: np.asarray(got)}


def parse_input_shape(spec: str | None, names: list[str]) -> dict[str, tuple[int, ...]]:
    """``--input-shape``: ``HxWxC`` for a one-input model, or ``NAME=HxWxC,NAME=...``."""
    from edgeq.errors import UsageError

    if not spec:
        return {}

    def dims(text: str) -> tuple[int, ...]:
        try:
            shape = tuple(int(d) for d in text.strip().lower().split("x"))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1:
            raise UsageError(f"--input-shape {spec!r}: write the sample shape as HxWxC (e.g. 240x320x3)")
        return shape

    if "=" not in spec:
        if len(names) != 1:
            raise UsageError(f"--input-shape {spec!r}: the model has inputs {', '.join(names)}; give NAME=HxWxC each")
        return {names[0]: dims(spec)}
    shapes = {}
    for item in spec.split(","):
        name, _, text = item.partition("=")
        if name.strip() not in names:
            raise UsageError(f"--input-shape names input {name.strip()!r}; the model's inputs are {', '.join(names)}")
        shapes[name.strip()] = dims(text)
    return shapes


def with_input_shape(model, spec: str | None, where: str = "model"):
    """The model with its inputs' free (None) dimensions fixed by ``--input-shape`` (same weights).

    A fully convolutional model (``Input((None, None, 3))``) has no static shape to quantize or
    to run on an Edge TPU; its layers work at any fixed size, so the model is rebuilt on an
    Input of the camera's size. A dimension the model fixes already must match.
    """
    from edgeq.errors import UsageError

    shapes = parse_input_shape(spec, input_names(model))
    if not shapes:
        return model
    current = describe(model).input_shapes
    for name, shape in shapes.items():
        have = current[name]
        if len(have) != len(shape) or any(h is not None and int(h) != s for h, s in zip(have, shape)):
            raise UsageError(
                f"{where}: --input-shape {name}={'x'.join(map(str, shape))} does not fit its input of shape "
                f"{tuple(have)}: only free (None) dimensions can be fixed"
            )
    if all(all(d is not None for d in current[n]) for n in current) and all(
        tuple(int(d) for d in current[n]) == shapes.get(n, tuple(current[n])) for n in current
    ):
        return model  # nothing to fix
    module = _keras_module_of(model)
    fixed = [
        module.Input(shape=shapes.get(name, tuple(current[name])), name=name, dtype=tensor.dtype)
        for name, tensor in zip(input_names(model), model.inputs)
    ]
    try:
        rebuilt = module.models.clone_model(model, input_tensors=fixed if len(fixed) > 1 else fixed[0])
    except Exception as exc:  # clone_model raises many types for models it cannot rebuild
        raise UsageError(f"{where}: cannot rebuild it with a fixed input shape ({str(exc).splitlines()[0]})") from exc
    rebuilt.set_weights(model.get_weights())
    return rebuilt


def _keras_module_of(model):
    if is_keras3_model(model):
        import keras as keras3

        return keras3
    return compat.keras


def concatenated_outputs(model, x, ratio: float = 10.0) -> list[str]:
    """Outputs that are a concatenation of tensors whose ranges differ by more than ``ratio``.

    They share one int8 scale: scores in [0, 1] beside boxes in [0, 640] round to zero, and
    the quantized model "detects nothing". Each finding names the output and the layer.
    """
    import numpy as np

    found, probes = [], []
    for name, tensor in zip(output_names(model), model.outputs):
        layer = producer_of(tensor)
        while layer is not None and type(layer).__name__ in ("Reshape", "Flatten", "Activation", "Permute"):
            if type(layer).__name__ == "Activation" and getattr(layer.activation, "__name__", "") != "linear":
                break
            layer = producer_of(layer.input)
        if layer is not None and type(layer).__name__ == "Concatenate" and isinstance(layer.input, (list, tuple)):
            probes.append((name, layer))
    for name, layer in probes:
        probe = _keras_module_of(model).Model(model.inputs, list(layer.input))
        parts = probe.predict(model_feed(model, x), verbose=0)
        spans = [float(np.max(np.abs(p))) for p in parts]
        small, large = min(spans), max(spans)
        if large > ratio * max(small, 1e-12):
            found.append(
                f"output {name!r} concatenates tensors whose ranges differ {large / max(small, 1e-12):.0f}x in layer "
                f"{layer.name!r} (max |value| {', '.join(f'{s:.3g}' for s in spans)}): in one int8 tensor the small "
                "ones round to a few steps; export them as separate outputs"
            )
    return found


# Losses a file's compile config may name, by what they make the output: a classifier's cross-entropy,
# a sigmoid's binary cross-entropy, or an error on values.
_LOSS_TASKS = {
    "sparsecategoricalcrossentropy": "classification",
    "categoricalcrossentropy": "classification",
    "categoricalfocalcrossentropy": "classification",
    "binarycrossentropy": "sigmoid",
    "binaryfocalcrossentropy": "sigmoid",
    "meansquarederror": "regression",
    "mse": "regression",
    "meanabsoluteerror": "regression",
    "mae": "regression",
    "huber": "regression",
    "logcosh": "regression",
}


def _loss_task(loss) -> tuple[str, bool] | None:
    """(task family, from_logits) of one serialized loss: a name or {"class_name", "config"}."""
    if isinstance(loss, dict) and "class_name" in loss:
        name, config = str(loss["class_name"]), loss.get("config") or {}
    elif isinstance(loss, str):
        name, config = loss, {}
    else:
        return None
    family = _LOSS_TASKS.get(name.replace("_", "").lower())
    return None if family is None else (family, bool(config.get("from_logits", False)))


def compile_config_of(path: str | Path | None) -> dict | None:
    """The compile config a model file records (.keras: config.json; .h5: training_config), or None."""
    if path is None:
        return None
    path = Path(path)
    try:
        if path.suffix == ".keras" and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                config = json.loads(zf.read("config.json"))
            return config.get("compile_config") or None
        if path.suffix in (".h5", ".hdf5"):
            import h5py

            with h5py.File(path, "r") as f:
                raw = f.attrs.get("training_config")
            if raw is None:
                return None
            return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (OSError, KeyError, ValueError):
        return None
    return None


def compiled_tasks(config: dict | None, names: list[str]) -> dict[str, tuple[str, bool]]:
    """What a model file's compile config (``compile_config_of``) says of each output: (family, from_logits).

    Read from the file, never by compiling; {} where the file was saved without one.
    """
    config = config or {}
    loss = config.get("loss")
    if isinstance(loss, dict) and "class_name" not in loss:
        per_output = {str(k): v for k, v in loss.items()}
    elif isinstance(loss, (list, tuple)):
        per_output = dict(zip(names, loss))
    else:
        per_output = {name: loss for name in names} if loss is not None else {}
    found = {name: _loss_task(v) for name, v in per_output.items() if name in names}
    return {name: got for name, got in found.items() if got is not None}
