"""edgeq: from a Keras model to a verified integer-only TFLite model on an edge device.

Each stage of the workflow is one function (``edgeq.api``), importable from here::

    import edgeq

    run = edgeq.train("digits-cnn", data="digits", out_dir="runs/demo")
    tflite = edgeq.convert(run.qat_model, "runs/demo/digits_int8.tflite", mode="int8-only")
    result = edgeq.evaluate(tflite.path, run.fp32_model, "digits", max_drop_pp=1.0)

This module must stay importable without TensorFlow (the device install has none): the
functions are loaded on first use, and each loads its stage (TensorFlow with it) only when called.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["train", "convert", "evaluate", "analyze", "profile", "push", "verify", "report", "__version__"]

_API = frozenset(__all__) - {"__version__"}


def __getattr__(name: str):
    if name in _API:
        from edgeq import api

        return getattr(api, name)
    raise AttributeError(f"module 'edgeq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
