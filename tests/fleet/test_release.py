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
    content = INT8.read_bytes()  # its signed size, other bytes (a longer file is refused by its size first)
    (folder / "m.tflite").write_bytes(content[:-10] + bytes(b ^ 0xFF for b in content[-10:]))
    (device / "models" / "m.tflite").write_bytes(b"stale")  # so the pull must fetch
    bad = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert_one_line_error(bad, "m.tflite", "is not the release's")
    assert (device / "models" / "m.tflite").read_bytes() == b"stale"  # nothing made live
    assert not list((device / "models").glob(".*.part-*"))
    assert before  # the first pull had made the model live
    assert_one_line_error(cli("pull", url, "--workdir", device), "--allowed-signers")


def _state(device: Path) -> tuple[bytes, str]:
    models = device / "models"
    return (models / "m.tflite").read_bytes(), (models / ".edgeq-release.json").read_text()


def test_a_store_cannot_roll_back_or_freeze_a_device_and_going_back_is_a_new_signed_release(
    cli, tmp_path, store, signing
):
    """TUF's rollback, freeze and mix-and-match attacks by whoever serves the store, each refused in
    one line with exit 7 and nothing changed on the device; then a newer release, a re-signed one
    and a signed rollback release applied."""
    folder, url, _ = store
    key, allowed = signing
    models = {}
    for v in ("1", "2"):
        models[v] = tmp_path / f"v{v}" / "m.tflite"
        models[v].parent.mkdir()
        models[v].write_bytes(INT8.read_bytes() + v.encode())
    kept = {}  # a copy of each genuine release as the store served it: what an attacker replays
    for v in ("1", "2"):
        made = cli("release", models[v], "--out", folder, "--version", v, "--key", key)
        assert made.exit_code == 0 and f"(number {v})" in made.output, made.output
        kept[v] = {n: (folder / n).read_bytes() for n in ("release.json", "release.json.sig", "m.tflite")}
    device = tmp_path / "dev"
    pulled = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert pulled.exit_code == 0 and "release 2 (number 2): updated m.tflite" in pulled.output, pulled.output
    before = _state(device)
    assert json.loads(before[1])["number"] == 2

    def serve(files):
        for name, data in files.items():
            (folder / name).write_bytes(data)

    serve(kept["1"])  # the older, genuinely signed release re-served at the live URL
    rollback = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert rollback.exit_code == 7 and _state(device) == before
    assert_one_line_error(rollback, "number 1", "older than the applied release 2", "--rollback-to")

    record = json.loads(kept["2"]["release.json"])  # number 2 re-signed by the key holder with release 1's file
    record["files"]["m.tflite"]["sha256"] = _sha(models["1"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "release.json").write_text(json.dumps(record))
    subprocess.run(["ssh-keygen", "-q", "-Y", "sign", "-f", str(key), "-n", "edgeq-release",
                    str(mixed / "release.json")], check=True)  # fmt: skip
    signature = (mixed / "release.json.sig").read_bytes()
    serve({"release.json": (mixed / "release.json").read_bytes(), "release.json.sig": signature,
           "m.tflite": kept["1"]["m.tflite"]})  # fmt: skip
    swapped = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert swapped.exit_code == 7 and _state(device) == before
    assert_one_line_error(swapped, "release number 2 names other files")

    serve(kept["2"])
    assert cli("release", "--resign", "--out", folder, "--key", key, "--expires", "1m").exit_code == 0
    stale = json.loads((folder / "release.json").read_text())
    stale["expires"] = "2020-01-01T00:00:00Z"  # an old expiry, genuinely signed: what a frozen store keeps serving
    (folder / "release.json").write_text(json.dumps(stale))
    (folder / "release.json.sig").unlink()
    subprocess.run(["ssh-keygen", "-q", "-Y", "sign", "-f", str(key), "-n", "edgeq-release",
                    str(folder / "release.json")], check=True)  # fmt: skip
    frozen = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert frozen.exit_code == 7 and _state(device) == before
    assert_one_line_error(frozen, "expired at 2020-01-01T00:00:00Z", "--resign")

    resigned = cli("release", "--resign", "--out", folder, "--key", key, "--expires", "30d")
    assert resigned.exit_code == 0 and "(number 2)" in resigned.output, resigned.output
    fresh = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert fresh.exit_code == 0 and "up to date" in fresh.output, fresh.output  # same files: nothing fetched

    back = cli("release", "--rollback-to", "1", "--out", folder, "--key", key)
    assert back.exit_code == 0 and "(number 3)" in back.output, back.output
    applied = cli("pull", url, "--workdir", device, "--allowed-signers", allowed)
    assert applied.exit_code == 0 and "updated m.tflite" in applied.output, applied.output
    assert (device / "models" / "m.tflite").read_bytes() == models["1"].read_bytes()
    assert json.loads(_state(device)[1])["number"] == 3
    # the store's own order holds too: a number not above its last is refused where it is made
    assert_one_line_error(
        cli("release", models["2"], "--out", folder, "--version", "x", "--number", "3", "--key", key), "not above"
    )


def test_a_device_requiring_two_of_three_keys_counts_distinct_signers_and_a_removed_line_revokes(cli, tmp_path, store):
    """k of n: a release signed by one key is one short of --threshold 2 (the same key twice counts
    once); a second signer's --cosign makes it pass; removing a key's line from allowed_signers
    revokes it. Each refusal is one line and changes nothing."""
    folder, url, _ = store
    keys = []
    for name in ("alice", "bob", "carol"):
        key = tmp_path / name
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        keys.append(key)
    allowed = tmp_path / "allowed_signers"
    lines = [f"edgeq-release {Path(f'{k}.pub').read_text().strip()}\n" for k in keys]
    allowed.write_text("".join(lines))
    model = tmp_path / "m.tflite"
    model.write_bytes(INT8.read_bytes())
    device = tmp_path / "dev"
    pull = ("pull", url, "--workdir", device, "--allowed-signers", allowed, "--threshold", "2")

    made = cli("release", model, "--out", folder, "--version", "1", "--key", keys[0], "--key", keys[0])
    assert made.exit_code == 0 and "signed by 2 key(s)" in made.output, made.output
    short = cli(*pull)
    assert_one_line_error(short, "signed by 1 key(s)", "--threshold 2")
    assert not (device / "models" / "m.tflite").exists()

    cosigned = cli("release", "--cosign", "--out", folder, "--key", keys[1])
    assert cosigned.exit_code == 0 and "3 signature(s)" in cosigned.output, cosigned.output
    ok = cli(*pull)
    assert ok.exit_code == 0 and "updated m.tflite" in ok.output, ok.output

    allowed.write_text(lines[0] + lines[2])  # bob's key revoked
    model.write_bytes(INT8.read_bytes() + b"2")
    assert cli("release", model, "--out", folder, "--version", "2", "--key", keys[0], "--key", keys[1]).exit_code == 0
    revoked = cli(*pull)
    assert_one_line_error(revoked, "signed by 1 key(s)")
    assert (device / "models" / "m.tflite").read_bytes() == INT8.read_bytes()
    assert json.loads((device / "models" / ".edgeq-release.json").read_text())["number"] == 1
    assert cli("release", "--cosign", "--out", folder, "--key", keys[2]).exit_code == 0
    assert cli(*pull).exit_code == 0 and (device / "models" / "m.tflite").read_bytes() == model.read_bytes()
