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

import sys
import types

__version__ = "0.1.0"
__all__ = ["train", "convert", "evaluate", "analyze", "optimize", "profile", "push", "verify", "report", "__version__"]

_API = frozenset(__all__) - {"__version__"}


def _public(name: str) -> property:
    """``edgeq.<name>`` is always the public function, also once the stage package of the same
    name (``edgeq/convert/`` ...) is imported: the import system binds a loaded subpackage to its
    parent's attribute, and this setter declines that (the package stays in ``sys.modules``)."""

    def get(module):
        from edgeq import api

        return getattr(api, name)

    def put(module, value):
        if not isinstance(value, types.ModuleType):
            raise AttributeError(f"edgeq.{name} is edgeq's public function; it cannot be replaced")

    return property(get, put, doc=f"edgeq.api.{name}")


class _Edgeq(types.ModuleType):
    """The ``edgeq`` package, whose public functions share their names with its stage packages."""


for _name in _API:
    setattr(_Edgeq, _name, _public(_name))
sys.modules[__name__].__class__ = _Edgeq


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
