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

Device side: the standard library and ``ssh-keygen`` only (no TensorFlow, no paramiko).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from edgeq.artifacts import sha256_file
from edgeq.errors import TransferError, UsageError

RELEASE = "release.json"
SIGNATURE = "release.json.sig"
NAMESPACE = "edgeq-release"  # ssh-keygen -Y's namespace: a signature for anything else does not verify here
SIGNER = "edgeq-release"  # the principal devices' allowed_signers names the release key with
LIVE = ".edgeq-live.json"  # as edgeq.fleet.push writes it
PREVIOUS = ".previous"
PART = ".part-"


def make_release(files: list[str | Path], out: str | Path, version: str, key: str | Path | None = None) -> Path:
    """Write a release of ``files`` into ``out`` (each file, then release.json, then its signature).

    Returns:
        The path of release.json.

    Raises:
        UsageError: a missing file, two files of one name, or a key ssh-keygen cannot sign with.
    """
    out = Path(out)
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise UsageError(f"{', '.join(missing)}: no such file to release")
    names = [p.name for p in paths]
    if len(set(names)) != len(names) or any(n in (RELEASE, SIGNATURE) or n.startswith(".") for n in names):
        raise UsageError(f"release file names must be unique, not hidden and not {RELEASE}: {names}")
    out.mkdir(parents=True, exist_ok=True)
    entries = {}
    for path in paths:
        shutil.copyfile(path, out / f".{path.name}.tmp")
        os.replace(out / f".{path.name}.tmp", out / path.name)
        entries[path.name] = {"sha256": sha256_file(out / path.name), "size": path.stat().st_size}
    record = {"kind": "edgeq.release", "version": version, "created": _now(), "files": entries}
    tmp = out / f".{RELEASE}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if key is not None:
        signed = subprocess.run(
            ["ssh-keygen", "-q", "-Y", "sign", "-f", str(key), "-n", NAMESPACE, str(tmp)],
            capture_output=True,
            text=True,
        )
        if signed.returncode != 0:
            tmp.unlink()
            raise UsageError(f"{key}: ssh-keygen cannot sign with it ({signed.stderr.strip().splitlines()[-1:]})")
        os.replace(tmp.with_name(tmp.name + ".sig"), out / SIGNATURE)
    elif (out / SIGNATURE).exists():
        (out / SIGNATURE).unlink()  # an older release's signature would not match this one
    os.replace(tmp, out / RELEASE)
    return out / RELEASE


@dataclass(frozen=True)
class PullResult:
    version: str
    updated: tuple[str, ...]  # files made live by this pull
    unchanged: tuple[str, ...]
    fetched: int  # HTTP requests made (release.json, its signature, each changed file)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _fetch(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the user's release URL
            return response.read()
    except OSError as exc:  # URLError, HTTPError, timeouts
        raise TransferError(f"{url}: cannot fetch it ({exc})") from exc


def _verify(release: bytes, signature: bytes, allowed_signers: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="edgeq-pull-") as tmp:
        sig = Path(tmp) / SIGNATURE
        sig.write_bytes(signature)
        checked = subprocess.run(
            ["ssh-keygen", "-Y", "verify", "-f", str(allowed_signers), "-I", SIGNER, "-n", NAMESPACE, "-s", str(sig)],
            input=release,
            capture_output=True,
        )
    if checked.returncode != 0:
        why = (checked.stderr or checked.stdout).decode(errors="replace").strip().splitlines()[-1:] or ["no reason"]
        raise TransferError(f"release.json's signature does not verify against {allowed_signers}: {why[0]}")


def pull(
    url: str,
    workdir: str | Path,
    allowed_signers: str | Path | None = None,
    timeout: float = 60.0,
) -> PullResult:
    """Make the release at ``url`` live in ``workdir``/models (see the module's docstring).

    ``allowed_signers``: release.json must be signed by a key it names (principal
    ``edgeq-release``); None accepts an unsigned release, which only a trusted network should.

    Raises:
        TransferError: the release cannot be fetched, its signature or a file's sha256 is wrong
            (nothing is made live then).
    """
    base = url.rstrip("/") + "/"
    folder = Path(workdir).expanduser() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    raw = _fetch(urllib.parse.urljoin(base, RELEASE), timeout)
    fetched = 1
    if allowed_signers is not None:
        if not Path(allowed_signers).is_file():
            raise UsageError(f"{allowed_signers}: no such allowed_signers file")
        _verify(raw, _fetch(urllib.parse.urljoin(base, SIGNATURE), timeout), Path(allowed_signers))
        fetched += 1
    try:
        release = json.loads(raw)
        files = release["files"]
        version = str(release.get("version", "?"))
    except (ValueError, KeyError, TypeError) as exc:
        raise TransferError(f"{base}{RELEASE}: not an edgeq release ({exc})") from exc
    for name in files:
        if "/" in name or "\\" in name or name.startswith(".") or name in ("", ".."):
            raise TransferError(f"{base}{RELEASE}: {name!r} is not a plain file name")
    try:
        live = json.loads((folder / LIVE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        live = {}
    live = live if isinstance(live, dict) else {}
    there = {n: sha256_file(folder / n) if (folder / n).is_file() else None for n in files}
    changed = [n for n, e in files.items() if there[n] != e["sha256"]]
    parts: dict[str, Path] = {}
    try:
        for name in changed:  # every file downloaded and checked before any is made live
            part = folder / f".{name}{PART}{os.getpid()}"
            data = _fetch(urllib.parse.urljoin(base, urllib.parse.quote(name)), timeout)
            fetched += 1
            with open(part, "wb") as fh:  # on disk before it can be renamed live
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            parts[name] = part
            got = hashlib.sha256(data).hexdigest()
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
    stale = [n for n, e in files.items() if (live.get(n) or {}).get("sha256") != e["sha256"]]
    for name in stale:  # live already, but not recorded so (pushed before the record existed)
        live[name] = {"sha256": files[name]["sha256"], "previous_sha256": None, "since": _now()}
    if changed or stale:
        tmp = folder / f"{LIVE}{PART}{os.getpid()}"
        tmp.write_text(json.dumps(live, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, folder / LIVE)
    unchanged = tuple(n for n in files if n not in changed)
    return PullResult(version, tuple(changed), unchanged, fetched)
