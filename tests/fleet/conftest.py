"""A real fleet for the tests: sshd on 127.0.0.1 and two devices behind it.

* ``x86-venv``: this machine's Python; ``edgeq push`` bootstraps a virtualenv with the base
  install there, offline: the sshd gives every session an index URL that leads nowhere, and
  pip installs the host's numpy / click / ai-edge-litert from wheels pushed to its wheelhouse.
* ``pi4-emu``: an emulated Raspberry Pi 4, aarch64 Debian python3.11 under qemu-user
  (deploy/make-emulated-pi4.sh). Its "python" is the host-side wrapper script, because an
  aarch64 process cannot exec another aarch64 binary without binfmt. No pip there: the push
  unpacks the edgeq wheel into WORKDIR/site (the offline bootstrap).

Nothing is mocked: paramiko talks to OpenSSH's sshd, the device code runs in real Pythons.
The environment comes from deploy/test-env.sh; without root or apt the tests skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
INT8 = DATA / "tiny_int8.tflite"
FP32 = DATA / "tiny_fp32.tflite"
DIGITS = DATA / "tiny_digits.npz"
SSHD = Path(os.environ.get("EDGEQ_SSHD", "/usr/sbin/sshd"))
SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")
PI4_DIR = Path(os.environ.get("EDGEQ_PI4_DIR", ROOT / ".cache" / "pi4"))
PI4_PYTHON = PI4_DIR / "bin" / "python"

# The commands this issue adds, for a cli.py that does not list them yet (harmless once it does).
EDGEQ_MAIN = "import sys; from edgeq.cli import main; sys.argv[0] = 'edgeq'; main()"


def _missing() -> list[str]:
    missing = []
    if not SSHD.is_file():
        missing.append(f"{SSHD} (openssh-server)")
    if not SFTP_SERVER.is_file():
        missing.append(str(SFTP_SERVER))
    if not shutil.which("ssh-keygen"):
        missing.append("ssh-keygen")
    if not shutil.which("qemu-aarch64-static"):
        missing.append("qemu-aarch64-static")
    if not PI4_PYTHON.is_file():
        missing.append(f"{PI4_PYTHON} (deploy/make-emulated-pi4.sh)")
    return missing


@pytest.fixture(scope="session")
def fleet_env() -> None:
    """Make sure sshd, qemu and the emulated Pi exist: run deploy/test-env.sh once if not."""
    pytest.importorskip("paramiko", reason="the fleet needs paramiko: pip install -e '.[deploy]'")
    if _missing():
        proc = subprocess.run(
            ["bash", str(ROOT / "deploy" / "test-env.sh")], cwd=ROOT, capture_output=True, text=True, timeout=1200
        )
        if _missing():
            pytest.skip(f"fleet test environment absent: {', '.join(_missing())}; {proc.stderr.strip()[-300:]}")
    if os.geteuid() != 0:
        pytest.skip("fleet tests start sshd, which needs root (its privilege separation)")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "edgeq-test", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@dataclass
class SSHServer:
    """One OpenSSH sshd on 127.0.0.1 with its own host key."""

    port: int
    folder: Path
    host_pub: str
    proc: subprocess.Popen

    def known_hosts_line(self) -> str:
        kind, blob = self.host_pub.split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {blob}"

    def kill(self) -> None:
        """Kill sshd and every session it forked (they live in their own sessions)."""
        victims = [self.proc.pid] + _descendants(self.proc.pid)
        for pid in reversed(victims):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


# What every session of a test sshd sees: pip has no route to a package index (a device
# offline), so a bootstrap that needs one fails at once instead of passing by luck. And
# SHLVL=1: bash then does not take the command for one run by sshd, so it skips the ~/.bashrc of
# this host's account (on a developer machine, `pyenv init` in it cost 0.17 s per command:
# a cost of this machine, not of a device, that a 50-device fleet paid 50 times a step).
NO_INDEX = "SetEnv PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_RETRIES=0 PIP_TIMEOUT=2 SHLVL=1"


def start_sshd(folder: Path, client_pub: str, port: int | None = None) -> SSHServer:
    folder.mkdir(parents=True, exist_ok=True)
    host_pub = keygen(folder / "host_ed25519")
    (folder / "authorized_keys").write_text(client_pub + "\n")
    port = port or free_port()
    config = folder / "sshd_config"
    config.write_text(
        "\n".join(
            [
                "ListenAddress 127.0.0.1",
                f"Port {port}",
                f"HostKey {folder / 'host_ed25519'}",
                f"AuthorizedKeysFile {folder / 'authorized_keys'}",
                f"PidFile {folder / 'sshd.pid'}",
                "StrictModes no",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PubkeyAuthentication yes",
                "PermitRootLogin prohibit-password",
                "MaxStartups 64",
                "MaxSessions 64",
                "LogLevel ERROR",
                f"Subsystem sftp {SFTP_SERVER}",
                NO_INDEX,
                "",
            ]
        )
    )
    log = open(folder / "sshd.log", "wb")  # noqa: SIM115 - lives as long as sshd
    proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited: {(folder / 'sshd.log').read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("sshd did not start listening")
    return SSHServer(port, folder, host_pub, proc)


@dataclass
class Fleet:
    root: Path
    sshd: SSHServer
    client_key: Path
    client_pub: str
    known_hosts: Path
    inventory: Path
    x86_workdir: Path
    x86_venv: Path
    pi4_workdir: Path

    def device_toml(self, name: str, port: int, workdir: Path, extra: str) -> str:
        return (
            f'[devices.{name}]\nhost = "127.0.0.1"\nport = {port}\nuser = "root"\n'
            f'identity_file = "{self.client_key}"\nworkdir = "{workdir}"\n{extra}\n'
        )


def host_python() -> str:
    """This machine's interpreter outside any virtualenv (the x86 device's system Python)."""
    return getattr(sys, "_base_executable", None) or sys.executable


@pytest.fixture(scope="session")
def fleet(fleet_env, tmp_path_factory) -> Fleet:
    root = tmp_path_factory.mktemp("fleet")
    client_pub = keygen(root / "client_ed25519")
    server = start_sshd(root / "sshd", client_pub)
    known_hosts = root / "known_hosts"
    known_hosts.write_text(server.known_hosts_line() + "\n")
    x86_work, pi4_work = root / "x86-work", root / "pi4 work"  # a space: paths are quoted everywhere
    f = Fleet(
        root,
        server,
        root / "client_ed25519",
        client_pub,
        known_hosts,
        root / "devices.toml",
        x86_work,
        root / "x86-venv",
        pi4_work,
    )
    text = f'[defaults]\nknown_hosts = "{known_hosts}"\n\n'
    text += f.device_toml(
        "x86-venv",
        server.port,
        x86_work,
        f'python = "{host_python()}"\nvenv = "{f.x86_venv}"\nwheelhouse = "{root / "wheelhouse"}"\n'
        'tags = ["x86", "ci"]',
    )
    text += "\n" + f.device_toml("pi4-emu", server.port, pi4_work, f'python = "{PI4_PYTHON}"\ntags = ["pi4", "ci"]')
    f.inventory.write_text(text)
    yield f
    server.kill()


def edgeq_subprocess(*args, cwd, timeout=600, **kwargs) -> subprocess.CompletedProcess:
    """``edgeq ARGS`` in a child process of this interpreter (for tests that kill things)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", EDGEQ_MAIN, *[str(a) for a in args]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


