"""Which Keras a model file or object is (Keras 3, tf_keras, SavedModel), read without loading it."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

from edgeq.errors import ModelLoadError

__all__ = [
    "KERAS3",
    "TF_KERAS",
    "SAVEDMODEL",
    "keras_flavour_of_file",
    "is_keras3_model",
]


KERAS3 = "keras3"


TF_KERAS = "tf_keras"


SAVEDMODEL = "savedmodel"


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


_WHAT_TO_DO = (
    "rebuild them with built-in Keras layers, or convert the model post-training with "
    "edgeq convert (PTQ works on Keras 3 models directly)"
)


def _flavour_of_version(version: Any, where: str) -> str:
    if isinstance(version, bytes):
        version = version.decode("utf-8", "replace")
    text = str(version).strip()
    try:
        major = int(text.split(".")[0])
    except ValueError:
        raise ModelLoadError(f"{where}: keras_version {text!r} is not a version number") from None
    return KERAS3 if major >= 3 else TF_KERAS


def keras_flavour_of_file(path: str | os.PathLike) -> str:
    """Which Keras wrote a model file: ``"keras3"``, ``"tf_keras"`` or ``"savedmodel"``.

    Reads only the file's own metadata (``metadata.json`` in a ``.keras`` zip, the root
    ``keras_version`` attribute of an ``.h5`` file, ``saved_model.pb`` in a folder); never
    loads the model. Raises ModelLoadError, in one line, for anything else.
    """
    p = Path(path)
    name = str(path)
    if p.is_dir():
        if (p / "saved_model.pb").is_file():
            return SAVEDMODEL
        raise ModelLoadError(f"{name}: a folder without saved_model.pb, not a SavedModel")
    if not p.exists():
        raise ModelLoadError(f"{name}: no such file or folder")
    if p.name == "saved_model.pb":
        raise ModelLoadError(f"{name}: give the SavedModel folder ({p.parent}), not saved_model.pb")
    suffix = p.suffix.lower()
    if suffix == ".keras":
        return _flavour_of_keras_zip(p, name)
    if suffix in (".h5", ".hdf5"):
        return _flavour_of_h5(p, name)
    raise ModelLoadError(f"{name}: not a Keras model (.keras, .h5 or a SavedModel folder)")


def _flavour_of_keras_zip(p: Path, name: str) -> str:
    if not zipfile.is_zipfile(p):
        with open(p, "rb") as f:
            head = f.read(8)
        if head == _HDF5_SIGNATURE:
            raise ModelLoadError(f"{name}: an HDF5 file named .keras; rename it to .h5")
        raise ModelLoadError(f"{name}: not a zip file, not a Keras file")
    try:
        with zipfile.ZipFile(p) as z:
            names = set(z.namelist())
            if "metadata.json" not in names:
                raise ModelLoadError(f"{name}: a zip without metadata.json, not a Keras file")
            raw = z.read("metadata.json")
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"{name}: unreadable zip ({exc})") from None
    try:
        metadata = json.loads(raw)
    except ValueError:
        raise ModelLoadError(f"{name}: metadata.json is not valid JSON") from None
    if not isinstance(metadata, dict) or "keras_version" not in metadata:
        raise ModelLoadError(f"{name}: metadata.json has no keras_version, not a Keras file")
    if "config.json" not in names:
        raise ModelLoadError(f"{name}: a zip without config.json (weights only?), not a Keras model")
    return _flavour_of_version(metadata["keras_version"], name)


def _flavour_of_h5(p: Path, name: str) -> str:
    import h5py

    with open(p, "rb") as f:
        head = f.read(8)
    if head != _HDF5_SIGNATURE:
        kind = "a zip file (a .keras file?)" if head[:2] == b"PK" else "not an HDF5 file"
        raise ModelLoadError(f"{name}: {kind}, not an .h5 Keras model")
    try:
        with h5py.File(p, "r") as h:
            attrs = dict(h.attrs)
    except OSError as exc:
        raise ModelLoadError(f"{name}: unreadable HDF5 file ({exc})") from None
    if "keras_version" not in attrs:
        raise ModelLoadError(f"{name}: an HDF5 file without keras_version, not a Keras model")
    if "model_config" not in attrs:
        raise ModelLoadError(f"{name}: an HDF5 file with weights only (no model_config), not a Keras model")
    return _flavour_of_version(attrs["keras_version"], name)


def _keras3():
    """Keras 3 itself, or None where only tf_keras is installed."""
    try:
        import keras
    except ImportError:  # pragma: no cover - tensorflow always brings keras 3 now
        return None
    version = getattr(keras, "__version__", "0")
    if int(version.split(".")[0]) < 3:  # pragma: no cover - a Keras 2 install
        return None
    return keras


def is_keras3_model(obj: Any) -> bool:
    """True for a Keras 3 model object (``keras.Model``), False for tf_keras and the rest."""
    keras = _keras3()  # a tf_keras model is no keras.Model: tf_keras itself need not be imported to tell
    return keras is not None and isinstance(obj, keras.Model)
