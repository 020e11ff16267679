"""What a device holds, read in one command: the push's first (and when nothing changed, only) round trip.

One ``sh`` script, no Python start-up on the device, prints:

- ``home=``: the user's home (``~`` in inventory paths is expanded there, so connecting costs
  no command of its own);
- the health check's values (edgeq.fleet.health: free disk, temperature, throttling, load);
- ``marker=``: the sha256 of the edgeq build the device runs (the bootstrap's marker file);
- ``runtime=``: WORKDIR/.edgeq-runtime.json, the live and previous edgeq runtime (what a
  bootstrap keeps for a rollback);
- ``sha256 NAME=``: each file a push would write, in WORKDIR/models (``sha256sum``);
- ``live=``: WORKDIR/models/.edgeq-live.json, which version of each file is live;
- ``leftover=1`` when an interrupted upload left a part file behind, ``models_dir=1`` when
  WORKDIR/models exists.

A push whose runtime, files and live record are all already what it would write is then
done, after this one command (edgeq.fleet.remote.push_to).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from edgeq.fleet.health import HEALTH_LINES, Health, health_from
from edgeq.fleet.push import LIVE, PART_MARK
from edgeq.fleet.transport import Transport

_SCRIPT = (
    r"""
expand() { case "$1" in "~") printf %s "$HOME" ;; "~/"*) printf %s "$HOME/${1#"~/"}" ;; *) printf %s "$1" ;; esac; }
printf 'home=%s\n' "$HOME"
work=$(expand "$1"); marker=$(expand "$2"); shift 2
dir="$work"
"""
    + HEALTH_LINES
    + r"""
printf 'marker=%s\n' "$(cat -- "$marker" 2>/dev/null | head -n 1)"
if [ -r "$work/.edgeq-runtime.json" ]; then printf 'runtime=%s\n' "$(tr -d '\n' < "$work/.edgeq-runtime.json")"; fi
models="$work/models"
[ -d "$models" ] && printf 'models_dir=1\n'
for name in "$@"; do
  printf 'sha256 %s=%s\n' "$name" "$(sha256sum -- "$models/$name" 2>/dev/null | cut -d' ' -f1)"
done
if [ -r "$models/"""
    + LIVE
    + r"""" ]; then printf 'live=%s\n' "$(tr -d '\n' < "$models/"""
    + LIVE
    + r"""")"; fi
for part in "$models"/.*"""
    + PART_MARK
    + r"""*; do [ -e "$part" ] && { printf 'leftover=1\n'; break; }; done
"""
)


@dataclass(frozen=True)
class DeviceState:
    home: str
    health: Health
    marker: str | None  # the sha256 of the live edgeq build, None when none is installed
    sha256: dict[str, str | None]  # file name in WORKDIR/models -> its sha256 (None: not there)
    live: dict  # WORKDIR/models/.edgeq-live.json ({} when none or unreadable)
    leftover: bool  # an interrupted upload's part file is there
    models_dir: bool = False  # WORKDIR/models exists (an upload can go straight there)
    runtime: dict = field(default_factory=dict)  # WORKDIR/.edgeq-runtime.json ({} when none or unreadable)


def read_state(transport: Transport, workdir: str, marker: str, names: list[str]) -> DeviceState:
    """The device's state in one command; ``workdir`` and ``marker`` as the inventory gives them (``~`` allowed)."""
    result = transport.run(["sh", "-c", _SCRIPT, "edgeq-state", workdir, marker, *names], timeout=60)
    values: dict[str, str] = {}
    sums: dict[str, str | None] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.startswith("sha256 "):
            sums[key[len("sha256 ") :]] = value.strip() or None
        elif key:
            values.setdefault(key, value)
    live, runtime = _json(values.get("live")), _json(values.get("runtime"))
    return DeviceState(
        home=values.get("home", "").strip(),
        health=health_from(values),
        marker=values.get("marker", "").strip() or None,
        sha256={name: sums.get(name) for name in names},
        live=live,
        runtime=runtime,
        leftover=values.get("leftover") == "1",
        models_dir=values.get("models_dir") == "1",
    )


def _json(text: str | None) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