def edgeq_popen(*args, cwd) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", EDGEQ_MAIN, *[str(a) for a in args]],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # SIGINT as a terminal gives it, even when the test run is a background job (SIGINT ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


HOST_CPU: dict[str, float] = {}  # CPU seconds of each host command run by run_edgeq, by its log's name


# Written by the child at exit: its own peak RSS (VmHWM, kB). wait4's ru_maxrss is no measure of
# it: Linux counts the RSS the child had before exec, a copy of this test process's, which grows
# over a suite (a `python -c pass` forked from a 500 MiB parent reads 510 MiB there, 13 MiB here).
PEAK_RSS_HOOK = """
import atexit as _atexit, os as _os
def _peak_rss():
    try:
        status = open("/proc/self/status").read()
        with open(_os.environ["EDGEQ_TEST_PEAK_RSS"], "w") as out:
            out.write(status.split("VmHWM:")[1].split()[0])
    except (OSError, IndexError, KeyError):
        pass
_atexit.register(_peak_rss)
"""


def run_edgeq(*args, cwd: Path, log: Path, main: str = EDGEQ_MAIN, env: dict | None = None, preexec_fn=None):
    """Run ``edgeq ARGS`` as a child; (exit code, wall seconds, peak RSS MiB, stdout+stderr).

    ``main``: the Python source the child runs (edgeq's CLI); ``preexec_fn``: run in the child first.
    The peak RSS is the child's own (its VmHWM), whatever the size of the process that started it.
    """
    peak_file = log.with_name(log.name + ".peak_rss")
    peak_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGEQ_TEST_PEAK_RSS": str(peak_file), **(env or {})}
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", PEAK_RSS_HOOK + main, *[str(a) for a in args]],
            cwd=cwd,
            stdout=out,
            stderr=out,
            env=env,
            preexec_fn=preexec_fn,
        )
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    HOST_CPU[log.stem] = usage.ru_utime + usage.ru_stime
    peak = int(peak_file.read_text()) / 1024 if peak_file.is_file() else usage.ru_maxrss / 1024
    return proc.returncode, time.monotonic() - start, peak, log.read_text()


