"""The one place that decides the Keras flavour.

TF-MOT works only with Keras 2 (``tf_keras``), and TensorFlow picks its Keras at first
import, so ``TF_USE_LEGACY_KERAS=1`` must be set before anything imports TensorFlow.
Every host-side module gets TensorFlow, Keras and TF-MOT from here; loading models is
``edgeq.model_io``'s job.
"""

from __future__ import annotations

import logging
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from edgeq.errors import MissingExtraError  # noqa: E402

try:
    import tensorflow as tf  # noqa: E402
    import tensorflow_model_optimization as tfmot  # noqa: E402
    import tf_keras as keras  # noqa: E402
except ImportError as exc:  # pragma: no cover - exercised only on a device install
    raise MissingExtraError(
        f'this command needs TensorFlow and TF-MOT ({exc.name} is not installed): pip install "edgeq[train]"'
    ) from exc

logging.getLogger("tensorflow").setLevel(logging.ERROR)
tf.get_logger().setLevel(logging.ERROR)

__all__ = ["tf", "keras", "tfmot"]
