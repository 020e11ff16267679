"""Get edgeq onto a device once: probe it, then install the base runtime.

Two ways, chosen by the inventory:

* ``venv = PATH``: a virtualenv on the device with the base ``edgeq`` install. The wheel
  built from this checkout is pushed; the wheels it needs come from PyPI when the device
  is ``online``, else they are downloaded here for the device's platform and pushed too.
* no ``venv``: nothing is installed with pip. The wheels are unpacked into
  ``WORKDIR/versions/SHA`` and edgeq runs as ``PYTHONPATH=WORKDIR/site python -m edgeq``,
  ``site`` being a symlink to the live version. This is for devices without pip or
  internet (and for the emulated Raspberry Pi 4 in the tests).

Both are skipped when the device already has this exact wheel (a marker holds its sha256).
Both keep the runtime they replace, for ``edgeq push --rollback --runtime``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import edgeq
from edgeq.artifacts import atomic_path, folder_lock
from edgeq.errors import DeviceError
from edgeq.fleet.push import Rollback, _now, device_python_c, read_live, upload_atomically, write_live
from edgeq.fleet.transport import Transport, confine

log = logging.getLogger(__name__)

PROBE_SCRIPT = Path(__file__).with_name("_probe.py")
BASE_REQUIREMENTS = ("numpy", "click", "ai-edge-litert")
VENV_REQUIREMENTS = (*BASE_REQUIREMENTS, "pip")  # offline venvs: pip's wheel too (see ensure_runtime)
WHEEL_CACHE = Path(os.environ.get("EDGEQ_WHEEL_CACHE", "~/.cache/edgeq/wheels")).expanduser()
_MARKER = ".edgeq-wheel.sha256"
RUNTIME_STATE = ".edgeq-runtime.json"  # WORKDIR/.edgeq-runtime.json: live and previous edgeq runtime
SCHEMA_MODULE = "edgeq_tflite_schema"  # edgeq.runtime.flatbuffer imports it when LiteRT's is absent


@dataclass(frozen=True)
class Probe:
    """What ``edgeq devices check`` reports about a device."""

    machine: str
    system: str
    os: str
    python: str
    python_tag: str
    executable: str
    glibc: str
    numpy: str | None
    click: str | None
    runtime: str | None
    runtime_version: str | None
    edgeq: str | None
    free_bytes: int | None
    edgetpu_library: str | None
    edgetpu_devices: tuple[str, ...]
    pip: bool
    venv: bool
    listed: dict = field(default_factory=dict)  # {folder: {file name: size}} of the folders it was asked to list

    @property
    def edgetpu(self) -> str:
        if self.edgetpu_devices and self.edgetpu_library:
            return "yes"
        if self.edgetpu_devices:
            return "device, no libedgetpu"
        if self.edgetpu_library:
            return "libedgetpu, no device"
        return "no"

    def drift(self, host: dict[str, str | None]) -> list[str]:
        """Where the device's edgeq, numpy and LiteRT differ from ``host`` (host_versions())."""
        found = []
        for name, mine in (("edgeq", self.edgeq), ("numpy", self.numpy)):
            if mine != host.get(name):
                found.append(f"{name} {mine or 'none'} (host {host.get(name) or 'none'})")
        runtime = f"{self.runtime} {self.runtime_version}" if self.runtime else "none"
        if runtime != host.get("runtime"):
            found.append(f"runtime {runtime} (host {host.get('runtime') or 'none'})")
        return found

    @property
    def missing(self) -> list[str]:
        return [
            name
            for name, have in (("numpy", self.numpy), ("click", self.click), ("ai-edge-litert", self.runtime))
            if not have
        ]


@dataclass(frozen=True)
class DeviceRuntime:
    """How to run edgeq on a device after the bootstrap."""

    python: str
    env: dict[str, str] = field(default_factory=dict)
    mode: str = "site"  # "site" | "venv"
    installed: str = "unchanged"  # "installed" | "unchanged"
    workdir: str = ""

    def argv(self, *args: str) -> list[str]:
        return [self.python, "-m", "edgeq", *args]


