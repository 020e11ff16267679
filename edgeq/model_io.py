"""Loading and saving Keras models, the run record beside them, and the names of a run's files.

Every stage that reads a model a user gives (train, convert, eval, analyze) loads it here,
so that what "a model edgeq accepts" means is decided in one place. Which Keras wrote a
file is read from the file itself (``edgeq.keras3.keras_flavour_of_file``): a Keras 3
model loads with Keras 3 and converts directly (PTQ); what needs tf_keras (TF-MOT QAT,
graph transforms, analysis) gets the translation, ``as_tf_keras``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edgeq.compat import keras
from edgeq.errors import ModelLoadError
from edgeq.keras3 import is_keras3_model, keras_flavour_of_file, to_tf_keras
from edgeq.quantize_configs import quantize_scope

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
    with quantize_scope():
        return keras.models.load_model(str(path), compile=compile)


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
    if not (isinstance(model, keras.Model) or is_keras3_model(model)):
        raise ModelLoadError(f"{path}: loaded, but it is not a Keras model (SavedModel without Keras metadata?)")
    return model


def as_tf_keras(model):
    """The model as tf_keras: itself, or its translation from Keras 3 (same names and weights)."""
    return to_tf_keras(model) if is_keras3_model(model) else model


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
    from edgeq.data import Normalization

    recorded = (run_record_for(model_path) or {}).get("normalization") if model_path else None
    return Normalization.from_dict(recorded) if isinstance(recorded, dict) else None
