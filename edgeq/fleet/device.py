"""The device side of ``edgeq verify`` and ``edgeq push``: ``python -m edgeq.fleet.device``.

Runs on the device with the base install only (numpy, LiteRT): no TensorFlow, no
paramiko. ``raw`` runs already-quantized inputs through the model one sample at a time
and saves the raw outputs, so that the host can compare them bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import zipfile


def sha256_files(paths: list[str]) -> dict[str, str | None]:
    """sha256 of each file; None for a file that is not there.

    Not edgeq.artifacts.sha256_file: this file also runs as ``python -c`` on a device
    before edgeq is installed there, so it imports nothing from edgeq at module level.
    """
    result: dict[str, str | None] = {}
    for path in paths:
        try:
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    digest.update(block)
            result[path] = digest.hexdigest()
        except FileNotFoundError:
            result[path] = None
    return result


def extract_wheels(target: str, wheels: list[str]) -> None:
    """Unpack wheels into ``target`` (a folder put on PYTHONPATH): an install without pip."""
    os.makedirs(target, exist_ok=True)
    real = os.path.realpath(target)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                dest = os.path.realpath(os.path.join(target, member))
                if not dest.startswith(real + os.sep):
                    raise SystemExit(f"error: {wheel}: member {member!r} would leave {target}")
            zf.extractall(target)


def switch_link(link: str, target: str) -> None:
    """Point the symlink ``link`` at ``target`` (relative to its folder) in one rename.

    A new link is made under a temporary name and renamed over the old one, so a process
    starting at any moment finds either the old runtime or the new one, never none. A
    ``link`` that is still a real folder (an install from before runtime versions) is moved
    aside to ``versions/legacy`` first, where a rollback can find it.
    """
    folder = os.path.dirname(os.path.abspath(link))
    if os.path.isdir(link) and not os.path.islink(link):
        legacy = os.path.join(folder, "versions", "legacy")
        os.makedirs(os.path.dirname(legacy), exist_ok=True)
        if os.path.lexists(legacy):
            raise SystemExit(f"error: {legacy} is in the way of moving the old {link} aside")
        os.replace(link, legacy)
    if not os.path.isdir(os.path.join(folder, target)):
        raise SystemExit(f"error: {os.path.join(folder, target)} is not a folder")
    tmp = f"{link}.switch-{os.getpid()}"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def install_site(workdir: str, version_dir: str, marker: str, digest: str, state: str, files: list[str]) -> None:
    """Make ``WORKDIR/version_dir`` the live site install, in one Python start-up.

    ``files``: PATH=SHA256 each; wheels are unpacked, other files (a schema module) copied in.
    A file whose sha256 differs is removed (the next push sends it again) and nothing changes.
    Then the marker holds ``digest``, WORKDIR/site points at the version, WORKDIR/``state``'s
    JSON (argv: ``STATE_NAME=JSON``) records live and previous, and the versions neither names
    are removed.
    """
    import shutil

    expected = [entry.rsplit("=", 1) for entry in files]
    got = sha256_files([path for path, _ in expected])
    for path, digest_wanted in expected:
        if got[path] != digest_wanted:
            if got[path] is not None:
                os.remove(path)
            raise SystemExit(f"error: {path}: sha256 {got[path]} != {digest_wanted}; removed, push again")
    target = os.path.join(workdir, version_dir)
    shutil.rmtree(target, ignore_errors=True)  # a half-unpacked earlier try
    extract_wheels(target, [path for path, _ in expected if path.endswith(".whl")])
    for path, _ in expected:
        if not path.endswith(".whl"):
            shutil.copy(path, os.path.join(target, os.path.basename(path)))
    with open(os.path.join(target, marker), "w") as fh:
        fh.write(digest + "\n")
    switch_link(os.path.join(workdir, "site"), version_dir)
    name, _, record = state.partition("=")
    tmp = os.path.join(workdir, f"{name}.part-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(record)
    os.replace(tmp, os.path.join(workdir, name))
    kept = json.loads(record)
    keep = {os.path.basename((kept.get(k) or {}).get("dir") or "") for k in ("live", "previous")}
    keep.add(os.path.basename(version_dir))
    versions = os.path.join(workdir, "versions")
    for entry in os.listdir(versions):
        if entry not in keep and os.path.isdir(os.path.join(versions, entry)):
            shutil.rmtree(os.path.join(versions, entry), ignore_errors=True)


def run_raw(model: str, inputs: str, out: str, runtime: str | None, delegate: str | None) -> None:
    """Run already-quantized inputs (``input_names``, ``input_0``...) one sample at a time and save
    every raw output by name (``output_names``, ``output_0``...)."""
    import numpy as np

    from edgeq.runtime.interpreter import TFLiteModel

    tfl = TFLiteModel(model, runtime=runtime, num_threads=1, delegate=delegate)
    with np.load(inputs) as data:
        names = [str(n) for n in data["input_names"]]
        x = {name: data[f"input_{i}"] for i, name in enumerate(names)}
    count = len(next(iter(x.values()))) if x else 0
    got: dict = {name: [] for name in tfl.output_names}
    for i in range(count):
        for name, value in tfl.invoke_raw_outputs({k: v[i : i + 1] for k, v in x.items()}).items():
            got[name].append(value)
    outputs = {
        f"output_{i}": np.concatenate(got[name], axis=0) if got[name] else np.zeros((0,))
        for i, name in enumerate(tfl.output_names)
    }
    tmp = out + ".part"  # edgeq.artifacts.atomic_path would do; see sha256_files for why not
    with open(tmp, "wb") as fh:
        np.savez(
            fh,
            output_names=np.array(tfl.output_names),
            machine=np.array(platform.machine()),
            runtime=np.array(f"{tfl.backend.name} {tfl.backend_version}"),
            **outputs,
        )
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgeq.fleet.device")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sha256")
    p.add_argument("paths", nargs="*")
    p = sub.add_parser("extract")
    p.add_argument("target")
    p.add_argument("wheels", nargs="+")
    p = sub.add_parser("switch")
    p.add_argument("link")
    p.add_argument("target")
    p = sub.add_parser("install-site")
    p.add_argument("workdir")
    p.add_argument("version_dir")
    p.add_argument("marker")
    p.add_argument("digest")
    p.add_argument("state")
    p.add_argument("files", nargs="+")
    p = sub.add_parser("raw")
    p.add_argument("model")
    p.add_argument("inputs")
    p.add_argument("out")
    p.add_argument("--runtime")
    p.add_argument("--delegate")
    args = parser.parse_args(argv)
    if args.command == "sha256":
        print(json.dumps(sha256_files(args.paths)))
    elif args.command == "extract":
        extract_wheels(args.target, args.wheels)
    elif args.command == "switch":
        switch_link(args.link, args.target)
    elif args.command == "install-site":
        install_site(args.workdir, args.version_dir, args.marker, args.digest, args.state, args.files)
    else:
        try:
            run_raw(args.model, args.inputs, args.out, args.runtime, args.delegate)
        except Exception as exc:  # one line for the host to show
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"error: {first}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
