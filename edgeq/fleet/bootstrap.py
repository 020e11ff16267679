"""A device's edgeq runtime: probed, installed into a versioned venv or site, switched, rolled back."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import threading
from pathlib import Path

from edgeq.errors import DeviceError
from edgeq.fleet.probe import BASE_REQUIREMENTS, VENV_REQUIREMENTS, DeviceRuntime, pinned, probe
from edgeq.fleet.push import Rollback, _now, device_python_c, read_live, upload_atomically, write_live
from edgeq.fleet.transport import Transport, confine
from edgeq.fleet.wheels import _dependency_wheels, _keyed_lock, build_wheel

log = logging.getLogger(__name__)


_MARKER = ".edgeq-wheel.sha256"


RUNTIME_STATE = ".edgeq-runtime.json"  # WORKDIR/.edgeq-runtime.json: live and previous edgeq runtime


SCHEMA_MODULE = "edgeq_tflite_schema"  # edgeq.runtime.flatbuffer imports it when LiteRT's is absent


def _read_marker(transport: Transport, path: str) -> str | None:
    result = transport.run(["cat", "--", path], timeout=60)
    return result.stdout.strip() if result.ok else None


# Checks each FILE=SHA256 given before "--", removing a file whose sha256 differs, then runs the
# command after it; when MARK is set and the command succeeds, writes DIGEST there.
_CHECKED = r"""
bad=0
while [ "$1" != "--" ]; do
  file=${1%=*}; want=${1##*=}; shift
  got=$(sha256sum -- "$file" 2>/dev/null | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then
    rm -f -- "$file"; echo "error: $file: sha256 ${got:-none} != $want; removed, push again" >&2; bad=1
  fi
done
shift
[ "$bad" = 0 ] || exit 3
"$@" || exit $?
if [ -n "$MARK" ]; then printf '%s\n' "$DIGEST" > "$MARK"; fi
"""


def _checked_run(transport: Transport, files: list[str], argv: list[str], mark: str | None, digest: str, timeout):
    """``argv`` on the device after every FILE=SHA256 in ``files`` checks out, in one command;
    ``mark``: where to write ``digest`` when it succeeds."""
    env = ["env", f"MARK={mark or ''}", f"DIGEST={digest}"]
    return transport.run([*env, "sh", "-c", _CHECKED, "edgeq-install", *files, "--", *argv], timeout=timeout)


def _write_marker(transport: Transport, path: str, value: str) -> None:
    result = transport.run(["sh", "-c", 'printf "%s\\n" "$1" > "$2"', "sh", value, path], timeout=60)
    if not result.ok:
        raise DeviceError(f"{transport.device.name}: cannot write {path}: {result.last_error_line()}")


def read_runtime_state(transport: Transport, workdir: str) -> dict:
    """WORKDIR/.edgeq-runtime.json: the live edgeq runtime and the previous one ({} when none)."""
    return read_live(transport, workdir, name=RUNTIME_STATE)


def _version_record(digest: str, built: Path, **where: str) -> dict:
    version = built.name.split("-")[1] if built.name.count("-") >= 2 else None
    return {"sha256": digest, "edgeq": version, "wheel_name": built.name, "since": _now(), **where}


def runtime_layout(device, expand) -> tuple[DeviceRuntime, str]:
    """How edgeq runs on ``device`` and where the sha256 of its build is kept; ``expand``
    resolves ``~`` (or leaves it for the device's shell to)."""
    workdir = expand(device.workdir)
    if device.venv:
        venv = expand(device.venv).rstrip("/")
        return DeviceRuntime(python=f"{venv}/bin/python", env={}, mode="venv", workdir=workdir), f"{venv}/{_MARKER}"
    site = confine(workdir, "site")
    runtime = DeviceRuntime(python=device.python, env={"PYTHONPATH": site}, mode="site", workdir=workdir)
    return runtime, confine(site, _MARKER)  # through the link: the live version's marker


_DIGESTS: dict[tuple[str, int, int], str] = {}


def wheel_digest(wheel: str | Path | None = None) -> str:
    """The sha256 of ``wheel`` (this checkout's build when None; any dependency wheel or file
    pushed), computed once per file state however many devices get it."""
    wheel = Path(wheel) if wheel else build_wheel()
    stat = wheel.stat()
    key = (str(wheel.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _DIGESTS:
        _DIGESTS[key] = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return _DIGESTS[key]


def _install_venv(transport: Transport, python: str, wheel: Path, digest: str, marker: str, workdir: str, wheels_dir):
    """Install this edgeq build into the device's virtualenv (made when missing); its version record.

    One probe of the base interpreter, the venv made if needed, the wheels sent, and pip
    commands that first check every wheel's sha256; the last one writes the marker.
    """
    device = transport.device
    venv = transport.expand(device.venv).rstrip("/")
    build_dir = confine(workdir, f"wheels/{digest[:16]}")  # each build its own, for a rollback
    house = transport.expand(device.wheelhouse).rstrip("/") if device.wheelhouse else confine(workdir, "wheels")
    # one probe: the base interpreter (the venv's platform and Python are its), the folders
    # made, and what the venv's bin and the wheelhouse hold
    prepare = ("--mkdir", build_dir, "--mkdir", house, "--mkdir", confine(workdir, "models"))
    prepare += ("--list", f"{venv}/bin", "--list", house)
    info = probe(transport, device.python, prepare=prepare)
    fresh = "python" not in (info.listed.get(f"{venv}/bin") or {})
    dependencies = [] if device.online else _dependency_wheels(info, VENV_REQUIREMENTS, wheels_dir)
    # With a pip wheel among them, a new venv is made without pip and pip runs from that wheel
    # (installing itself into the venv with the rest): ensurepip's own install of pip and
    # setuptools, byte-compiled, costs more than the whole install of edgeq's dependencies.
    pip_wheel = next((w for w in dependencies if w.name.startswith("pip-")), None) if fresh else None
    if fresh:
        without = ["--without-pip"] if pip_wheel else []
        made = transport.run([device.python, "-m", "venv", *without, venv], timeout=600)
        if not made.ok:
            raise DeviceError(
                f"{device.name}: cannot create a virtualenv with {device.python} ({made.last_error_line()}); "
                "on Raspberry Pi OS: sudo apt-get install python3-venv (deploy/bootstrap-rpi.sh)"
            )
    # no byte-compiling at install: a module is compiled when it is first imported, and
    # most of numpy's and protobuf's modules never are on a device
    options = ["install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    upload_atomically(transport, wheel, build_dir)
    wheel_remote = confine(build_dir, wheel.name)
    index, itself = [], []
    if dependencies:
        _send_dependencies(transport, dependencies, house, info.listed.get(house) or {})
        index = ["--no-index", "--find-links", house]
    if pip_wheel:  # --ignore-installed: pip run from its wheel would take itself for installed
        runner = [python, f"{house}/{pip_wheel.name}/pip", *options, "--ignore-installed"]
        itself = pinned(["pip"])
    else:
        runner = [python, "-m", "pip", *options]
    pip = [*runner, *index]
    # Each pip command first checks the sha256 of every wheel it is given (a wrong one is
    # removed, to be sent again); the last one to run writes the marker when it succeeds.
    checked = [
        f"{wheel_remote}={digest}",
        *[f"{house}/{p.name}={wheel_digest(p)}" for p in dependencies],
    ]

    def install(argv: list[str], last: bool, timeout: float):
        return _checked_run(transport, checked, argv, marker if last else None, digest, timeout)

    # First the dependencies (kept when they already fit), then this exact edgeq build
    # over whatever edgeq of the same version was there.
    result = install([*pip, wheel_remote, *pinned(BASE_REQUIREMENTS), *itself], fresh, 1800)
    if not result.ok and "sha256" not in result.last_error_line():
        # no wheel of the host's versions for this device: the newest that fits
        log.warning("%s: the host's versions do not install (%s)", device.name, result.last_error_line())
        newest = [*BASE_REQUIREMENTS, *(["pip"] if pip_wheel else [])]  # edgeq's wheel requires no runtime
        result = install([*pip, wheel_remote, *newest], fresh, 1800)
    if result.ok and not fresh:  # a new virtualenv had no edgeq that the first install kept
        result = install([*pip, "--force-reinstall", "--no-deps", wheel_remote], True, 900)
    if not result.ok:
        raise DeviceError(f"{device.name}: pip install of {wheel.name} failed: {result.last_error_line()}")
    return _version_record(digest, wheel, wheel=wheel_remote)


def ensure_runtime(
    transport: Transport,
    *,
    wheel: str | Path | None = None,
    wheels_dir: str | Path | None = None,
    state=None,
) -> DeviceRuntime:
    """Make sure the device runs this checkout's edgeq; install it once if it does not.

    The runtime a push replaces is kept (`edgeq push --rollback --runtime` makes it live
    again), and WORKDIR/.edgeq-runtime.json says which is live. Site mode swaps versions
    atomically: WORKDIR/site is a symlink to versions/SHA, renamed over in one step.
    ``state``: the push's first read (edgeq.fleet.state), which holds the marker and the
    runtime record already; without it they are read here.
    """
    device = transport.device
    workdir = transport.expand(device.workdir)
    wheel = Path(wheel) if wheel else build_wheel()
    digest = wheel_digest(wheel)
    runtime, marker = runtime_layout(device, transport.expand)
    python = runtime.python
    if state is not None:
        record, installed = state.runtime, state.marker
    else:
        transport.makedirs(workdir)
        record, installed = read_runtime_state(transport, workdir), _read_marker(transport, marker)
    live = record.get("live") or {}
    if installed == digest:
        return runtime
    if installed and live.get("sha256") != installed:  # installed before runtime versions were recorded
        live = {"sha256": installed, "edgeq": None, "since": None}
        live |= {"dir": "versions/legacy"} if runtime.mode == "site" else {}
    log.info("%s: installing %s (%s mode)", device.name, wheel.name, runtime.mode)
    if runtime.mode == "venv":
        new = _install_venv(transport, python, wheel, digest, marker, workdir, wheels_dir)
    else:
        _install_site(transport, python, wheel, digest, live, wheels_dir, workdir)
        return dataclasses.replace(runtime, installed="installed")
    _write_runtime_state(transport, workdir, {"live": new, "previous": live or None})
    # the wheels of older builds (WORKDIR/wheels/SHA/); the dependency wheels beside them stay
    builds = [Path(w).parent.name for w in (new.get("wheel"), live.get("wheel")) if w]
    _prune_versions(transport, confine(workdir, "wheels"), builds, only=_is_build_folder)
    return dataclasses.replace(runtime, installed="installed")


_SENT: dict[tuple[str, str], set[str]] = {}  # (host, wheelhouse) -> wheels this process put there


def _install_site(transport: Transport, python: str, wheel: Path, digest: str, live: dict, wheels_dir, workdir):
    """A site install in two commands and the uploads between them.

    1. the probe, which first removes a half-unpacked earlier try of this version, makes the
       folders and lists the wheelhouse, then says what the device's Python lacks;
    2. the uploads (SFTP: the edgeq wheel, and the dependency wheels the wheelhouse lacks);
    3. device.py's install-site: every file's sha256 checked, the wheels unpacked into
       versions/SHA, the marker written, WORKDIR/site switched in one rename, the runtime
       record written and the versions neither live nor previous removed.
    """
    device = transport.device
    version_dir = f"versions/{digest[:16]}"
    target = confine(workdir, version_dir)
    own = confine(workdir, "wheels")
    house = transport.expand(device.wheelhouse).rstrip("/") if device.wheelhouse else own
    prepare = ["--remove", target, "--mkdir", own, "--mkdir", confine(workdir, "models"), "--mkdir", house]
    # what the device's Python has without any edgeq site: each version holds all it needs
    info = probe(transport, python, env={"PYTHONPATH": target}, prepare=(*prepare, "--list", house))
    missing, extra = info.missing, []
    if info.runtime == "tflite_runtime":  # the runtime the device has; it ships no .tflite schema
        missing, extra = [*missing, "flatbuffers"], [_schema_for_tflite_runtime()]
    for path in (wheel, *extra):
        upload_atomically(transport, path, own)
    dependencies = _dependency_wheels(info, missing, wheels_dir) if missing else []
    _send_dependencies(transport, dependencies, house, info.listed.get(house) or {})
    files = [f"{own}/{p.name}={wheel_digest(p)}" for p in (wheel, *extra)]
    files += [f"{house}/{p.name}={wheel_digest(p)}" for p in dependencies]
    record = json.dumps({"live": _version_record(digest, wheel, dir=version_dir), "previous": live or None})
    args = ["install-site", workdir, version_dir, _MARKER, digest, f"{RUNTIME_STATE}={record}", *files]
    result = device_python_c(transport, python, args, timeout=900)
    if not result.ok:
        raise DeviceError(f"{device.name}: cannot install edgeq into {target}: {result.last_error_line()}")


def _send_dependencies(transport: Transport, dependencies: list[Path], house: str, there: dict) -> None:
    """Upload the dependency wheels ``house`` lacks (``there``: what the probe listed in it).

    Devices naming one wheelhouse take turns; one that finds a wheel missing that another device
    of this run has put there since its probe lists the folder again instead of sending it twice.
    """
    with _keyed_lock(_WHEELHOUSE_LOCKS, house):
        lacking = [p for p in dependencies if there.get(p.name) != p.stat().st_size]
        sent = _SENT.setdefault((transport.device.host, house), set())
        if any(p.name in sent for p in lacking):
            there = {name: None for name in transport.listdir(house)}
            lacking = [p for p in lacking if p.name not in there]
        for path in lacking:
            upload_atomically(transport, path, house)
            sent.add(path.name)


def rollback_runtime(transport: Transport) -> Rollback:
    """`push --rollback --runtime`: the edgeq runtime a push replaced becomes live again."""
    device = transport.device
    workdir = transport.expand(device.workdir)
    state = read_runtime_state(transport, workdir)
    live, previous = state.get("live") or {}, state.get("previous") or {}
    if not previous.get("sha256"):
        raise DeviceError(
            f"{device.name}: no previous edgeq runtime to roll back to (push keeps one when it installs another)"
        )
    if device.venv:
        python = f"{transport.expand(device.venv).rstrip('/')}/bin/python"
        if not previous.get("wheel"):
            raise DeviceError(f"{device.name}: the previous runtime's wheel is not recorded; push it again instead")
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        result = transport.run([*pip, "--force-reinstall", "--no-deps", previous["wheel"]], timeout=900)
        if not result.ok:
            raise DeviceError(f"{device.name}: cannot reinstall {previous['wheel']}: {result.last_error_line()}")
        _write_marker(transport, f"{transport.expand(device.venv).rstrip('/')}/{_MARKER}", previous["sha256"])
    else:
        _switch_site(transport, device.python, workdir, previous["dir"])
    _write_runtime_state(transport, workdir, {"live": {**previous, "since": _now()}, "previous": live or None})
    return Rollback("edgeq runtime", previous.get("sha256"), live.get("sha256"))


_WHEELHOUSE_LOCKS: dict[str, threading.Lock] = {}


def _switch_site(transport: Transport, python: str, workdir: str, version_dir: str) -> None:
    confine(workdir, version_dir)  # refuses a recorded path that would leave the work directory
    result = device_python_c(transport, python, ["switch", confine(workdir, "site"), version_dir], timeout=120)
    if not result.ok:
        raise DeviceError(f"{transport.device.name}: cannot make {version_dir} live: {result.last_error_line()}")


def _write_runtime_state(transport: Transport, workdir: str, state: dict) -> None:
    write_live(transport, workdir, state, name=RUNTIME_STATE)


def _is_build_folder(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def _prune_versions(transport: Transport, folder: str, keep: list[str | None], only=lambda name: True) -> None:
    """Only the live and the previous runtime stay on the device."""
    kept = {Path(k).name for k in keep if k}
    for name in transport.listdir(folder):
        if name not in kept and only(name):
            transport.run(["rm", "-rf", "--", confine(folder, name)], timeout=300)


def _schema_for_tflite_runtime() -> Path:
    """This host's .tflite flatbuffer schema (ai-edge-litert's generated Python, pure Python on
    ``flatbuffers``) as the module a tflite-runtime device imports: tflite-runtime has none, and
    edgeq reads and bounds-checks every model with it (edgeq.runtime.flatbuffer)."""
    from importlib.util import find_spec

    spec = find_spec("ai_edge_litert.schema_py_generated")
    if spec is None or spec.origin is None:
        raise DeviceError(
            "this host has no ai-edge-litert schema to give a tflite-runtime device: pip install 'edgeq[deploy]'"
        )
    target = Path(tempfile.gettempdir()) / "edgeq-schema" / f"{SCHEMA_MODULE}.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spec.origin, target)
    return target
