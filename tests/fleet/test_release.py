"""Pull-based rollout (deploy/FLEET.md): a signed release on a real HTTP server, pulled by
devices of the local fleet with `edgeq pull`, in the folder layout `edgeq push` keeps."""

from __future__ import annotations

import hashlib
import http.server
import json
import subprocess
import threading
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import assert_one_line_error

from .conftest import INT8


@pytest.fixture
def store(tmp_path):
    """A static HTTP server (the standard library's) over a folder, counting the requests."""
    folder = tmp_path / "store"
    folder.mkdir()
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # quiet, but counted
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/", requests
    server.shutdown()
    server.server_close()


@pytest.fixture
def signing(tmp_path):
    key = tmp_path / "release_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(f"edgeq-release {(tmp_path / 'release_key.pub').read_text().strip()}\n")
    return key, allowed


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_devices_pull_a_signed_release_once_and_keep_the_previous_for_rollback(cli, tmp_path, store, signing):
    folder, url, requests = store
    key, allowed = signing
    first = tmp_path / "v1" / "m.tflite"
    first.parent.mkdir()
    first.write_bytes(INT8.read_bytes())
    first.with_name("m.manifest.json").write_text('{"normalization": {"scale": 0.0625}}')
    made = cli("release", first, first.with_name("m.manifest.json"), "--out", folder, "--version", "1", "--key", key)
    assert made.exit_code == 0, made.output
    devices = [tmp_path / f"dev{i}" for i in range(3)]
    for device in devices:
        pulled = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
        assert pulled.exit_code == 0, pulled.output
        assert "updated m.manifest.json, m.tflite (4 request(s))" in pulled.output
        assert (device / "models" / "m.tflite").read_bytes() == first.read_bytes()
    requests.clear()
    again = cli("pull", url, "--workdir", devices[0], "--allowed-signers", allowed)
    assert again.exit_code == 0 and "up to date (2 request(s))" in again.output, again.output
    assert sorted(requests) == ["/release.json", "/release.json.sig"]  # no file fetched again

    second = tmp_path / "v2" / "m.tflite"
    second.parent.mkdir()
    second.write_bytes(INT8.read_bytes() + b"retrained")
    assert cli("release", second, "--out", folder, "--version", "2", "--key", key).exit_code == 0
    requests.clear()
    assert cli("pull", url, "--workdir", devices[0], "--allowed-signers", allowed).exit_code == 0
    assert sorted(requests) == ["/m.tflite", "/release.json", "/release.json.sig"]  # the manifest is unchanged
    models = devices[0] / "models"
    assert (models / "m.tflite").read_bytes() == second.read_bytes()
    assert (models / ".previous" / "m.tflite").read_bytes() == first.read_bytes()
    live = json.loads((models / ".edgeq-live.json").read_text())
    assert live["m.tflite"] == {**live["m.tflite"], "sha256": _sha(second), "previous_sha256": _sha(first)}
    # the record is push's: push --rollback on the same device brings the first model back
    inventory = tmp_path / "devices.toml"
    inventory.write_text(f'[devices.dev0]\nhost = "local"\nworkdir = "{devices[0]}"\n')
    rolled = cli("push", "--rollback", "m.tflite", "--to", "dev0", "--inventory", inventory)
    assert rolled.exit_code == 0, rolled.output
    assert (models / "m.tflite").read_bytes() == first.read_bytes()


def test_a_tampered_release_changes_nothing_live(cli, tmp_path, store, signing):
    folder, url, _ = store
    key, allowed = signing
    model = tmp_path / "m.tflite"
    model.write_bytes(INT8.read_bytes())
    assert cli("release", model, "--out", folder, "--version", "1", "--key", key).exit_code == 0
    device = tmp_path / "dev"
    assert cli("pull", url, "--workdir", device, "--allowed-signers", allowed).exit_code == 0
    before = (device / "models" / "m.tflite").read_bytes()

    record = json.loads((folder / "release.json").read_text())  # someone swaps the model and fixes the hash...
    (folder / "m.tflite").write_bytes(b"not a model")
    record["files"]["m.tflite"]["sha256"] = hashlib.sha256(b"not a model").hexdigest()
    (folder / "release.json").write_text(json.dumps(record))
    refused = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert_one_line_error(refused, "signature does not verify")  # ...but cannot sign it
    # a file that does not match its (signed) sha256 is refused too
    assert cli("release", model, "--out", folder, "--version", "2", "--key", key).exit_code == 0
    (folder / "m.tflite").write_bytes(INT8.read_bytes() + b"corrupted in the store")
    (device / "models" / "m.tflite").write_bytes(b"stale")  # so the pull must fetch
    bad = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert_one_line_error(bad, "m.tflite", "is not the release's")
    assert (device / "models" / "m.tflite").read_bytes() == b"stale"  # nothing made live
    assert not list((device / "models").glob(".*.part-*"))
    assert before  # the first pull had made the model live
    assert_one_line_error(cli("pull", url, "--workdir", device), "--allowed-signers")
