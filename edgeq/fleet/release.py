"""Pull-based rollout for fleets past one host's SSH fan-out (deploy/FLEET.md).

The host writes a *release*: the files, and ``release.json`` naming each with its sha256
and size, signed with an SSH key by OpenSSH's own file signing (``ssh-keygen -Y sign``).
Any static HTTP server or object store serves the folder; nothing of edgeq runs there.
Each device runs ``edgeq pull URL`` from its own scheduler (a systemd timer, cron): it
fetches ``release.json``, checks the signature against its ``allowed_signers`` file
(``ssh-keygen -Y verify``), downloads only the files whose sha256 differs from what is
live, checks each by sha256, and applies them the way ``edgeq push`` does, in the same
folder layout: the replaced version hard-linked into ``.previous/`` (so ``edgeq push
--rollback`` and a later pull of the older release both work), the new one renamed into
place, and ``.edgeq-live.json`` written last. A pull that finds everything live fetches
one small file; a file that fails its check leaves every live file as it was.

The store chooses what it serves, so a signature alone does not stop it from serving an older
genuine release (a rollback attack) or the same one forever (a freeze attack; TUF's terms).
Every release carries a *number* that only grows and an *expiry*: a device records the number
it applied (``.edgeq-release.json``, written after the files are live) and refuses an older
number, or its own number with other files; it refuses metadata past its expiry and keeps
running what it has. Going back is a new release with a higher number that carries the old
files (``edgeq release --rollback-to``); a refreshed expiry is the same release re-signed
(``edgeq release --resign``).

Device side: the standard library and ``ssh-keygen`` only (no TensorFlow, no paramiko).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from edgeq.artifacts import sha256_file, write_json_atomic
from edgeq.errors import ReleaseRefused, TransferError, UsageError

RELEASE = "release.json"
SIGNATURE = "release.json.sig"
NAMESPACE = "edgeq-release"  # ssh-keygen -Y's namespace: a signature for anything else does not verify here
SIGNER = "edgeq-release"  # the principal devices' allowed_signers names the release key with
LIVE = ".edgeq-live.json"  # as edgeq.fleet.push writes it
APPLIED = ".edgeq-release.json"  # the release a device applied last: its number, version and files
ARCHIVE = ".releases"  # in the store: each release's files under its number, for --rollback-to
DEFAULT_EXPIRY = "30d"  # a daily timer lives with it; re-sign (edgeq release --resign) before it runs out
PREVIOUS = ".previous"
PART = ".part-"
# What a store or a network in the middle can make a device read (TUF's endless-data and slow-retrieval
# attacks): release.json and its signatures at most METADATA_LIMIT bytes (a release of 1,000 files is about
# 150 KiB), a model file exactly its signed size; each download done within --timeout plus its size at
# --min-rate, whatever the server drips.
METADATA_LIMIT = 512 * 1024
MIN_RATE = 16 * 1024  # bytes/s: 128 kbit/s, a poor mobile link
CHUNK = 64 * 1024


def parse_duration(text: str) -> int:
    """ "30d", "12h", "90m" -> seconds (at least a minute, at most two years)."""
    units = {"d": 86400, "h": 3600, "m": 60}
    raw = str(text).strip().lower()
    try:
        seconds = int(raw[:-1]) * units[raw[-1]]
    except (ValueError, KeyError, IndexError):
        raise UsageError(f"--expires {text!r}: give a duration such as 30d, 12h or 90m") from None
    if not 60 <= seconds <= 2 * 365 * 86400:
        raise UsageError(f"--expires {text!r}: between a minute and two years")
    return seconds


def _store_release(out: Path) -> dict | None:
    try:
        record = json.loads((out / RELEASE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def make_release(
    files: list[str | Path], out: str | Path, version: str, key: str | Path | list | None = None,
    number: int | None = None, expires: str = DEFAULT_EXPIRY,
) -> Path:  # fmt: skip
    """Write a release of ``files`` into ``out`` (each file, then release.json, then its signature).

    ``key``: the SSH key (or keys) that sign it. ``number``: the release's place in the store's order,
    higher than every release before it (default: the store's last number plus one). ``expires``:
    how long devices accept it.

    Returns:
        The path of release.json.

    Raises:
        UsageError: a missing file, two files of one name, a number not above the store's, or a
            key ssh-keygen cannot sign with.
    """
    out = Path(out)
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise UsageError(f"{', '.join(missing)}: no such file to release")
    names = [p.name for p in paths]
    if len(set(names)) != len(names) or any(n in (RELEASE, SIGNATURE) or n.startswith(".") for n in names):
        raise UsageError(f"release file names must be unique, not hidden and not {RELEASE}: {names}")
    last = _number(_store_release(out)) or 0
    number = last + 1 if number is None else int(number)
    if number <= last:
        raise UsageError(
            f"{out}: release number {number} is not above the store's last, {last}; devices would refuse it"
        )
    lifetime = parse_duration(expires)
    out.mkdir(parents=True, exist_ok=True)
    archive = out / ARCHIVE / str(number)
    archive.mkdir(parents=True, exist_ok=True)
    entries = {}
    for path in paths:
        for folder in (archive, out):  # the archive first: the live URL only ever names archived files
            shutil.copyfile(path, folder / f".{path.name}.tmp")
            os.replace(folder / f".{path.name}.tmp", folder / path.name)
        entries[path.name] = {"sha256": sha256_file(out / path.name), "size": path.stat().st_size}
    record = {"kind": "edgeq.release", "version": version, "number": number, "files": entries}
    return _write_signed(out, record, key, lifetime, archive)


def resign_release(out: str | Path, key: str | Path | None, expires: str = DEFAULT_EXPIRY) -> Path:
    """The store's current release, the same number and files, with a new expiry (and signature)."""
    out = Path(out)
    record = _store_release(out)
    if record is None or _number(record) is None:
        raise UsageError(f"{out}: no numbered release to re-sign (edgeq release FILES --out {out} makes one)")
    for name, entry in record.get("files", {}).items():
        if not (out / name).is_file() or sha256_file(out / name) != entry.get("sha256"):
            raise UsageError(f"{out / name}: not the file release {record['number']} names; make a new release")
    return _write_signed(out, record, key, parse_duration(expires), out / ARCHIVE / str(record["number"]))


def rollback_release(out: str | Path, to_version: str, key: str | Path | None, expires: str = DEFAULT_EXPIRY) -> Path:
    """A new release, numbered above the store's last, carrying the files of the earlier release
    named ``to_version``: going back stays signed and forward, so devices accept it."""
    out = Path(out)
    found = []
    for folder in (out / ARCHIVE).glob("*"):
        record = _store_release(folder)
        if record is not None and str(record.get("version")) == to_version:
            found.append((int(folder.name) if folder.name.isdigit() else 0, folder, record))
    if not found:
        known = sorted({str((_store_release(f) or {}).get("version")) for f in (out / ARCHIVE).glob("*")} - {"None"})
        raise UsageError(f"{out}: no archived release named {to_version!r} (archived: {', '.join(known) or 'none'})")
    _, folder, record = max(found, key=lambda f: f[0])
    files = [folder / name for name in record.get("files", {})]
    return make_release(files, out, f"{record['version']} (rollback)", key, expires=expires)


def _write_signed(out: Path, record: dict, keys, lifetime: int, archive: Path) -> Path:
    now = time.time()
    record = {**record, "created": _stamp(now), "expires": _stamp(now + lifetime)}
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    if len(text.encode()) > METADATA_LIMIT:  # a device would refuse it as endless data
        raise UsageError(
            f"{out / RELEASE} would be {len(text.encode())} bytes, over the {METADATA_LIMIT // 1024} KiB a device "
            "reads (edgeq.fleet.release.METADATA_LIMIT): split the files into several releases"
        )
    tmp = out / f".{RELEASE}.tmp"
    tmp.write_text(text, encoding="utf-8")
    keys = [keys] if isinstance(keys, (str, Path)) else list(keys or [])
    try:
        signatures = [_sign(tmp, key) for key in keys]
    except UsageError:
        tmp.unlink()
        raise
    if signatures:
        part = out / f".{SIGNATURE}.tmp"
        part.write_bytes(b"".join(signatures))
        os.replace(part, out / SIGNATURE)
    elif (out / SIGNATURE).exists():
        (out / SIGNATURE).unlink()  # an older release's signature would not match this one
    (archive / RELEASE).write_text(text, encoding="utf-8")
    os.replace(tmp, out / RELEASE)
    return out / RELEASE


def _sign(path: Path, key) -> bytes:
    """ssh-keygen's armored signature of ``path`` by ``key`` (namespace edgeq-release)."""
    with tempfile.TemporaryDirectory(prefix="edgeq-sign-") as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        signed = subprocess.run(
            ["ssh-keygen", "-q", "-Y", "sign", "-f", str(key), "-n", NAMESPACE, str(copy)],
            capture_output=True,
            text=True,
        )
        if signed.returncode != 0:
            raise UsageError(f"{key}: ssh-keygen cannot sign with it ({signed.stderr.strip().splitlines()[-1:]})")
        return copy.with_name(copy.name + ".sig").read_bytes()


def cosign(out: str | Path, key: str | Path) -> int:
    """Add ``key``'s signature to the store's current release.json (a second signer of a k-of-n
    release signs what the first wrote, from their own machine); returns how many it now has."""
    out = Path(out)
    if _store_release(out) is None:
        raise UsageError(f"{out}: no release to sign (edgeq release FILES --out {out} makes one)")
    signature = _sign(out / RELEASE, key)
    existing = (out / SIGNATURE).read_bytes() if (out / SIGNATURE).is_file() else b""
    part = out / f".{SIGNATURE}.tmp"
    part.write_bytes(existing + signature)
    os.replace(part, out / SIGNATURE)
    return len(_signature_blocks(existing + signature))


def _number(record: dict | None) -> int | None:
    value = (record or {}).get("number")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _seconds(stamp) -> float | None:
    import calendar

    try:
        return float(calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


@dataclass(frozen=True)
class PullResult:
    version: str
    number: int  # the release's place in the store's order (never lower than the last one applied)
    updated: tuple[str, ...]  # files made live by this pull
    unchanged: tuple[str, ...]
    fetched: int  # HTTP requests made (release.json, its signature, each changed file)


def _now() -> str:
    return _stamp(time.time())


@dataclass(frozen=True)
class Limits:
    """How much a pull reads, and how slowly it lets a server send it (see METADATA_LIMIT)."""

    timeout: float = 60.0  # seconds per socket operation
    min_rate: float = MIN_RATE  # bytes/s over a whole download
    metadata: int = METADATA_LIMIT  # bytes of release.json or its signatures

    def deadline(self, size: int) -> float:
        """Seconds a download of ``size`` bytes may take in all."""
        return self.timeout + size / self.min_rate


def _fetch(url: str, limits: Limits) -> bytes:
    """A metadata file (release.json, its signatures): at most ``limits.metadata`` bytes, in memory."""
    sink = io.BytesIO()
    _download(url, sink, limits.metadata, limits, exact=False)
    return sink.getvalue()


def _download(url: str, sink, size: int, limits: Limits, exact: bool) -> str:
    """Stream ``url`` into ``sink`` in chunks: at most ``size`` bytes (``exact``: exactly that many), within
    ``limits.deadline(size)`` seconds in all; returns its sha256. A bound crossed is a one-line TransferError."""
    what = "its signed size" if exact else "the metadata limit (edgeq.fleet.release.METADATA_LIMIT)"
    deadline = time.monotonic() + limits.deadline(size)
    digest, got = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=limits.timeout) as response:  # noqa: S310 - the user's release URL
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.strip().isdigit() and int(declared) > size:
                raise TransferError(f"{url}: the server announces {int(declared)} bytes, over {what} ({size}); "
                                    "nothing applied")  # fmt: skip
            read = getattr(response, "read1", response.read)  # one socket read at a time, so a drip is seen
            while True:
                chunk = read(min(CHUNK, size - got + 1))
                if not chunk:
                    break
                got += len(chunk)
                if got > size:
                    raise TransferError(f"{url}: more than {what} ({size} bytes): refused, nothing applied")
                digest.update(chunk)
                sink.write(chunk)
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"{url}: {got} bytes in {limits.deadline(size):.0f} s, below the minimum rate "
                        f"({limits.min_rate / 1024:g} KiB/s, --min-rate): dropped as a slow retrieval, nothing applied"
                    )
    except OSError as exc:  # URLError, HTTPError, timeouts
        raise TransferError(f"{url}: cannot fetch it ({exc})") from exc
    if exact and got != size:
        raise TransferError(f"{url}: {got} bytes, not its signed size {size}: refused, nothing applied")
    return digest.hexdigest()


