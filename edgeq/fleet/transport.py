"""One transport interface to a device: over SSH (paramiko), or this machine (LocalTransport).

Every remote command is built from an argument list with POSIX shell quoting, so a
file named ``a b;rm -rf ~.tflite`` is one argument and nothing else. Host keys are
checked against known_hosts; an unknown key is refused unless the device's policy is
``accept-new`` (OpenSSH's ``StrictHostKeyChecking=accept-new``), and a changed key is
always refused. Only keys or the agent authenticate: no password is ever sent.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import dataclasses
import hashlib
import logging
import os
import posixpath
import shlex
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from edgeq.artifacts import atomic_path
from edgeq.errors import (
    ConnectionLost,
    DeviceError,
    FleetInterrupted,
    HostKeyError,
    MissingExtraError,
    UnsafePathError,
)
from edgeq.fleet.inventory import Device

log = logging.getLogger(__name__)

USER_KNOWN_HOSTS = "~/.ssh/known_hosts"
PGID_MARK = "edgeq-pgid:"
_KNOWN_HOSTS_LOCK = threading.Lock()  # devices connect in parallel threads; appends must not interleave
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


def _paramiko():
    try:
        import paramiko
    except ImportError as exc:
        raise MissingExtraError("talking to devices needs paramiko: pip install 'edgeq[deploy]'") from exc
    return paramiko


def ssh_config_path() -> Path:
    """The OpenSSH client config edgeq reads (EDGEQ_SSH_CONFIG, else ~/.ssh/config)."""
    return Path(os.environ.get("EDGEQ_SSH_CONFIG", "~/.ssh/config")).expanduser()


def with_ssh_config(device: Device) -> tuple[Device, str | None]:
    """The device as ~/.ssh/config resolves its host (HostName, Port, User, IdentityFile), and its
    ProxyJump. What the inventory sets wins, as command-line options win over the config in ssh."""
    path = ssh_config_path()
    if not path.is_file():
        return device, None
    paramiko = _paramiko()
    try:
        found = paramiko.SSHConfig.from_path(str(path)).lookup(device.host)
    except (OSError, ValueError, paramiko.SSHException) as exc:
        raise DeviceError(f"{path}: cannot read the SSH config ({exc}); fix it or set EDGEQ_SSH_CONFIG") from exc
    identities = found.get("identityfile") or []
    resolved = dataclasses.replace(
        device,
        host=found.get("hostname", device.host),
        port=device.port if device.port != 22 or "port" not in found else int(found["port"]),
        user=device.user or found.get("user"),
        identity_file=device.identity_file or (identities[0] if identities else None),
    )
    jump = found.get("proxyjump")
    return resolved, (None if jump in (None, "none") else jump.split(",")[0].strip())


def _jump_device(device: Device, spec: str) -> Device:
    """``[user@]host[:port]`` of a ProxyJump as a device (its own config entry applies too)."""
    user, _, hostport = spec.rpartition("@")
    host, _, port = hostport.partition(":")
    if host.startswith("[") and "]" in hostport:  # [::1]:2222
        host, _, port = hostport[1:].partition("]")
        port = port.lstrip(":")
    return dataclasses.replace(
        device, name=f"{device.name} (jump {host})", host=host, port=int(port or 22), user=user or None,
        identity_file=None,
    )  # fmt: skip


def _known_hosts_files(device: Device) -> list[Path]:
    files = [Path(USER_KNOWN_HOSTS).expanduser()]
    if device.known_hosts:
        files.append(Path(device.known_hosts))
    return files


def _host_entry(device: Device) -> str:
    return device.host if device.port == 22 else f"[{device.host}]:{device.port}"


def _make_policy(device: Device):
    paramiko = _paramiko()
    save_to = Path(device.known_hosts or USER_KNOWN_HOSTS).expanduser()

    class Policy(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            if device.host_key_policy != "accept-new":
                raise HostKeyError(
                    f"{device.name}: host key of {_host_entry(device)} is not in known_hosts "
                    f"({', '.join(str(p) for p in _known_hosts_files(device))}); the device offers "
                    f"{fingerprint(key)}. Check it on the device (ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub), "
                    f"then add it: ssh-keyscan -p {device.port} {device.host} >> {save_to}, "
                    "or rerun with --accept-new-host-keys"
                )
            with _KNOWN_HOSTS_LOCK:
                save_to.parent.mkdir(parents=True, exist_ok=True)
                with open(save_to, "a", encoding="utf-8") as fh:
                    fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            client.get_host_keys().add(hostname, key.get_name(), key)
            log.warning("%s: recorded new host key %s for %s in %s", device.name, fingerprint(key), hostname, save_to)

    return Policy()


class SSHTransport(Transport):
    """A device over SSH: paramiko for commands, SFTP for files."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._client = None
        self._sftp = None
        self._jump = None
        try:
            self.connect()
        except BaseException:  # a client that connected but failed later (home, ...) is closed, not leaked
            self.close()
            raise

    def connect(self) -> None:
        paramiko = _paramiko()
        device, jump = with_ssh_config(self.device)
        sock = None
        if jump is not None:  # ProxyJump: a direct-tcpip channel through the jump host is the socket
            self._jump = SSHTransport(_jump_device(device, jump))
            try:
                sock = self._jump._client.get_transport().open_channel(
                    "direct-tcpip", (device.host, device.port), ("127.0.0.1", 0), timeout=device.connect_timeout
                )
            except (OSError, paramiko.SSHException, EOFError) as exc:
                raise ConnectionLost(f"{device.name}: cannot reach {device.address} through {jump}: {exc}") from exc
        client = paramiko.SSHClient()
        for path in _known_hosts_files(device):
            if path.is_file():
                try:
                    client.load_host_keys(str(path))
                except (OSError, paramiko.SSHException) as exc:
                    raise HostKeyError(f"{path}: cannot read known_hosts ({exc})") from exc
        client.set_missing_host_key_policy(_make_policy(device))
        where = f"{device.name} ({device.address})"
        try:
            client.connect(
                device.host,
                port=device.port,
                username=device.user,
                key_filename=device.identity_file,
                allow_agent=device.agent,
                look_for_keys=device.identity_file is None,
                timeout=device.connect_timeout,
                banner_timeout=device.connect_timeout,
                auth_timeout=device.connect_timeout,
                password=None,
                sock=sock,
            )
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            files = " or ".join(str(p) for p in _known_hosts_files(device) if p.is_file())
            raise HostKeyError(
                f"{where}: host key CHANGED: known_hosts ({files}) has {fingerprint(exc.expected_key)}, "
                f"the device now offers {fingerprint(exc.key)}. Refusing to connect: someone may be intercepting "
                f"the connection. If the device was reinstalled, remove the old key with "
                f"ssh-keygen -R '{_host_entry(device)}' -f FILE and connect again"
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            how = f"key {device.identity_file}" if device.identity_file else "the SSH agent / default keys"
            raise DeviceError(f"{where}: authentication failed with {how} ({exc}); edgeq uses keys only") from None
        except (OSError, socket.timeout, paramiko.SSHException, EOFError) as exc:
            client.close()
            raise ConnectionLost(f"{where}: cannot connect: {exc or type(exc).__name__}") from exc
        self._client = client
        self._sftp = None
        self._home_folder: str | None = None

    @property
    def home(self) -> str:
        """The device user's home, asked once, when a path needs it (a push that finds
        everything in place learns it from its one state command: ``home = ...``)."""
        if self._home_folder is None:
            self._home_folder = self._home()
        return self._home_folder

    @home.setter
    def home(self, value: str) -> None:
        self._home_folder = value

    def _home(self) -> str:
        result = self.run(["sh", "-c", 'printf %s "$HOME"'], timeout=self.device.connect_timeout)
        home = result.stdout.strip()
        if not result.ok or not home.startswith("/"):
            raise DeviceError(f"{self.device.name}: cannot find the home folder ({result.last_error_line()})")
        return home

    @property
    def sftp(self):
        if self._sftp is None:
            try:
                self._sftp = self._client.open_sftp()
            except Exception as exc:  # paramiko raises SSHException or socket errors
                raise ConnectionLost(f"{self.device.name}: SFTP is not available: {exc}") from exc
        return self._sftp

    def _lost(self, exc: BaseException, what: str) -> ConnectionLost:
        return ConnectionLost(f"{self.device.name}: connection lost during {what}: {exc or type(exc).__name__}")

    def _session(self):
        """A new SSH channel, or ConnectionLost when there is no live connection."""
        transport = self._client.get_transport() if self._client is not None else None
        if transport is None or not transport.is_active():
            raise ConnectionLost(f"{self.device.name}: not connected")
        return transport.open_session()

    def _kill(self, pgid: int | None) -> None:
        """Kill what a stopped command started on the device (its process group)."""
        if pgid is None:
            return
        with contextlib.suppress(Exception):  # best effort: the connection may be the thing that failed
            channel = self._session()
            channel.exec_command(kill_group_command(pgid))
            channel.recv_exit_status()
            channel.close()

    def run(self, argv, *, env=None, cwd=None, timeout=None) -> CommandResult:
        paramiko = _paramiko()
        self.commands += 1
        command = shell_command(argv, env=env, cwd=cwd)
        log.info("%s$ %s", self.device.name, command)
        start = time.monotonic()
        out, err = bytearray(), bytearray()
        pgid = None
        try:
            channel = self._session()
            channel.exec_command(in_own_process_group(command))
            deadline = None if timeout is None else start + timeout
            while True:
                busy = False
                while channel.recv_ready():
                    out += channel.recv(65536)
                    busy = True
                while channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                    busy = True
                if pgid is None and b"\n" in err and err.startswith(PGID_MARK.encode()):
                    line, _, rest = bytes(err).partition(b"\n")
                    pgid, err = int(line[len(PGID_MARK) :]), bytearray(rest)
                if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                    break
                if channel.closed or not channel.get_transport().is_active():
                    raise ConnectionLost("the channel closed before the command finished")
                stop = None
                if CANCEL.is_set():
                    stop = FleetInterrupted(f"{self.device.name}: interrupted; {argv[0]} stopped on the device")
                elif deadline is not None and time.monotonic() > deadline:
                    stop = DeviceError(f"{self.device.name}: command timed out after {timeout:.0f} s: {argv[0]} ...")
                if stop is not None and (pgid is not None or time.monotonic() > start + (timeout or 0) + 30):
                    self._kill(pgid)  # before closing the channel: the remote process would outlive it
                    channel.close()
                    raise stop
                if not busy:
                    time.sleep(0.01)
            status = channel.recv_exit_status()
            channel.close()
        except DeviceError as exc:
            if isinstance(exc, ConnectionLost):
                raise self._lost(exc, "a command") from exc
            raise
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise self._lost(exc, "a command") from exc
        if status == -1:  # no exit status: the session died (e.g. sshd killed)
            raise ConnectionLost(f"{self.device.name}: the connection dropped while running {argv[0]}")
        if pgid is None and err.startswith(PGID_MARK.encode()):  # a command that wrote nothing after it
            err = bytearray(bytes(err).partition(b"\n")[2])
        return CommandResult(
            command=command,
            exit_status=status,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            seconds=time.monotonic() - start,
        )

    def _sftp_call(self, what: str, fn, *args, **kwargs):
        paramiko = _paramiko()
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except (OSError, paramiko.SSHException, EOFError) as exc:
            alive = self._client.get_transport() is not None and self._client.get_transport().is_active()
            if isinstance(exc, OSError) and alive and not isinstance(exc, (socket.timeout, ConnectionError)):
                raise DeviceError(f"{self.device.name}: {what} failed: {exc}") from exc
            raise self._lost(exc, what) from exc

    def upload(self, local, remote, callback=None) -> None:
        self._sftp_call(f"upload of {Path(local).name}", self.sftp.put, str(local), remote, callback=callback)

    def download(self, remote, local) -> None:
        with atomic_path(local) as tmp:
            self._sftp_call(f"download of {remote}", self.sftp.get, remote, str(tmp))

    def rename(self, src, dst) -> None:
        self._sftp_call("rename", self.sftp.posix_rename, src, dst)

    def remove(self, path) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._sftp_call("remove", self.sftp.remove, path)

    def listdir(self, path) -> list[str]:
        try:
            return self._sftp_call("listdir", self.sftp.listdir, path)
        except FileNotFoundError:
            return []

    def makedirs(self, path) -> None:
        result = self.run(["mkdir", "-p", "--", path], timeout=60)
        if not result.ok:
            raise DeviceError(f"{self.device.name}: cannot create {path}: {result.last_error_line()}")

    def close(self) -> None:
        """Close the session and wait for paramiko's reader thread to end.

        paramiko's close() stops that thread without joining it, so it outlives the device by
        up to a read timeout; joined here, a fleet run keeps no thread per device it is done with.
        """
        reader = self._client.get_transport() if self._client is not None else None
        for thing in (self._sftp, self._client, self._jump):
            if thing is not None:
                with contextlib.suppress(Exception):  # closing a dead connection may raise anything
                    thing.close()
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=30)  # ends at once: its socket is closed; 30 s only bounds a wedged one
        self._sftp = self._client = self._jump = None


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
