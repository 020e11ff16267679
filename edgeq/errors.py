"""Errors a user can act on: what went wrong, where, and what to do about it.

The CLI prints ``error: <message>`` on one line and exits with ``exit_code``; a
traceback is shown only with ``--debug``. Library code raises these, never prints.
"""

from __future__ import annotations


class EdgeqError(Exception):
    """Base of every error edgeq reports to the user."""

    exit_code = 1


class UsageError(EdgeqError):
    """An option or combination of options that cannot work."""

    exit_code = 2


class MissingExtraError(EdgeqError):
    """A host-only feature was used on an install without the extra it needs."""

    exit_code = 3


class ModelLoadError(EdgeqError):
    """A model file is missing, unreadable or not a model."""


class DataError(EdgeqError):
    """A dataset is missing, empty, or does not fit the model."""


class UnsupportedLayerError(EdgeqError):
    """TF-MOT cannot quantize a layer of the model."""


class ConversionError(EdgeqError):
    """The TFLite converter failed, or what it wrote did not pass verification."""


class IntegerOnlyError(ConversionError):
    """An integer-only model was asked for, but some ops or tensors stay float."""


class QualityGateError(EdgeqError):
    """A measured quality figure (e.g. accuracy drop) is outside the allowed budget."""

    exit_code = 4


class RuntimeBackendError(EdgeqError):
    """No usable TFLite interpreter, or a delegate that cannot be loaded."""


class TrainingInterrupted(EdgeqError):
    """Training stopped (Ctrl-C); completed epochs are in the checkpoint."""

    exit_code = 130


class TrainingDiverged(EdgeqError):
    """The loss became NaN or infinite: the stage stopped, its last finite checkpoint kept."""

    exit_code = 1


class InventoryError(EdgeqError):
    """The device inventory is missing, malformed, or names no such device."""

    exit_code = 2


class DeviceError(EdgeqError):
    """A device could not be reached, bootstrapped, or did not finish its work."""

    exit_code = 5


class HostKeyError(DeviceError):
    """A device's SSH host key is unknown or differs from the one in known_hosts."""


class TransferError(DeviceError):
    """An upload or download did not complete, or its sha256 did not match."""


class UnsafePathError(EdgeqError):
    """A file name or remote path that would escape the device's work directory."""

    exit_code = 2


class VerificationMismatch(EdgeqError):
    """The device's outputs differ from the host interpreter's beyond the tolerance."""

    exit_code = 4


class ConnectionLost(DeviceError):
    """The SSH connection failed or dropped: worth a retry with backoff."""


class FleetInterrupted(EdgeqError):
    """Ctrl-C during a fleet operation: remote commands were stopped, finished devices listed."""

    exit_code = 130


class DevicesFailed(EdgeqError):
    """Some devices of a fleet operation failed (the others finished; the table says which)."""

    exit_code = 5


class RolloutStopped(EdgeqError):
    """More devices failed than --max-fail allows: the devices of later batches were not touched."""

    exit_code = 6


class ReleaseRefused(TransferError):
    """A store served a genuine release this device must not apply: older than the one it runs
    (rollback), its own number with other files (mix-and-match), or past its expiry (freeze).
    Nothing changed on the device; a timer-driven pull exits 7 so its log says why."""

    exit_code = 7
