"""Files to a device: temporary name, sha256 checked on the device, atomic rename.

A file already on the device with the same sha256 is not sent again. An upload that
is interrupted leaves only a hidden ``.NAME.part-XXXX`` file, never a file under the
final name; the next push removes such leftovers and sends the file again. Transient
failures (a dropped connection) are retried with exponential backoff after reconnecting.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from edgeq.artifacts import sha256_file
from edgeq.errors import DeviceError, TransferError, UnsafePathError
from edgeq.fleet.transport import Transport, confine, retry
from edgeq.runtime.inputs import manifest_beside

log = logging.getLogger(__name__)

DEVICE_SCRIPT = Path(__file__).with_name("device.py")
PART_MARK = ".part-"
PREVIOUS = ".previous"  # WORKDIR/models/.previous/NAME: the version a push replaced (push --rollback)
LIVE = ".edgeq-live.json"  # WORKDIR/models/.edgeq-live.json: which version of each file is live


@dataclass(frozen=True)
class FileTransfer:
    """One file on one device after a push."""

    name: str
    remote_path: str
    sha256: str
    size: int
    status: str  # "uploaded" | "unchanged"
    seconds: float
    attempts: int


def safe_name(name: str) -> str:
    """A file name that may be used as one path component on the device."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or any(ord(c) < 32 for c in name):
        raise UnsafePathError(f"{name!r}: not a plain file name (no '/', '..' or control characters)")
    if name.startswith(".") and PART_MARK in name:
        raise UnsafePathError(f"{name!r}: names like .X.part-Y are reserved for uploads in progress")
    return name


def device_python_c(transport: Transport, python: str, args: list[str], timeout: float = 300):
    """Run device.py's helpers with ``python -c``: they work before edgeq is installed there."""
    return transport.run([python, "-c", DEVICE_SCRIPT.read_text(encoding="utf-8"), *args], timeout=timeout)


def remote_sha256(transport: Transport, python: str, paths: list[str]) -> dict[str, str | None]:
    if not paths:
        return {}
    result = device_python_c(transport, python, ["sha256", *paths])
    if not result.ok:
        raise DeviceError(f"{transport.device.name}: cannot hash files: {result.last_error_line()}")
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DeviceError(f"{transport.device.name}: unexpected answer from sha256: {result.stdout[:200]!r}") from exc


def with_manifests(files: list[str | Path]) -> list[Path]:
    """``files`` with the conversion manifest beside each model, each manifest just before its model.

    A model and its manifest are one unit on a device: the manifest says how raw data is
    normalised for the model, so a new model beside an old manifest would be fed wrong inputs.
    The manifest goes first, so that a model renamed into place finds its manifest there.
    """
    out: list[Path] = []
    for file in map(Path, files):
        manifest = manifest_beside(file)
        if file.suffix == ".tflite" and manifest.is_file() and manifest not in out:
            out.append(manifest)
        if file not in out:
            out.append(file)
    return out


def manifest_name(name: str) -> str | None:
    """The manifest file name that goes with model ``name`` (None for other files)."""
    return manifest_beside(name).name if name.endswith(".tflite") else None


