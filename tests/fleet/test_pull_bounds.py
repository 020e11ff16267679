"""`edgeq pull` against a store or a network in the middle that tries to exhaust the device (deploy/FLEET.md):
endless data (release.json, a model file, a file past its signed size) and slow retrieval (a server that
drips bytes). A real HTTP server on this machine plays the store; each attack stops by itself (its client
goes, or its own cap is reached). The pull runs as a child process, so its peak memory is its own VmHWM.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from .conftest import INT8, run_edgeq

# The child's peak resident memory: the CLI's imports (no TensorFlow) and a 64 KiB read buffer. An unbounded
# read of the endless release.json reached 8.5 GB before this bound existed.
PEAK_MIB = 150
# Served without end, at full speed: far past every bound (512 KiB of metadata, the model's size).
ENDLESS_BYTES = 2 * 1024**3


class Attack:
    """What the store serves in place of a path: 'endless' (spaces, as fast as the socket takes them),
    'oversized' (the real file and then more), or 'drip' (one byte every 0.2 s)."""

    def __init__(self) -> None:
        self.by_path: dict[str, str] = {}
        self.sent: dict[str, int] = {}


def _handler(folder: Path, attack: Attack):
    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802 - http.server's name
            mode = attack.by_path.get(self.path)
            if mode is None:
                return super().do_GET()
            self.send_response(200)
            self.end_headers()  # no Content-Length: the client cannot know the end in advance
            sent = 0
            body = (folder / self.path.lstrip("/")).read_bytes() if mode == "oversized" else b""
            try:
                if body:
                    self.wfile.write(body)
                    sent += len(body)
                while sent < ENDLESS_BYTES and (mode != "drip" or sent < 600):  # its own cap: it stops by itself
                    chunk = b"x" if mode == "drip" else b" " * 65536
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent += len(chunk)
                    if mode == "drip":
                        time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the device hung up: the attack is over
            attack.sent[self.path] = sent
            self.close_connection = True

    return Handler


@pytest.fixture
def store(tmp_path):
    folder = tmp_path / "store"
    folder.mkdir()
    attack = Attack()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_handler(folder, attack), directory=str(folder)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/", attack
    server.shutdown()
    server.server_close()


def _release(cli, tmp_path: Path, folder: Path, version: str, extra: bytes = b"") -> None:
    model = tmp_path / f"v{version}" / "m.tflite"
    model.parent.mkdir()
    model.write_bytes(INT8.read_bytes() + extra)
    made = cli("release", model, "--out", folder, "--version", version)
    assert made.exit_code == 0, made.output


def _pull(tmp_path: Path, url: str, device: Path, *flags: str) -> tuple[int, float, float, str]:
    log = tmp_path / f"pull{len(list(tmp_path.glob('pull*.log')))}.log"
    return run_edgeq("pull", url, "--workdir", device, "--unsigned", *flags, cwd=tmp_path, log=log)


@pytest.mark.parametrize(
    "path, mode, says",
    [
        ("/release.json", "endless", "more than the metadata limit"),
        ("/m.tflite", "endless", "more than its signed size"),
        ("/m.tflite", "oversized", "more than its signed size"),
        ("/release.json", "drip", "below the minimum rate"),
        ("/m.tflite", "drip", "below the minimum rate"),
    ],
)
def test_a_pull_refuses_endless_or_slow_data_in_one_line_and_changes_nothing(cli, tmp_path, store, path, mode, says):
    folder, url, attack = store
    device = tmp_path / "device"
    _release(cli, tmp_path, folder, "1")
    code, _, _, out = _pull(tmp_path, url, device)
    assert code == 0, out
    models = device / "models"
    live = {p.name: p.read_bytes() for p in models.rglob("*") if p.is_file()}
    _release(cli, tmp_path, folder, "2", b"retrained")  # a new genuine release; the store or network attacks it
    attack.by_path[path] = mode
    # --timeout 1: each socket read (the drip sends a byte every 0.2 s, so it never trips); --min-rate 1024 KiB/s:
    # a drip of release.json (512 KiB at most) is dropped after 1.5 s, of the model after about 1 s
    code, seconds, peak_mib, out = _pull(tmp_path, url, device, "--timeout", "1", "--min-rate", "1024")
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1 and says in errors[0], out
    assert "Traceback" not in out, out
    assert peak_mib < PEAK_MIB, f"the pull peaked at {peak_mib:.0f} MiB"
    assert seconds < 60, f"the refused pull took {seconds:.0f} s"  # bounded: the attack alone would run far longer
    assert {p.name: p.read_bytes() for p in models.rglob("*") if p.is_file()} == live  # nothing changed, no part


def test_a_slow_but_steady_pull_within_the_rate_is_applied(cli, tmp_path, store):
    """The deadline is timeout + size / min-rate: a file that arrives whole in time is taken, whatever its size."""
    folder, url, _ = store
    device = tmp_path / "device"
    _release(cli, tmp_path, folder, "1", b"\0" * (4 * 1024 * 1024))
    code, _, _, out = _pull(tmp_path, url, device, "--min-rate", "16")
    assert code == 0 and "updated m.tflite" in out, out
    record = json.loads((device / "models" / ".edgeq-release.json").read_text())
    assert record["number"] == 1


def test_a_release_without_signed_sizes_is_refused(cli, tmp_path, store):
    """A file's size bounds its download: a release.json that drops it is refused before any file is fetched."""
    folder, url, _ = store
    _release(cli, tmp_path, folder, "1")
    release = json.loads((folder / "release.json").read_text())
    for entry in release["files"].values():
        entry.pop("size")
    (folder / "release.json").write_text(json.dumps(release))
    code, _, _, out = _pull(tmp_path, url, tmp_path / "device")
    assert code != 0 and "no signed size" in out and not (tmp_path / "device" / "models" / "m.tflite").exists(), out
