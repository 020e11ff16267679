"""``SSHTransport`` (paramiko): host keys, ssh_config, jump hosts."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from pathlib import Path

from edgeq.artifacts import atomic_path
from edgeq.errors import (
    ConnectionLost,
    DeviceError,
    FleetInterrupted,
    HostKeyError,
    MissingExtraError,
)
from edgeq.fleet.inventory import Device
from edgeq.fleet.transport import (
    CANCEL,
    PGID_MARK,
    CommandResult,
    Transport,
    fingerprint,
    in_own_process_group,
    kill_group_command,
    shell_command,
)

log = logging.getLogger(__name__)


USER_KNOWN_HOSTS = "~/.ssh/known_hosts"


_KNOWN_HOSTS_LOCK = threading.Lock()  # devices connect in parallel threads; appends must not interleave


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
