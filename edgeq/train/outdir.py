"""What ``--out`` may hold before a run starts: read without TensorFlow, so a refusal is instant."""

from __future__ import annotations

from pathlib import Path

from edgeq.errors import UsageError


def state_file(out_dir: str | Path) -> Path:
    """The checkpoint's state of an unfinished run."""
    return Path(out_dir) / "checkpoint" / "state.json"


def refuse_overwrite(out_dir: str | Path, resume: bool, force: bool) -> None:
    """A UsageError where ``out_dir`` holds nothing to resume (with ``resume``) or a run that would be
    overwritten (without ``force``); the run's chief asks, before anything is loaded or trained."""
    out_dir = Path(out_dir)
    if resume:
        if not state_file(out_dir).is_file():
            raise UsageError(f"{out_dir}: nothing to resume (no checkpoint/state.json); run without --resume")
        return
    if force:
        return
    if state_file(out_dir).is_file():
        raise UsageError(f"{out_dir} holds an unfinished run: continue it with --resume, or start over with --force")
    if (out_dir / "run.json").is_file():
        raise UsageError(f"{out_dir} already holds a finished run: choose another --out, or overwrite with --force")