_BLOCK = re.compile(rb"-----BEGIN SSH SIGNATURE-----.*?-----END SSH SIGNATURE-----\n?", re.S)
_SIGNED_BY = re.compile(r"with \S+ key (SHA256:\S+)")


def _signature_blocks(data: bytes) -> list[bytes]:
    return _BLOCK.findall(data)


def _verify(release: bytes, signatures: bytes, allowed_signers: Path, threshold: int = 1) -> int:
    """How many distinct keys of ``allowed_signers`` signed ``release``; TransferError below ``threshold``."""
    keys: set[str] = set()
    reasons: list[str] = []
    blocks = _signature_blocks(signatures) or [signatures]
    with tempfile.TemporaryDirectory(prefix="edgeq-pull-") as tmp:
        for k, block in enumerate(blocks):
            sig = Path(tmp) / f"{k}.sig"
            sig.write_bytes(block)
            checked = subprocess.run(
                ["ssh-keygen", "-Y", "verify", "-f", str(allowed_signers), "-I", SIGNER, "-n", NAMESPACE,
                 "-s", str(sig)],
                input=release,
                capture_output=True,
            )  # fmt: skip
            said = (checked.stdout + checked.stderr).decode(errors="replace").strip()
            found = _SIGNED_BY.search(said)
            if checked.returncode == 0 and found:
                keys.add(found.group(1))
            else:
                reasons += said.splitlines()[-1:] or ["no reason"]
    if len(keys) >= threshold:
        return len(keys)
    if threshold == 1:
        raise TransferError(f"release.json's signature does not verify against {allowed_signers}: {reasons[0]}")
    raise TransferError(
        f"release.json is signed by {len(keys)} key(s) of {allowed_signers}, short of the --threshold {threshold} "
        f"this device requires ({len(blocks)} signature(s) served); nothing applied"
    )


