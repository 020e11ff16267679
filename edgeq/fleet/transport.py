"""One interface to a device's shell and files: ``Transport``, its results, retries, confined paths."""

from __future__ import annotations

import abc
import base64
import hashlib
import logging
import posixpath
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from edgeq.errors import (
    ConnectionLost,
    UnsafePathError,
)
from edgeq.fleet.inventory import Device

log = logging.getLogger(__name__)


PGID_MARK = "edgeq-pgid:"


# Set by the CLI on Ctrl-C (for_each_device): every running command kills its remote process
# group and stops. One fleet operation runs at a time in a process, so one flag is enough.
CANCEL = threading.Event()


@dataclass(frozen=True)
class CommandResult:
    command: str
    exit_status: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    def last_error_line(self) -> str:
        """The line of stderr (or stdout) most likely to say what went wrong."""
        for text in (self.stderr, self.stdout):
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("error:")]
            if errors:
                return errors[-1]
            if lines:
                return lines[-1]
        return f"exit status {self.exit_status}"


def shell_command(argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """A POSIX sh command line for ``argv``: every word quoted, nothing interpreted."""
    if not argv:
        raise ValueError("empty command")
    words = []
    if env:
        for key in env:
            if not key.replace("_", "").isalnum() or key[0].isdigit():
                raise UnsafePathError(f"environment variable name {key!r} is not valid")
        words += ["env"] + [f"{k}={v}" for k, v in env.items()]
    words += list(argv)
    command = "exec " + " ".join(shlex.quote(str(w)) for w in words)
    if cwd:
        command = f"cd {shlex.quote(cwd)} && {command}"
    return command


def in_own_process_group(command: str) -> str:
    """``command`` in a new session (its own process group), which prints its group id on stderr
    first, so that a timeout or Ctrl-C can kill everything it started, not only the SSH channel.

    ``setsid -w`` (util-linux, busybox) passes the exit status back; without setsid the
    command runs as before and only its own process can be killed.
    """
    inner = f'printf "{PGID_MARK}%s\\n" "$$" >&2; {command}'
    quoted = shlex.quote(inner)
    return f"if command -v setsid >/dev/null 2>&1; then exec setsid -w sh -c {quoted}; else exec sh -c {quoted}; fi"


def kill_group_command(pgid: int, grace_s: float = 3.0) -> str:
    """TERM to the group (or the process), then KILL whatever is left after ``grace_s``."""
    alive = f"kill -0 -- -{pgid} 2>/dev/null || kill -0 {pgid} 2>/dev/null"
    steps = max(1, int(grace_s / 0.2))
    return (
        f"kill -TERM -- -{pgid} 2>/dev/null || kill -TERM {pgid} 2>/dev/null; "
        f"i=0; while [ $i -lt {steps} ] && {{ {alive}; }}; do sleep 0.2; i=$((i+1)); done; "
        f"kill -KILL -- -{pgid} 2>/dev/null; kill -KILL {pgid} 2>/dev/null; exit 0"
    )


def confine(workdir: str, *parts: str) -> str:
    """``workdir/parts...`` on the device, refusing anything that would leave ``workdir``."""
    for part in parts:
        if not part or "\x00" in part or part.startswith("/") or "\\" in part:
            raise UnsafePathError(f"{part!r}: not a relative path inside the device's work directory")
        if any(p in ("..", ".") for p in part.split("/")):
            raise UnsafePathError(f"{part!r}: '..' and '.' are not allowed in a device path")
    path = posixpath.normpath(posixpath.join(workdir, *parts))
    root = posixpath.normpath(workdir)
    if path != root and not path.startswith(root.rstrip("/") + "/"):
        raise UnsafePathError(f"{'/'.join(parts)!r} escapes the device's work directory {workdir}")
    return path


def fingerprint(key) -> str:
    """OpenSSH-style SHA256 fingerprint of a paramiko key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return f"{key.get_name()} SHA256:{base64.b64encode(digest).decode().rstrip('=')}"


class Transport(abc.ABC):
    """What edgeq needs from a connection to a device.

    ``commands`` counts the commands run on the device (each one a shell there, and a round
    trip here): what a push or a profile costs a fleet, per device.
    """

    device: Device
    home: str
    commands: int = 0

    @abc.abstractmethod
    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run ``argv`` on the device (quoted, never interpreted by a shell)."""

    @abc.abstractmethod
    def upload(self, local: Path, remote: str, callback: Callable[[int, int], None] | None = None) -> None:
        """Copy a local file to exactly ``remote`` (no rename, no checks)."""

    @abc.abstractmethod
    def download(self, remote: str, local: Path) -> None: ...

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Atomic rename on the device, replacing ``dst``."""

    @abc.abstractmethod
    def remove(self, path: str) -> None: ...

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]: ...

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def expand(self, path: str) -> str:
        """``~`` and ``~/x`` in inventory paths -> the device user's home."""
        if path == "~":
            return self.home
        if path.startswith("~/"):
            return posixpath.join(self.home, path[2:])
        return path

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def backoff_delay(attempt: int, backoff_s: float, rng=None) -> float:
    """The wait before retry ``attempt`` (1, 2, ...): exponential, with jitter.

    ``backoff_s * 2**(attempt-1)`` times a uniform factor in [0.5, 1.5): fifty devices that
    lost the network together do not all come back in the same instant.
    """
    import random

    return backoff_s * 2 ** (attempt - 1) * (rng or random).uniform(0.5, 1.5)


def retry(fn, *, attempts: int = 3, backoff_s: float = 0.5, what: str = "operation", on_retry=None):
    """Call ``fn``; on ConnectionLost wait ``backoff_delay`` and try again (``attempts`` in all)."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except ConnectionLost as exc:
            if attempt == attempts:
                raise
            delay = backoff_delay(attempt, backoff_s)
            log.warning("%s failed (%s); retry %d/%d in %.1f s", what, exc, attempt, attempts - 1, delay)
            time.sleep(delay)
            if on_retry is not None:
                on_retry()
    raise AssertionError("unreachable")  # pragma: no cover
