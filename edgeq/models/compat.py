"""The one place that decides the Keras flavour.

TF-MOT works only with Keras 2 (``tf_keras``). ``tf`` is imported here at once; ``keras``
(tf_keras) and ``tfmot`` are imported only when a function first reads one of their
attributes (``_OnFirstUse``), and that is also where ``TF_USE_LEGACY_KERAS=1`` is set: only the TF-MOT
path reaches it. The Keras 3 QAT engine (``quantize.keras3_qat``) and the stages it runs
through take Keras 3 as ``import keras`` and never touch these two, so a process on that
path neither imports tf_keras or TF-MOT nor sets the legacy switch. TensorFlow reads the
switch when ``tf.keras`` is first touched, and edgeq never uses ``tf.keras``.
Loading models is ``edgeq.models.load``'s job.

Importing this module from a program leaves the program's stderr and logging alone. The
``edgeq`` command sets ``EDGEQ_QUIET_TF=1`` first: TensorFlow then starts with fd 2 pointed
at /dev/null (its C++ start-up lines ignore every log level), runs its first op at once,
and its Python logger shows errors only, so a terminal shows edgeq's own words.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types

# Keras 3 runs on TensorFlow's backend in edgeq, whatever KERAS_BACKEND the shell has: the converter reads
# TF graphs, and a .keras file saved on any backend loads on this one. Keras reads the variable at its
# first import; a program that imported Keras on another backend first is refused by models.load.
KERAS_BACKEND_GIVEN = os.environ.get("KERAS_BACKEND")
if "keras" not in sys.modules:
    os.environ["KERAS_BACKEND"] = "tensorflow"
# 3 hides the C++ ERROR lines too (e.g. tf.data's "NodeDef mentions attribute
# use_unbounded_threadpool" under op determinism); real errors still reach Python as
# exceptions. `edgeq -v` (EDGEQ_VERBOSE=1) keeps TensorFlow's warnings and errors.
if os.environ.get("EDGEQ_VERBOSE") or os.environ.get("EDGEQ_QUIET_TF"):  # the edgeq command's choice
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1" if os.environ.get("EDGEQ_VERBOSE") else "3")

from edgeq.errors import MissingExtraError  # noqa: E402


@contextlib.contextmanager
def _stderr_silenced():
    """TensorFlow's C++ start-up lines (oneDNN, CUDA stubs, cuInit) ignore every log-level
    variable; pointing fd 2 at /dev/null while TensorFlow starts is the only switch. Only
    under the edgeq command (EDGEQ_QUIET_TF=1), and not with EDGEQ_VERBOSE=1 (edgeq -v)."""
    if os.environ.get("EDGEQ_VERBOSE") or not os.environ.get("EDGEQ_QUIET_TF"):
        yield
        return
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


try:
    with _stderr_silenced():
        import tensorflow as tf  # noqa: E402

        tf.config.list_physical_devices()  # device discovery (cuInit) logs too: do it now, quietly
except ImportError as exc:  # pragma: no cover - exercised only on a device install
    raise MissingExtraError(
        f"this command needs TensorFlow ({exc.name or 'tensorflow'} is not importable: {exc}): "
        'pip install "edgeq[train]"'
    ) from exc

_LEGACY: dict[str, object] = {}


def _legacy_stack() -> dict[str, object]:
    """tf_keras and TF-MOT, imported once, with the legacy switch set first (TF-MOT's own compat
    sets it too). A missing or broken one is named: ``exc.name`` is None when the package is there
    but fails inside its own import (e.g. a tf_keras built for another TensorFlow)."""
    if not _LEGACY:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        for attr, module in (("keras", "tf_keras"), ("tfmot", "tensorflow_model_optimization")):
            try:
                with _stderr_silenced():
                    _LEGACY[attr] = importlib.import_module(module)
            except ImportError as exc:
                _LEGACY.clear()
                raise MissingExtraError(
                    f"this needs {module} for TF-MOT's QAT engine and tf_keras models ({exc}): "
                    f'pip install "edgeq[train]", or train a Keras 3 model with --qat-engine keras3'
                ) from exc
    return _LEGACY


class _OnFirstUse(types.ModuleType):
    """``keras`` or ``tfmot`` as a module that imports the real one at its first attribute read, so
    ``from edgeq.models.compat import keras`` costs nothing until a TF-MOT-path function runs."""

    def __init__(self, attr: str):
        super().__init__(f"edgeq.models.compat.{attr}")
        self._attr = attr

    def __getattr__(self, name: str):
        return getattr(_legacy_stack()[self._attr], name)


keras = _OnFirstUse("keras")
tfmot = _OnFirstUse("tfmot")


def start_runtime() -> None:
    """Run the first op, which starts TensorFlow's runtime (and prints oneDNN's notice), quietly.

    After it, devices and collective ops are fixed: a tf.distribute strategy that needs
    logical CPU devices or a worker cluster (edgeq.train.distribute) is set up first, which
    is why ``EDGEQ_DEFER_RUNTIME=1`` (set by ``edgeq train --strategy``) postpones this.
    """
    with _stderr_silenced():
        tf.constant(0.0) + 1.0


if os.environ.get("EDGEQ_QUIET_TF"):
    if not os.environ.get("EDGEQ_DEFER_RUNTIME"):
        start_runtime()
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    tf.get_logger().setLevel(logging.ERROR)

__all__ = ["tf", "keras", "tfmot", "start_runtime"]