def push_files(
    transport: Transport,
    files: list[str | Path],
    *,
    python: str,
    subdir: str = "models",
    attempts: int = 3,
    backoff_s: float = 0.5,
    folder: str | None = None,
) -> list[FileTransfer]:
    """Upload ``files`` to ``WORKDIR/subdir/NAME`` on the device; return one record per file.

    ``folder`` (an expanded absolute path, the inventory's ``wheelhouse``) replaces
    ``WORKDIR/subdir``; no live record is kept there (what is live is not a wheel's business).
    """
    record_live = folder is None
    folder = folder or confine(transport.expand(transport.device.workdir), subdir)
    local, targets = _push_targets(files, folder)

    def reconnect() -> None:
        if hasattr(transport, "connect"):
            transport.close()
            transport.connect()

    retry(lambda: transport.makedirs(folder), attempts=attempts, backoff_s=backoff_s, what="mkdir", on_retry=reconnect)
    hashes = {str(p): sha256_file(p) for p in local}
    there = retry(
        lambda: remote_sha256(transport, python, targets),
        attempts=attempts,
        backoff_s=backoff_s,
        what="remote sha256",
        on_retry=reconnect,
    )
    existing = retry(lambda: transport.listdir(folder), attempts=attempts, backoff_s=backoff_s, what="listdir")
    records = []
    for path, target in zip(local, targets):
        digest = hashes[str(path)]
        records.append(
            _push_one(transport, path, target, digest, there, existing, folder, python, attempts, backoff_s, reconnect)
        )
    if not record_live:
        return records
    _record_pushed(transport, folder, records, there)
    return records


def _push_targets(files: list[str | Path], folder: str) -> tuple[list[Path], list[str]]:
    """The local files and their paths on the device, checked before anything is sent: all exist, names are unique."""
    local = [Path(f) for f in files]
    for path in local:
        if not path.is_file():
            raise TransferError(f"{path}: no such file to push")
    targets = [confine(folder, safe_name(p.name)) for p in local]
    names = [p.name for p in local]
    if len(set(names)) != len(names):
        raise UnsafePathError(f"two files with the same name would overwrite each other on the device: {names}")
    return local, targets


def _push_one(
    transport: Transport,
    path: Path,
    target: str,
    digest: str,
    there: dict[str, str | None],
    existing: list[str],
    folder: str,
    python: str,
    attempts: int,
    backoff_s: float,
    reconnect: Callable[[], None],
) -> FileTransfer:
    """Send one file unless the device has it already: leftovers removed, sha256 checked, then renamed."""
    size = path.stat().st_size
    start = time.monotonic()
    for leftover in [n for n in existing if n.startswith(f".{path.name}{PART_MARK}")]:
        log.info("%s: removing an interrupted upload %s", transport.device.name, leftover)
        transport.remove(confine(folder, leftover))
    if there.get(target) == digest:
        return FileTransfer(path.name, target, digest, size, "unchanged", 0.0, 0)
    tries = {"n": 0}

    def upload_once(path=path, target=target, digest=digest, tries=tries) -> None:
        tries["n"] += 1
        part = confine(folder, f".{path.name}{PART_MARK}{uuid.uuid4().hex[:12]}")
        try:
            transport.upload(path, part)
            # The target's state is read again on every attempt: an attempt whose rename
            # happened but whose reply was lost has made the new file live already, and
            # linking that into .previous/ would make --rollback "restore" the new model.
            hashes_now = remote_sha256(transport, python, [part, target])
            got = hashes_now.get(part)
            if got != digest:
                raise TransferError(
                    f"{transport.device.name}: {path.name}: sha256 on the device {got} != {digest}; not renamed"
                )
            live_now = hashes_now.get(target)
            if live_now == digest:  # an earlier attempt's rename went through
                transport.remove(part)
                return
            if live_now is not None:  # keep the version being replaced, for --rollback
                keep_previous(transport, folder, target)
            transport.rename(part, target)
        except BaseException:
            with contextlib.suppress(Exception):  # the connection may be gone; the next push cleans up
                transport.remove(part)
            raise

    retry(upload_once, attempts=attempts, backoff_s=backoff_s, what=f"upload {path.name}", on_retry=reconnect)
    log.info("%s: %s uploaded (%d bytes)", transport.device.name, path.name, size)
    return FileTransfer(path.name, target, digest, size, "uploaded", time.monotonic() - start, tries["n"])


