"""The one place that decides the Keras flavour.

TF-MOT works only with Keras 2 (``tf_keras``), and TensorFlow picks its Keras at first
import, so ``TF_USE_LEGACY_KERAS=1`` must be set before anything imports TensorFlow.
Every host-side module gets TensorFlow, Keras and TF-MOT from here; loading models is
``edgeq.models.load``'s job.

Importing this module from a program leaves the program's stderr and logging alone. The
``edgeq`` command sets ``EDGEQ_QUIET_TF=1`` first: TensorFlow then starts with fd 2 pointed
at /dev/null (its C++ start-up lines ignore every log level), runs its first op at once,
and its Python logger shows errors only, so a terminal shows edgeq's own words.
"""

from __future__ import annotations

import contextlib
import logging
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"
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
        import tensorflow_model_optimization as tfmot  # noqa: E402
        import tf_keras as keras  # noqa: E402

        tf.config.list_physical_devices()  # device discovery (cuInit) logs too: do it now, quietly
except ImportError as exc:  # pragma: no cover - exercised only on a device install
    raise MissingExtraError(
        f'this command needs TensorFlow and TF-MOT ({exc.name} is not installed): pip install "edgeq[train]"'
    ) from exc


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