def pull(
    url: str,
    workdir: str | Path,
    allowed_signers: str | Path | None = None,
    timeout: float = 60.0,
    threshold: int = 1,
    min_rate: float = MIN_RATE,
) -> PullResult:
    """Make the release at ``url`` live in ``workdir``/models (see the module's docstring).

    ``allowed_signers``: release.json must be signed by a key it names (principal
    ``edgeq-release``); None accepts an unsigned release, which only a trusted network should.
    ``threshold``: how many distinct keys of it must have signed (the device's rule, not the store's).
    ``timeout`` (seconds per socket operation) and ``min_rate`` (bytes/s over each download) bound how long a
    server may take; release.json and its signatures are read up to METADATA_LIMIT, a file up to its signed size.

    Raises:
        TransferError: the release cannot be fetched, its signature or a file's sha256 is wrong
            (nothing is made live then).
    """
    base = url.rstrip("/") + "/"
    folder = Path(workdir).expanduser() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    if timeout <= 0 or min_rate <= 0:
        raise UsageError("--timeout and --min-rate must be above 0")
    limits = Limits(timeout=timeout, min_rate=min_rate)
    raw = _fetch(urllib.parse.urljoin(base, RELEASE), limits)
    fetched = 1
    if allowed_signers is not None:
        if not Path(allowed_signers).is_file():
            raise UsageError(f"{allowed_signers}: no such allowed_signers file")
        _verify(raw, _fetch(urllib.parse.urljoin(base, SIGNATURE), limits), Path(allowed_signers), threshold)
        fetched += 1
    release, files, version = _parse_release(raw, base)
    applied = _applied(folder)
    number = _admitted(release, files, applied, f"{base}{RELEASE}")
    try:
        live = json.loads((folder / LIVE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        live = {}
    live = live if isinstance(live, dict) else {}
    there = {n: sha256_file(folder / n) if (folder / n).is_file() else None for n in files}
    changed = [n for n, e in files.items() if there[n] != e["sha256"]]
    fetched += _apply_files(folder, base, files, changed, there, live, limits)
    _record_live(folder, files, live, changed)
    record = {
        "number": number, "version": version, "expires": release.get("expires"),
        "files": {n: e["sha256"] for n, e in files.items()},
    }  # fmt: skip
    if record != {k: applied.get(k) for k in record}:  # after the files: a crash before it only repeats the pull
        write_json_atomic(folder / APPLIED, {**record, "applied": _now()})
    unchanged = tuple(n for n in files if n not in changed)
    return PullResult(version, number, tuple(changed), unchanged, fetched)


def _parse_release(raw: bytes, base: str) -> tuple[dict, dict, str]:
    """release.json's record, its files and its version, checked before anything is fetched: plain names only."""
    try:
        release = json.loads(raw)
        files = release["files"]
        version = str(release.get("version", "?"))
        if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) for e in files.values()
        ):
            raise TypeError("'files' must map each name to its sha256")
        unsized = [n for n, e in files.items() if type(e.get("size")) is not int or e["size"] < 0]
        if unsized:  # the size bounds the download: without it a store could send a file without end
            raise TypeError(f"{unsized[0]!r} has no signed size in bytes; re-release it with this edgeq")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TransferError(f"{base}{RELEASE}: not an edgeq release ({exc})") from exc
    for name in files:
        if "/" in name or "\\" in name or name.startswith(".") or name in ("", ".."):
            raise TransferError(f"{base}{RELEASE}: {name!r} is not a plain file name")
    return release, files, version


