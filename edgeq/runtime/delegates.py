"""Delegates by name: ``xnnpack`` (the default CPU path), ``none``, ``edgetpu`` or a library path.

A delegate that cannot be loaded is a RuntimeBackendError that says how to fix it;
the Edge TPU one points at deploy/CORAL.md.
"""

from __future__ import annotations

import gc
import logging
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeq.errors import RuntimeBackendError

log = logging.getLogger(__name__)

DELEGATE_CHOICES = ("xnnpack", "none", "edgetpu")

EDGETPU_LIBRARY = {"Linux": "libedgetpu.so.1", "Darwin": "libedgetpu.1.dylib", "Windows": "edgetpu.dll"}

EDGETPU_INSTALL_HINT = (
    "install the Edge TPU runtime and plug in the Coral device: "
    "sudo apt-get install libedgetpu1-std from the packages.cloud.google.com/apt coral-edgetpu-stable "
    "repository (see deploy/CORAL.md)"
)


@dataclass(frozen=True)
class DelegateChoice:
    """What to hand the interpreter for one ``--delegate`` value."""

    name: str  # xnnpack | none | edgetpu | the library path
    delegates: tuple[Any, ...]  # loaded delegate objects
    use_default_delegates: bool  # False turns XNNPACK off (reference kernels)


def edgetpu_library() -> str:
    return EDGETPU_LIBRARY.get(platform.system(), "libedgetpu.so.1")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _try_load(module: Any, library: str) -> tuple[Any, str | None]:
    """(delegate, None) or (None, first line of the error).

    A failed ``load_delegate`` leaves a half-built Delegate whose ``__del__`` prints
    "Exception ignored ..." noise on stderr; it is collected here with that noise muted.
    """
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, AttributeError) and "_library" in str(unraisable.exc_value)):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        try:
            return module.load_delegate(library), None
        except (ValueError, RuntimeError, OSError) as exc:
            error = _first_line(exc)
        gc.collect()
    finally:
        sys.unraisablehook = previous
    return None, error


def load_delegate(spec: str | None, module: Any) -> DelegateChoice:
    """Resolve a ``--delegate`` value with the interpreter module of the chosen backend.

    Args:
        spec: ``xnnpack`` (default), ``none``, ``edgetpu`` or a path to a delegate library.
        module: the backend's interpreter module (it provides ``load_delegate``).
    """
    name = (spec or "xnnpack").strip()
    if name.lower() == "xnnpack":
        return DelegateChoice("xnnpack", (), True)
    if name.lower() == "none":
        return DelegateChoice("none", (), False)
    if name.lower() == "edgetpu":
        library = edgetpu_library()
        delegate, error = _try_load(module, library)
        if error is not None:
            raise RuntimeBackendError(
                f"the Edge TPU delegate cannot be loaded ({error}); "
                f"the library or the Edge TPU device is missing: {EDGETPU_INSTALL_HINT}"
            )
        log.info("loaded the Edge TPU delegate from %s", library)
        return DelegateChoice("edgetpu", (delegate,), True)
    path = Path(name)
    if not path.is_file():
        raise RuntimeBackendError(
            f"--delegate {name!r}: not one of {', '.join(DELEGATE_CHOICES)} and no such delegate library file"
        )
    delegate, error = _try_load(module, str(path))
    if error is not None:
        raise RuntimeBackendError(
            f"the delegate library {path} cannot be loaded ({error}); "
            "is it a TFLite delegate built for this machine and runtime?"
        )
    log.info("loaded the delegate %s", path)
    return DelegateChoice(str(path), (delegate,), True)
