"""Targets as data: what precisions a device can run, read from ``targets.toml`` or a user's file.

A plan proposes only what its target runs: the Edge TPU int8 alone, an NPU with 16x8 kernels
int8 and int16, a CPU all of them (and then it measures which is fastest there).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from edgeq.errors import UsageError

TABLE = Path(__file__).with_name("targets.toml")
PRECISIONS = ("int8", "int16", "float", "int4")
FALLBACKS = ("float", "int16")  # what a plan may move a layer that int8 hurts to


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    runs: tuple[str, ...]
    fast: tuple[str, ...]
    integer_only: bool
    static_shapes: bool

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The ways off int8 a plan may take on this target, in FALLBACKS order."""
        return tuple(f for f in FALLBACKS if f in self.runs)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "runs": list(self.runs),
            "fast": list(self.fast),
            "integer_only": self.integer_only,
            "static_shapes": self.static_shapes,
        }


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read the target file ({exc.__class__.__name__})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML ({str(exc).splitlines()[0]})") from exc


def builtin_names() -> list[str]:
    return list(_read(TABLE))


def _target(name: str, row, where: str) -> Target:
    if not isinstance(row, dict):
        raise UsageError(f"{where}: target {name!r} must be a table of runs, fast, integer_only, static_shapes")
    runs, fast = row.get("runs"), row.get("fast", row.get("runs"))
    for key, value in (("runs", runs), ("fast", fast)):
        if not isinstance(value, list) or not value or any(v not in PRECISIONS for v in value):
            raise UsageError(f"{where}: target {name!r}: {key} must list some of {', '.join(PRECISIONS)}")
    if "int8" not in runs:
        raise UsageError(f"{where}: target {name!r} must run int8 (every plan starts from full int8)")
    for key in ("integer_only", "static_shapes"):
        if not isinstance(row.get(key, False), bool):
            raise UsageError(f"{where}: target {name!r}: {key} must be true or false")
    if row.get("integer_only", False) and "float" in runs:
        raise UsageError(f"{where}: target {name!r} is integer_only but runs float: drop one")
    return Target(
        name,
        str(row.get("description", name)),
        tuple(runs),
        tuple(fast),
        bool(row.get("integer_only", False)),
        bool(row.get("static_shapes", False)),
    )


def load_target(name_or_path: str) -> Target:
    """A built-in target by name (cpu, edgetpu, npu16x8), or the one table of a user's TOML file."""
    table = _read(TABLE)
    if name_or_path in table:
        return _target(name_or_path, table[name_or_path], str(TABLE))
    path = Path(name_or_path)
    if path.suffix != ".toml":
        raise UsageError(f"--target {name_or_path!r}: choose one of {', '.join(table)}, or give a TARGET.toml file")
    if not path.is_file():
        raise UsageError(f"{path}: no such target file")
    rows = _read(path)
    if len(rows) != 1:
        raise UsageError(
            f"{path}: expected one [name] table (runs, fast, integer_only, static_shapes), got {len(rows)}"
        )
    ((name, row),) = rows.items()
    return _target(name, row, str(path))
