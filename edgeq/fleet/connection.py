"""``connect``: the transport an inventory entry asks for; ``LocalTransport`` for this machine."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from edgeq.artifacts import atomic_path
from edgeq.errors import (
    ConnectionLost,
    DeviceError,
    FleetInterrupted,
)
from edgeq.fleet.inventory import Device
from edgeq.fleet.ssh import SSHTransport
from edgeq.fleet.transport import CANCEL, CommandResult, Transport, retry, shell_command

log = logging.getLogger(__name__)


class LocalTransport(Transport):
    """A "device" that is this machine (``host = "local"`` in the inventory): commands run
    through ``sh`` in their own process group and files are copied, with the same
    timeouts, Ctrl-C and process-group kills as over SSH. For fleet logic at scale in the
    default test suite without sshd, and for profiling on the host with the fleet's tools."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.home = os.path.expanduser("~")
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise ConnectionLost(f"{self.device.name}: not connected")

    def run(self, argv, *, env=None, cwd=None, timeout=None) -> CommandResult:
        import subprocess

        self._check()
        self.commands += 1
        command = shell_command(argv, env=env, cwd=cwd)
        log.info("%s$ %s", self.device.name, command)
        start = time.monotonic()
        proc = subprocess.Popen(
            ["sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = None if timeout is None else start + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                stop = None
                if CANCEL.is_set():
                    stop = FleetInterrupted(f"{self.device.name}: interrupted; {argv[0]} stopped on the device")
                elif deadline is not None and time.monotonic() > deadline:
                    stop = DeviceError(f"{self.device.name}: command timed out after {timeout:.0f} s: {argv[0]} ...")
                if stop is not None:
                    self._kill_group(proc)
                    raise stop from None
        return CommandResult(
            command=command,
            exit_status=proc.returncode if proc.returncode >= 0 else 128 - proc.returncode,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            seconds=time.monotonic() - start,
        )

    @staticmethod
    def _kill_group(proc, grace_s: float = 3.0) -> None:
        """TERM to the command's process group, KILL after ``grace_s`` (what kill_group_command does remotely)."""
        import signal
        import subprocess

        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group's other members (background children) too
        proc.communicate()

    def _files(self, what: str, fn, *args):
        self._check()
        try:
            return fn(*args)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise DeviceError(f"{self.device.name}: {what} failed: {exc}") from exc

    def upload(self, local, remote, callback=None) -> None:
        import shutil

        self._files(f"upload of {Path(local).name}", shutil.copyfile, str(local), remote)
        if callback is not None:
            size = Path(remote).stat().st_size
            callback(size, size)

    def download(self, remote, local) -> None:
        import shutil

        with atomic_path(local) as tmp:
            self._files(f"download of {remote}", shutil.copyfile, remote, str(tmp))

    def rename(self, src, dst) -> None:
        self._files("rename", os.replace, src, dst)

    def remove(self, path) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._files("remove", os.remove, path)

    def listdir(self, path) -> list[str]:
        try:
            return self._files("listdir", os.listdir, path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path) -> None:
        self._files(f"mkdir {path}", os.makedirs, path, 0o777, True)

    def close(self) -> None:
        self._closed = True


LOCAL_HOST = "local"


def connect(device: Device, attempts: int = 3, backoff_s: float = 0.5) -> Transport:
    """A transport to ``device`` (SSH, or LocalTransport for ``host = "local"``); transient
    connection failures are retried."""
    if device.host == LOCAL_HOST:
        return LocalTransport(device)
    return retry(lambda: SSHTransport(device), attempts=attempts, backoff_s=backoff_s, what=f"connect to {device.name}")