def _apply_files(
    folder: Path, base: str, files: dict, changed: list[str], there: dict, live: dict, limits: Limits
) -> int:
    """Download and check every changed file, then make them live (the replaced one kept); returns the requests made."""
    fetched = 0
    parts: dict[str, Path] = {}
    try:
        for name in changed:  # every file downloaded and checked before any is made live
            part = folder / f".{name}{PART}{os.getpid()}"
            parts[name] = part
            with open(part, "wb") as fh:  # streamed to disk, on disk before it can be renamed live
                url = urllib.parse.urljoin(base, urllib.parse.quote(name))
                fetched += 1
                got = _download(url, fh, files[name]["size"], limits, exact=True)
                fh.flush()
                os.fsync(fh.fileno())
            if got != files[name]["sha256"]:
                raise TransferError(f"{base}{name}: sha256 {got} is not the release's")
        for name, part in parts.items():
            target = folder / name
            previous = there[name]
            if previous is not None:
                (folder / PREVIOUS).mkdir(exist_ok=True)
                keep = folder / PREVIOUS / name
                keep.unlink(missing_ok=True)
                os.link(target, keep)
            os.replace(part, target)
            live[name] = {"sha256": files[name]["sha256"], "previous_sha256": previous, "since": _now()}
    finally:
        for part in parts.values():
            part.unlink(missing_ok=True)
    return fetched