def host_versions() -> dict[str, str | None]:
    """This host's edgeq, numpy and LiteRT, as a device should have them (devices check compares)."""
    from importlib.metadata import PackageNotFoundError, version

    def dist(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    litert = dist("ai-edge-litert")
    runtime = f"ai_edge_litert {litert}" if litert else None
    return {"edgeq": edgeq.__version__, "numpy": dist("numpy"), "runtime": runtime}


def pinned(requirements) -> list[str]:
    """``requirements`` at this host's versions where it has them (numpy==2.4.6, ...): a device
    then runs what the host verified against."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in requirements:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def probe(
    transport: Transport, python: str | None = None, env: dict[str, str] | None = None, prepare: tuple = ()
) -> Probe:
    """Run the stand-alone probe with the device's python and parse its JSON. ``prepare``:
    the probe's --remove/--mkdir/--list arguments, done in the same start-up."""
    device = transport.device
    python = python or device.python
    source = PROBE_SCRIPT.read_text(encoding="utf-8")
    result = transport.run([python, "-c", source, device.workdir, *prepare], env=env, timeout=120)
    if not result.ok:
        raise DeviceError(f"{device.name}: {python} does not run: {result.last_error_line()}")
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DeviceError(f"{device.name}: the probe printed no JSON: {result.stdout[:200]!r}") from exc
    tpu = data.pop("edgetpu", {}) or {}
    return Probe(edgetpu_library=tpu.get("library"), edgetpu_devices=tuple(tpu.get("devices") or ()), **data)


def _source_root() -> Path:
    root = Path(edgeq.__file__).resolve().parents[1]
    if not (root / "setup.py").is_file():
        raise DeviceError(
            f"edgeq runs from {root}, not from a checkout with setup.py: build a wheel "
            "(pip wheel --no-deps .) and pass it with --wheel PATH"
        )
    return root


def _source_hash(root: Path) -> str:
    digest = hashlib.sha256()
    names = ["setup.py", "pyproject.toml", "README.md"]
    files = [root / n for n in names if (root / n).is_file()]
    for folder in ("edgeq",):
        files += sorted(
            p for p in (root / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


_BUILD_LOCK = threading.Lock()


def build_wheel(root: Path | None = None) -> Path:
    """The edgeq wheel of this checkout, built once per source state and cached.

    Devices bootstrap in parallel threads: one builds, the others wait for it; the cached
    file appears atomically, so no reader ever sees half a wheel.
    """
    root = root or _source_root()
    with _BUILD_LOCK, folder_lock(WHEEL_CACHE / ".build"):  # and another process building it
        return _build_wheel(root)


KEEP_SOURCE_BUILDS = 4  # edgeq-src-* folders kept in the wheel cache, most recently used first


def _build_wheel(root: Path) -> Path:
    out = WHEEL_CACHE / f"edgeq-src-{_source_hash(root)}"
    found = sorted(out.glob("edgeq-*.whl"))
    if found:
        os.utime(out)  # used now: the pruning below keeps the most recently used builds
        return found[0]
    with tempfile.TemporaryDirectory(prefix="edgeq-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("setup.py", "pyproject.toml", "README.md"):
            if (root / name).is_file():
                shutil.copy2(root / name, src / name)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for name in ("edgeq",):
            if (root / name).is_dir():
                shutil.copytree(root / name, src / name, ignore=ignore)
        dist = Path(tmp) / "dist"
        base = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist)]
        proc = subprocess.run([*base, "--no-build-isolation", str(src)], capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0:  # no setuptools/wheel here: let pip fetch a build backend
            proc = subprocess.run([*base, str(src)], capture_output=True, text=True, cwd=tmp)
        wheels = sorted(dist.glob("edgeq-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise DeviceError(f"cannot build the edgeq wheel from {root}: {(proc.stderr or proc.stdout)[-400:]}")
        final = out / wheels[0].name
        with atomic_path(final) as part:
            shutil.copy2(wheels[0], part)
    log.info("built %s", final)
    _prune_source_builds(out)
    return final


def _prune_source_builds(current: Path) -> None:
    """One wheel per source state would pile up with every edit of a checkout: only the
    KEEP_SOURCE_BUILDS most recently used stay (the one just built among them)."""
    builds = [p for p in WHEEL_CACHE.glob("edgeq-src-*") if p.is_dir() and p != current]
    builds.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[KEEP_SOURCE_BUILDS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def _platform_tags(info: Probe) -> list[str]:
    arch = info.machine
    tags = []
    glibc = info.glibc.split("-")[-1] if info.glibc.startswith("glibc") else ""
    try:
        major, minor = (int(p) for p in glibc.split(".")[:2])
    except ValueError:
        major, minor = 2, 17
    for m in range(17, minor + 1) if major == 2 else [17]:
        tags.append(f"manylinux_2_{m}_{arch}")
    tags.append(f"manylinux2014_{arch}")
    return tags


_COMPLETE = ".complete"  # in a wheel cache folder: the wheels one pip download left there
_DOWNLOAD_LOCKS: dict[str, threading.Lock] = {}


def _keyed_lock(locks: dict[str, threading.Lock], key: str) -> threading.Lock:
    """The one lock of ``key`` in ``locks``, made on first use (device threads share it)."""
    with _BUILD_LOCK:
        return locks.setdefault(key, threading.Lock())


def download_wheels(info: Probe, requirements: list[str], dest: Path) -> list[Path]:
    """Wheels of ``requirements`` for the device's platform and Python, fetched here once.

    A folder a download completed is reused without running pip again (one pip per
    platform and version set, not one per device of a fleet); devices in parallel threads
    wait for the one that downloads.
    """
    with _keyed_lock(_DOWNLOAD_LOCKS, str(dest)), folder_lock(dest):
        done = dest / _COMPLETE
        if done.is_file():
            found = [dest / name for name in done.read_text(encoding="utf-8").split()]
            if found and all(p.is_file() for p in found):
                return found
        wheels = _download_wheels(info, requirements, dest)
        with atomic_path(done) as part:
            part.write_text("\n".join(p.name for p in wheels) + "\n", encoding="utf-8")
        return wheels


def _download_wheels(info: Probe, requirements: list[str], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(dest)]
    args += ["--python-version", info.python_tag, "--implementation", "cp"]
    for tag in _platform_tags(info):
        args += ["--platform", tag]
    proc = subprocess.run([*args, *requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DeviceError(
            f"cannot download wheels of {', '.join(requirements)} for {info.machine} / Python {info.python_tag}: "
            f"{(proc.stderr or proc.stdout).strip()[-300:]}"
        )
    return sorted(dest.glob("*.whl"))


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


def _dependency_wheels(info: Probe, requirements, wheels_dir: str | Path | None) -> list[Path]:
    """Wheels for a device without internet: from --wheels DIR, else downloaded here."""
    if wheels_dir:
        found = sorted(Path(wheels_dir).glob("*.whl"))
        if not found:
            raise DeviceError(f"{wheels_dir}: no .whl files in it")
        return found
    tag = f"{info.machine}-cp{info.python_tag.replace('.', '')}"
    pins = pinned(requirements)
    key = hashlib.sha256(" ".join(sorted(pins)).encode()).hexdigest()[:10]
    try:  # the host's versions, each set in its own cache folder so that only those are pushed
        return download_wheels(info, pins, WHEEL_CACHE / f"deps-{tag}-{key}")
    except DeviceError as exc:  # e.g. an older Python with no wheel of the host's numpy
        log.warning("%s; taking the newest versions that fit (devices check shows the drift)", exc)
        return download_wheels(info, list(requirements), WHEEL_CACHE / f"deps-{tag}")