def _record_pushed(
    transport: Transport, folder: str, records: list[FileTransfer], there: dict[str, str | None]
) -> None:
    """Update .edgeq-live.json for what the push made live, so that --rollback knows each file's previous version."""
    live = read_live(transport, folder)
    changed = False
    for record in records:
        if record.status == "uploaded":
            old = there.get(record.remote_path)
            live[record.name] = {"sha256": record.sha256, "previous_sha256": old, "since": _now()}
            changed = True
        elif (live.get(record.name) or {}).get("sha256") != record.sha256:
            live[record.name] = {"sha256": record.sha256, "previous_sha256": None, "since": _now()}
            changed = True
    if changed:  # a push of unchanged files writes nothing on the device
        write_live(transport, folder, live)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def keep_previous(transport: Transport, folder: str, target: str) -> None:
    """A hard link to the live version in .previous/, made before the new version replaces it."""
    previous = confine(folder, PREVIOUS)
    transport.makedirs(previous)
    result = transport.run(["ln", "-f", "--", target, confine(previous, Path(target).name)], timeout=60)
    if not result.ok:
        raise DeviceError(f"{transport.device.name}: cannot keep the previous {target}: {result.last_error_line()}")


def read_live(transport: Transport, folder: str, name: str = LIVE) -> dict:
    """The device's record of which version of each file (or ``name``'s subject) is live ({} when none)."""
    result = transport.run(["cat", "--", confine(folder, name)], timeout=60)
    try:
        data = json.loads(result.stdout) if result.ok else {}
    except ValueError:
        data = {}
    return data if isinstance(data, dict) else {}


def upload_atomically(transport: Transport, local: Path, folder: str, name: str | None = None) -> None:
    """SFTP ``local`` into ``folder`` (as ``name``) under a part name, then rename it: a reader
    finds the old file or the whole new one, and no command runs on the device."""
    name = name or local.name
    hidden = name if name.startswith(".") else f".{name}"
    part = confine(folder, f"{hidden}{PART_MARK}{uuid.uuid4().hex[:12]}")
    transport.upload(local, part)
    transport.rename(part, confine(folder, name))


def write_live(transport: Transport, folder: str, live: dict, name: str = LIVE) -> None:
    """Write .edgeq-live.json (or ``name``) on the device atomically (temporary name, then rename)."""
    with tempfile.TemporaryDirectory(prefix="edgeq-live-") as tmp:
        local = Path(tmp) / name
        local.write_text(json.dumps(live, indent=2, sort_keys=True), encoding="utf-8")
        upload_atomically(transport, local, folder)


@dataclass(frozen=True)
class Rollback:
    name: str
    live_sha256: str | None  # what is live now (the version that was previous)
    previous_sha256: str | None  # what was live before the rollback (now kept as previous)


def rollback_files(transport: Transport, names: list[str], subdir: str = "models") -> list[Rollback]:
    """Make the previous version of each file live again; the replaced one becomes the previous.

    NAME never disappears: the live version is hard-linked aside, then the previous one is
    renamed over NAME (atomic), then the aside link becomes the new previous. A model's
    manifest rolls back with it; a live manifest with no previous version (the model before
    had none) is moved into .previous/, so the restored model is not read with the newer one's.
    """
    folder = confine(transport.expand(transport.device.workdir), subdir)
    previous = confine(folder, PREVIOUS)
    kept = set(transport.listdir(previous))
    missing = [n for n in names if safe_name(n) not in kept]
    if missing:
        raise DeviceError(
            f"{transport.device.name}: no previous version of {', '.join(missing)} to roll back to "
            f"(push keeps one when it replaces a file)"
        )
    present = set(transport.listdir(folder))
    swap, retire = [], []
    for name in names:
        manifest = manifest_name(name)
        if manifest and manifest not in names:
            if manifest in kept:
                swap.append(manifest)
            elif manifest in present:
                retire.append(manifest)
        swap.append(name)
    live = read_live(transport, folder)
    done = []
    for name in swap:
        target, old = confine(folder, name), confine(previous, name)
        aside = confine(previous, f".{name}{PART_MARK}{uuid.uuid4().hex[:12]}")
        result = transport.run(["ln", "-f", "--", target, aside], timeout=60)
        if not result.ok:
            raise DeviceError(f"{transport.device.name}: cannot roll back {name}: {result.last_error_line()}")
        transport.rename(old, target)
        transport.rename(aside, old)
        entry = live.get(name) or {}
        live[name] = {"sha256": entry.get("previous_sha256"), "previous_sha256": entry.get("sha256"), "since": _now()}
        if name in names:
            done.append(Rollback(name, live[name]["sha256"], live[name]["previous_sha256"]))
    for name in retire:
        transport.rename(confine(folder, name), confine(previous, name))
        entry = live.get(name) or {}
        live[name] = {"sha256": None, "previous_sha256": entry.get("sha256"), "since": _now()}
    write_live(transport, folder, live)
    return done