def _record_live(folder: Path, files: dict, live: dict, changed: list[str]) -> None:
    """Write .edgeq-live.json when the pull changed it, so that push --rollback knows each file's previous version."""
    stale = [n for n, e in files.items() if (live.get(n) or {}).get("sha256") != e["sha256"]]
    for name in stale:  # live already, but not recorded so (pushed before the record existed)
        live[name] = {"sha256": files[name]["sha256"], "previous_sha256": None, "since": _now()}
    if changed or stale:
        tmp = folder / f"{LIVE}{PART}{os.getpid()}"
        tmp.write_text(json.dumps(live, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, folder / LIVE)


def _applied(folder: Path) -> dict:
    try:
        record = json.loads((folder / APPLIED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _admitted(release: dict, files: dict, applied: dict, where: str) -> int:
    """The release's number, if this device may apply it; else ReleaseRefused, naming why."""
    number = _number(release)
    version = release.get("version", "?")
    if number is None:
        raise ReleaseRefused(f"{where}: release {version} has no release number; re-release it with this edgeq")
    expires = _seconds(release.get("expires"))
    if expires is None:
        raise ReleaseRefused(f"{where}: release {version} has no expiry; re-release it with this edgeq")
    if time.time() > expires:
        raise ReleaseRefused(
            f"{where}: release {version} (number {number}) expired at {release['expires']}: the store serves stale "
            "metadata, or this device's clock is wrong; keeping what is live (re-sign it: edgeq release --resign)"
        )
    last = _number(applied)
    if last is not None and number < last:
        raise ReleaseRefused(
            f"{where}: release {version} (number {number}) is older than the applied release {applied.get('version')} "
            f"(number {last}): refused as a rollback; to go back, publish edgeq release --rollback-to {version}"
        )
    if last is not None and number == last and {n: e.get("sha256") for n, e in files.items()} != applied.get("files"):
        raise ReleaseRefused(
            f"{where}: release number {number} names other files than the release {applied.get('version')} this "
            "device applied under that number (files mixed in from another release?): refused"
        )
    return number
