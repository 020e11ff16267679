"""Run ``edgeq ARGS...`` in a process where tf_keras and TF-MOT cannot be imported.

``python tests/keras3_only.py train m.keras ...``: every import of ``tf_keras`` or
``tensorflow_model_optimization`` (or a submodule) fails as if neither were installed. At exit the
process fails (exit code 97) if ``TF_USE_LEGACY_KERAS`` was set on the way, or if either package got
into ``sys.modules`` regardless: the Keras 3 path must not reach the legacy stack at all.
"""

from __future__ import annotations

import os
import sys

BLOCKED = ("tf_keras", "tensorflow_model_optimization")


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r} (blocked by tests/keras3_only.py)", name=name)
        return None


def _legacy_reached() -> list[str]:
    reached = [name for name in sys.modules if name.split(".")[0] in BLOCKED]
    if os.environ.get("TF_USE_LEGACY_KERAS"):
        reached.append(f"TF_USE_LEGACY_KERAS={os.environ['TF_USE_LEGACY_KERAS']}")
    return reached


def main() -> int:
    if os.environ.get("TF_USE_LEGACY_KERAS"):
        sys.stderr.write("keras3_only: TF_USE_LEGACY_KERAS is set in the environment given\n")
        return 97
    sys.meta_path.insert(0, _NotInstalled())
    sys.argv = ["edgeq", *sys.argv[1:]]
    from edgeq.cli import cli

    try:
        cli(prog_name="edgeq")  # click's standalone mode: it always ends in SystemExit
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    reached = _legacy_reached()
    if reached:
        sys.stderr.write(f"keras3_only: the legacy stack was reached: {', '.join(reached)}\n")
        return 97
    return code


if __name__ == "__main__":
    sys.exit(main())