# Verify, keep, swap and record in one command: each upload's part file is checked by sha256,
# the version it replaces is hard-linked into .previous/, the part is renamed over the target,
# and the live record is written (temporary name, then rename). A part whose sha256 is wrong is
# removed and the script stops with 3, before anything of it is live.
_COMMIT = r"""
folder=$1; live=$2; shift 2
while [ $# -ge 3 ]; do
  part=$1; name=$2; digest=$3; shift 3
  got=$(sha256sum -- "$folder/$part" 2>/dev/null | cut -d' ' -f1)
  if [ "$got" != "$digest" ]; then rm -f -- "$folder/$part"; printf 'bad %s %s\n' "$name" "$got"; exit 3; fi
  if [ -e "$folder/$name" ]; then
    mkdir -p -- "$folder/$PREVIOUS" && ln -f -- "$folder/$name" "$folder/$PREVIOUS/$name" || exit 4
  fi
  mv -f -- "$folder/$part" "$folder/$name" || exit 5
  printf 'live %s\n' "$name"
done
printf '%s\n' "$live" > "$folder/$LIVE.tmp" && mv -f -- "$folder/$LIVE.tmp" "$folder/$LIVE"
"""


def upload_and_commit(
    transport: Transport, files: list[Path], there: dict[str, str | None], live: dict, folder_exists: bool = True
) -> list[FileTransfer]:
    """Upload the files whose sha256 on the device (``there``, by name) differs, then make them
    live and record them in one command (_COMMIT). The caller read ``there`` and ``live`` in its
    state command, and whether WORKDIR/models exists (it is made only when not). Nothing changed:
    no command at all. Any failure raises; the caller then falls back to push_files, which cleans
    up and retries file by file."""
    folder = confine(transport.expand(transport.device.workdir), "models")
    if not folder_exists:
        transport.makedirs(folder)
    records, triples, changed = [], [], False
    for path in files:
        name = safe_name(path.name)
        digest, size = sha256_file(path), path.stat().st_size
        target = confine(folder, name)
        if there.get(name) == digest:
            records.append(FileTransfer(path.name, target, digest, size, "unchanged", 0.0, 0))
            if (live.get(path.name) or {}).get("sha256") != digest:
                live[path.name] = {"sha256": digest, "previous_sha256": None, "since": _now()}
                changed = True
            continue
        start = time.monotonic()
        part = f".{path.name}{PART_MARK}{uuid.uuid4().hex[:12]}"
        transport.upload(path, confine(folder, part))
        triples += [part, name, digest]
        changed = True
        live[path.name] = {"sha256": digest, "previous_sha256": there.get(name), "since": _now()}
        records.append(FileTransfer(path.name, target, digest, size, "uploaded", time.monotonic() - start, 1))
    if not changed:
        return records
    record = json.dumps(live, indent=2, sort_keys=True)
    result = transport.run(
        ["env", f"PREVIOUS={PREVIOUS}", f"LIVE={LIVE}", "sh", "-c", _COMMIT, "edgeq-commit", folder, record, *triples],
        timeout=120,
    )
    if not result.ok:
        raise TransferError(f"{transport.device.name}: the upload did not commit: {result.last_error_line()}")
    return records