def summary_rows(text: str, header: str) -> dict[str, list[str]]:
    """The summary table's rows (the one whose first line starts with ``header``), by device."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [header])
    rows = {}
    for line in lines[start + 1 :]:
        parts = line.split()
        if not parts or not parts[0].startswith("dev"):
            break
        rows[parts[0]] = parts
    return rows


@contextlib.contextmanager
def loopback_fleet(root: Path, names: list[str], python_of, venvs=()):
    """One OpenSSH sshd per device on a loopback port, each with its own host key and work folder.

    ``python_of(name)``: the device's Python; devices in ``venvs`` get a virtualenv, the others
    run edgeq from unpacked wheels (site mode). All name one wheelhouse. Yields the inventory
    (TOML, with a known_hosts file) and each device's server; every sshd still alive is killed
    on the way out.
    """
    client_pub = keygen(root / "client_ed25519")
    servers, blocks, known = {}, ['[defaults]\nknown_hosts = "{}"\n'.format(root / "known_hosts")], []
    for name in names:
        try:
            server = start_sshd(root / name / "sshd", client_pub)
        except BaseException:  # no sshd left behind by a fleet that could not be built
            for started in servers.values():
                started.kill()
            raise
        servers[name] = server
        known.append(server.known_hosts_line())
        extra = f'venv = "{root / name / "venv"}"\n' if name in venvs else ""
        blocks.append(
            f'[devices.{name}]\nhost = "127.0.0.1"\nport = {server.port}\nuser = "root"\n'
            f'identity_file = "{root / "client_ed25519"}"\nworkdir = "{root / name / "home" / "edgeq"}"\n'
            f'python = "{python_of(name)}"\nwheelhouse = "{root / "wheelhouse"}"\n{extra}'
        )
    (root / "known_hosts").write_text("\n".join(known) + "\n")
    inventory = root / "devices.toml"
    inventory.write_text("\n".join(blocks))
    try:
        yield inventory, servers
    finally:
        for server in servers.values():
            if server.proc.poll() is None:
                server.kill()
