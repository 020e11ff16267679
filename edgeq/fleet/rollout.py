"""How a fleet operation goes through the devices: parallelism, batches, a failure budget.

No SSH and no numpy here: `edgeq profile` on a device parses these options too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from edgeq.errors import UsageError

T = TypeVar("T")


def _count(spec: str | None, total: int, what: str, round_up: bool = False) -> int | None:
    """``N`` or ``P%`` of ``total`` devices (None: no limit); a percentage rounds down, or
    with ``round_up`` up to at least one device."""
    if spec is None:
        return None
    text = str(spec).strip()
    try:
        value = float(text[:-1]) * total / 100 if text.endswith("%") else int(text)
    except ValueError:
        raise UsageError(f"{what} takes N or P% (e.g. 5 or 10%), got {spec!r}") from None
    if value < 0:
        raise UsageError(f"{what} cannot be negative, got {spec!r}")
    if round_up and text.endswith("%") and value > 0:
        return max(1, math.ceil(value - 1e-9))
    return int(value)


@dataclass(frozen=True)
class Rollout:
    """How a fleet operation goes through the devices: ``parallel`` at a time, in batches of
    ``batch`` (N or P%); once more than ``max_fail`` (N or P% of all) have failed, the devices
    of later batches are not touched."""

    parallel: int = 4
    batch: str | None = None
    max_fail: str | None = None

    def batches(self, devices: Sequence[T]) -> list[Sequence[T]]:
        # 10% of 9 devices is a batch of one, never "no batching": a small fleet must not
        # get the whole rollout at once because its share rounded to zero.
        size = _count(self.batch, len(devices), "--batch", round_up=True)
        if size == 0 and self.batch is not None:
            raise UsageError(f"--batch must be at least 1 device, got {self.batch!r}")
        size = len(devices) if size is None else size
        return [devices[i : i + size] for i in range(0, len(devices), size)] or [devices]

    def budget(self, total: int) -> int | None:
        return _count(self.max_fail, total, "--max-fail")
