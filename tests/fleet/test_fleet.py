"""The fleet end to end: real sshd, an x86 venv device and an emulated Raspberry Pi 4 (aarch64).

The tests share one session fleet and run in file order: the first push bootstraps both
devices, the later tests find them bootstrapped.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from .conftest import DIGITS, INT8, PI4_PYTHON, ROOT, edgeq_popen, edgeq_subprocess, start_sshd

pytestmark = pytest.mark.usefixtures("fleet_env")


def _run(cli, fleet, *args):
    return cli(*args, "--inventory", fleet.inventory)


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_devices_list(cli, fleet):
    result = _run(cli, fleet, "devices", "list")
    assert result.exit_code == 0, result.output
    assert "x86-venv" in result.stdout and "pi4-emu" in result.stdout
    assert "pi4,ci" in result.stdout


def test_push_then_profile_on_all(cli, fleet, tmp_path, monkeypatch, record_property):
    """The first push bootstraps both devices; profile --on all brings the JSON back."""
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    pushed = _run(cli, fleet, "push", INT8, DIGITS, "--to", "all")
    push_s = time.monotonic() - start
    assert pushed.exit_code == 0, pushed.output
    assert "venv, installed" in pushed.stdout and "site, installed" in pushed.stdout
    # the offline venv was made without ensurepip; pip came from the wheelhouse, at the host's version
    from importlib.metadata import version

    venv_python = str(fleet.x86_venv / "bin" / "python")
    listed = subprocess.run([venv_python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
    versions = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
    assert versions["pip"] == version("pip") and "setuptools" not in versions, versions
    start = time.monotonic()
    profiled = _run(cli, fleet, "profile", INT8, "--data", DIGITS, "--runs", "20", "--on", "all")
    profile_s = time.monotonic() - start
    assert profiled.exit_code == 0, profiled.output
    record_property("push_s", round(push_s, 1))
    record_property("profile_on_all_s", round(profile_s, 1))
    print(f"\nFLEET TIMING push (with bootstrap) {push_s:.1f} s, profile --on all {profile_s:.1f} s")
    machines = {}
    for device in ("x86-venv", "pi4-emu"):
        report = json.loads((tmp_path / "results" / device / "tiny_int8.profile.json").read_text())
        machines[device] = report["environment"]["machine"]
        assert report["environment"]["runtime"] == "ai_edge_litert"
        assert report["model"]["scores"]["value"] > 0.9
    assert machines == {"x86-venv": "x86_64", "pi4-emu": "aarch64"}
    lines = {line.split()[0]: line for line in profiled.stdout.splitlines() if line.strip()}
    assert " ok " in lines["x86-venv"] and " ok " in lines["pi4-emu"]
    assert "accuracy " in lines["pi4-emu"] and "task metric" in profiled.stdout  # the metric names itself

    # the fleet section of `edgeq report`: one row per device, the device's own numbers
    from edgeq.report.build import render
    from edgeq.report.sources import collect

    _, context = render(collect([tmp_path / "results"]))
    rows = {r["device"]: r for r in context["fleet"]}
    assert set(rows) == {"x86-venv", "pi4-emu"} and rows["pi4-emu"]["machine"] == "aarch64"
    for device, row in rows.items():
        report = json.loads((tmp_path / "results" / device / "tiny_int8.profile.json").read_text())
        assert row["median_ms"] == report["model"]["runs"][0]["latency"]["median_ms"]
        assert row["value"] == report["model"]["scores"]["value"]

    # Bootstrapped once: a second push sends nothing and installs nothing (unless someone
    # edited the checkout meanwhile: then the new edgeq wheel is installed, as it should be).
    from edgeq.fleet.wheels import _source_hash

    source = _source_hash(ROOT)
    again = _run(cli, fleet, "push", INT8, DIGITS, "--to", "tag:ci")
    assert again.exit_code == 0, again.output
    for line in again.stdout.splitlines()[1:]:
        device, status, uploaded, unchanged = line.split()[:4]
        assert (status, uploaded, unchanged) == ("ok", "0", "2"), line
        if _source_hash(ROOT) == source:
            assert ", unchanged" in line, line  # "venv, unchanged" / "site, unchanged": no install


def test_devices_check(cli, fleet):
    result = _run(cli, fleet, "devices", "check", "all")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "x86_64" in rows["x86-venv"] and "aarch64" in rows["pi4-emu"]
    for row in rows.values():
        assert "ai_edge_litert" in row and " ok " in row
        # bootstrapped offline (x86-venv from its wheelhouse, the Pi's missing wheels pushed
        # and unpacked): exactly this host's edgeq, numpy and LiteRT
        assert row.rstrip().endswith(" same"), row
    header = result.stdout.splitlines()[0]
    assert "vs host (edgeq" in header
    assert "emulated Raspberry Pi 4" in rows["pi4-emu"]
    # Device 1 is the base install only: edgeq and LiteRT, never TensorFlow.
    site_packages = list(fleet.x86_venv.glob("lib/python3*/site-packages"))
    assert site_packages and (site_packages[0] / "ai_edge_litert").is_dir()
    assert not list(site_packages[0].glob("tensorflow*")) and not list(site_packages[0].glob("tf_keras*"))


def test_verify_int8_bit_exact_on_aarch64_and_x86(cli, fleet, tmp_path):
    out = tmp_path / "verify.json"
    result = _run(cli, fleet, "verify", INT8, "--data", DIGITS, "--limit", "64", "--on", "all", "--json", out)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.split()}
    assert "bit-exact" in rows["pi4-emu"] and "aarch64" in rows["pi4-emu"]
    assert "bit-exact" in rows["x86-venv"]
    saved = {d["device"]: d for d in json.loads(out.read_text())["devices"]}
    assert saved["pi4-emu"]["bit_exact"] and saved["pi4-emu"]["samples"] == 64 and saved["x86-venv"]["status"] == "ok"

    from edgeq.report.build import render
    from edgeq.report.sources import collect

    html, context = render(collect([out]))
    assert context["verdict"]["status"] == "pass"
    assert {r["device"]: r["verify"] for r in context["fleet"]} == {"pi4-emu": "bit-exact", "x86-venv": "bit-exact"}


def test_a_three_output_model_is_bit_exact_on_every_output_of_the_emulated_pi(cli, fleet, tmp_path, monkeypatch):
    """A face-detector-like head (box, landmarks, face probability) converted integer-only: the
    emulated Raspberry Pi 4 gives every output bit for bit as the host does, and its profile scores
    each output by its task, as eval on the host does."""
    from tests.test_tasks import _face_data, _face_model

    monkeypatch.chdir(tmp_path)
    model = _face_model(tmp_path / "onet.keras", three=True)
    _face_data(tmp_path / "faces.npz", model, n=200)
    out = tmp_path / "onet_int8.tflite"
    data = f"npz:{tmp_path / 'faces.npz'}"
    assert cli("convert", tmp_path / "onet.keras", "--int8-only", "--calib", data, "--out", out).exit_code == 0
    verified = _run(cli, fleet, "verify", out, "--data", tmp_path / "faces.npz", "--limit", "24", "--on", "pi4-emu",
                    "--json", tmp_path / "v.json")  # fmt: skip
    assert verified.exit_code == 0, verified.output
    (device,) = json.loads((tmp_path / "v.json").read_text())["devices"]
    assert device["device_machine"] == "aarch64" and device["bit_exact"]
    assert {o["name"]: o["bit_exact"] for o in device["outputs"]} == dict.fromkeys(
        ["bbox_reg", "landmarks", "face_prob"], True
    )
    profiled = _run(cli, fleet, "profile", out, "--data", tmp_path / "faces.npz", "--runs", "2", "--on", "pi4-emu")
    assert profiled.exit_code == 0, profiled.output
    report = json.loads((tmp_path / "results" / "pi4-emu" / "onet_int8.profile.json").read_text())
    on_device = {o["name"]: o for o in report["model"]["scores"]["outputs"]}
    assert on_device["face_prob"]["task"] == "classification" and on_device["bbox_reg"]["task"] == "regression"
    local = tmp_path / "host.json"  # the same file's profile on this host: the same metrics, to the digit
    assert cli("profile", out, "--data", tmp_path / "faces.npz", "--runs", "1", "--json", local).exit_code == 0
    on_host = {o["name"]: o for o in json.loads(local.read_text())["model"]["scores"]["outputs"]}
    assert on_device == on_host and "accuracy" in on_host["face_prob"]["metrics"]


@pytest.mark.slow  # trains the zoo detector for this worker (87 s): the device's scores are the
# three-output and classifier tests' in make test; mAP on the device with EDGEQ_SLOW=1
def test_a_detectors_map_on_the_emulated_pi_equals_the_hosts(cli, fleet, detector, tmp_path, monkeypatch):
    """The emulated Raspberry Pi 4 runs the integer-only detector on the exported test split and
    decodes its own outputs; pycocotools scores them on the host: the same mAP as the host's run."""
    folder, _ = detector
    monkeypatch.chdir(tmp_path)
    model, data = folder / "det_int8.tflite", folder / "test.npz"
    result = _run(cli, fleet, "profile", model, "--data", data, "--runs", "2", "--on", "pi4-emu")
    assert result.exit_code == 0, result.output
    device = json.loads((tmp_path / "results" / "pi4-emu" / "det_int8.profile.json").read_text())
    assert device["environment"]["machine"] == "aarch64"
    on_device = device["model"]["scores"]["detection"]
    assert on_device["scored_by"].startswith("pycocotools on the host")
    assert cli("profile", model, "--data", data, "--runs", "1", "--json", tmp_path / "host.json").exit_code == 0
    on_host = json.loads((tmp_path / "host.json").read_text())["model"]["scores"]["detection"]
    assert on_device["images"] == on_host["images"] == 60 and on_device["detections"] == on_host["detections"]
    assert on_device["detections"] > 0 and on_device["map50"] > 0  # a detector that finds something: not 0 == 0
    assert (on_device["map50"], on_device["map"]) == (on_host["map50"], on_host["map"])


def test_hostile_file_names_inject_nothing(cli, fleet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = ["a b;rm -rf ~.tflite", "x;touch INJECTED;.tflite", "$(touch INJECTED2).tflite", "`touch INJECTED3`.tflite"]
    canary = fleet.x86_workdir / "~.tflite"  # what `rm -rf ~.tflite` would remove in the work dir
    canary.parent.mkdir(parents=True, exist_ok=True)
    canary.write_text("still here")
    for name in names:
        hostile = tmp_path / name
        shutil.copy(INT8, hostile)
        result = _run(cli, fleet, "profile", hostile, "--runs", "3", "--on", "x86-venv")
        assert result.exit_code == 0, result.output
        assert (fleet.x86_workdir / "models" / name).is_file()
    assert canary.read_text() == "still here"
    for where in (fleet.x86_workdir, tmp_path, Path.home()):
        assert not list(where.rglob("INJECTED*")), where


def test_paths_are_confined_to_the_workdir():
    from edgeq.errors import UnsafePathError
    from edgeq.fleet.push import safe_name
    from edgeq.fleet.transport import confine, shell_command

    assert confine("/home/pi/edgeq", "models", "a b;c.tflite") == "/home/pi/edgeq/models/a b;c.tflite"
    for bad in ("../x", "/etc/passwd", "models/../../x", "a/./b", "", "a\x00b"):
        with pytest.raises(UnsafePathError):
            confine("/home/pi/edgeq", bad)
    for bad in ("..", ".", "a/b", "a\nb", ".m.tflite.part-1234"):
        with pytest.raises(UnsafePathError):
            safe_name(bad)
    assert shell_command(["ls", "a b;rm -rf ~"], cwd="/w d") == "cd '/w d' && exec ls 'a b;rm -rf ~'"


def test_inventory_refuses_passwords_and_bad_targets(tmp_path):
    from edgeq.errors import InventoryError
    from edgeq.fleet.inventory import load_inventory

    path = tmp_path / "devices.toml"
    path.write_text('[devices.pi]\nhost = "10.0.0.2"\npassword = "hunter2"\n')
    with pytest.raises(InventoryError, match="never stores passwords"):
        load_inventory(path)
    path.write_text('[devices.pi]\nhost = "10.0.0.2"\ntags = ["pi4"]\nworkdir = "/"\n')
    with pytest.raises(InventoryError, match="folder of its own"):
        load_inventory(path)
    path.write_text('[devices.pi]\nhost = "10.0.0.2"\ntags = ["pi4"]\n[devices.pi5]\nhost = "b"\ntags = ["pi5"]\n')
    inventory = load_inventory(path)
    assert [d.name for d in inventory.select("tag:pi5")] == ["pi5"]
    assert [d.name for d in inventory.select("all")] == ["pi", "pi5"]
    with pytest.raises(InventoryError, match="no device has tag"):
        inventory.select("tag:coral")


def test_ansible_yaml_inventory(tmp_path):
    pytest.importorskip("yaml")
    from edgeq.fleet.inventory import load_inventory

    path = tmp_path / "hosts.yml"
    path.write_text(
        "all:\n  vars:\n    ansible_user: pi\n  children:\n    pi4:\n      hosts:\n        desk:\n"
        "          ansible_host: 10.0.0.5\n          ansible_port: 2222\n          edgeq_workdir: /srv/edgeq\n"
    )
    (device,) = load_inventory(path).devices
    assert (device.name, device.host, device.port, device.user, device.tags) == (
        "desk",
        "10.0.0.5",
        2222,
        "pi",
        ("pi4",),
    )


def test_changed_and_unknown_host_keys_are_refused(cli, fleet, tmp_path):
    import subprocess

    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, blob = other.with_suffix(".pub").read_text().split()[:2]
    text = fleet.inventory.read_text()

    changed = tmp_path / "changed.toml"
    wrong = tmp_path / "known_hosts_changed"
    wrong.write_text(f"[127.0.0.1]:{fleet.sshd.port} {kind} {blob}\n")
    changed.write_text(text.replace(str(fleet.known_hosts), str(wrong)))
    for extra in ((), ("--accept-new-host-keys",)):
        result = cli("devices", "check", "x86-venv", "--inventory", changed, *extra)
        assert result.exit_code != 0
        assert "host key CHANGED" in result.output and "ssh-keygen -R" in result.output, result.output

    unknown = tmp_path / "unknown.toml"
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    unknown.write_text(text.replace(str(fleet.known_hosts), str(empty)))
    result = cli("devices", "check", "x86-venv", "--inventory", unknown)
    assert result.exit_code != 0 and "not in known_hosts" in result.output, result.output
    assert empty.read_text() == ""  # nothing added silently
    result = cli("devices", "check", "x86-venv", "--inventory", unknown, "--accept-new-host-keys")
    assert result.exit_code == 0, result.output
    assert f"[127.0.0.1]:{fleet.sshd.port}" in empty.read_text()


def test_interrupted_upload_leaves_no_file_and_next_push_completes(cli, fleet, tmp_path):
    big = tmp_path / "big.bin"
    block = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes()
    with open(big, "wb") as fh:
        for i in range(192):
            fh.write(bytes([i]) + block[1:])
    models = fleet.x86_workdir / "models"
    proc = edgeq_popen("push", big, "--to", "x86-venv", "--inventory", fleet.inventory, cwd=tmp_path)
    deadline = time.monotonic() + 120
    part = None
    while time.monotonic() < deadline and proc.poll() is None:
        parts = [p for p in models.glob(".big.bin.part-*") if p.stat().st_size > 0]
        if parts:
            part = parts[0]
            break
        time.sleep(0.01)
    proc.kill()
    proc.communicate()
    assert part is not None, "the upload finished before it could be interrupted"
    assert not (models / "big.bin").exists()

    result = _run(cli, fleet, "push", big, "--to", "x86-venv")
    assert result.exit_code == 0, result.output
    from edgeq.artifacts import sha256_file

    assert sha256_file(models / "big.bin") == sha256_file(big)
    assert not list(models.glob(".big.bin.part-*"))
    (models / "big.bin").unlink()


def test_sshd_killed_mid_fleet_run(cli, fleet, tmp_path):
    """One device's sshd dies while it profiles: it fails, the other completes, exit != 0."""
    # Both devices below share x86-venv's virtualenv: bootstrap it first, not twice at once.
    assert _run(cli, fleet, "push", INT8, "--to", "x86-venv").exit_code == 0
    doomed_sshd = start_sshd(tmp_path / "sshd2", fleet.client_pub)
    try:
        doomed_work = tmp_path / "doomed-work"
        inventory = tmp_path / "devices.toml"
        text = fleet.inventory.read_text()
        x86_block = text[text.index("[devices.x86-venv]") : text.index("[devices.pi4-emu]")]
        doomed = x86_block.replace("[devices.x86-venv]", "[devices.doomed]")
        doomed = doomed.replace(f"port = {fleet.sshd.port}", f"port = {doomed_sshd.port}")
        doomed = doomed.replace(str(fleet.x86_workdir), str(doomed_work))
        known = tmp_path / "known_hosts"
        known.write_text(fleet.known_hosts.read_text() + doomed_sshd.known_hosts_line() + "\n")
        inventory.write_text(
            f'[defaults]\nknown_hosts = "{known}"\n\n' + x86_block + "\n" + doomed.replace('"x86", ', "")
        )
        proc = edgeq_popen(
            "profile", INT8, "--runs", "5", "--min-seconds", "6", "--on", "all", "--inventory", inventory, cwd=tmp_path
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (doomed_work / "results").exists():
            time.sleep(0.05)
        time.sleep(1.0)  # edgeq profile is now running on the doomed device
        doomed_sshd.kill()
        out, err = proc.communicate(timeout=180)
    finally:
        if doomed_sshd.proc.poll() is None:
            doomed_sshd.kill()
    print(out, err)
    assert proc.returncode != 0, out + err
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip()}
    assert " failed " in rows["doomed"], out
    assert " ok " in rows["x86-venv"], out
    assert (tmp_path / "results" / "x86-venv" / "tiny_int8.profile.json").is_file()
    assert not (tmp_path / "results" / "doomed").exists()
    assert "failed on 1 of 2 device(s): doomed" in err


def test_profile_on_unknown_device_is_one_line_error(cli, fleet):
    result = _run(cli, fleet, "profile", INT8, "--on", "nope")
    assert result.exit_code != 0
    assert len(_errors(result.stderr)) == 1 and "no device 'nope'" in result.stderr


def test_edgeq_subprocess_entry(fleet, tmp_path):
    proc = edgeq_subprocess("devices", "list", "--inventory", fleet.inventory, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_offline_device_without_pip_gets_every_wheel_pushed(cli, fleet, tmp_path, monkeypatch):
    """An emulated Pi whose Python sees no numpy/click/LiteRT (``-S``: no site-packages) and
    has no pip: push brings the aarch64 wheels from this host and unpacks them on the device."""
    monkeypatch.chdir(tmp_path)
    bare = tmp_path / "pi4-bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{PI4_PYTHON}" -S "$@"\n')
    bare.chmod(0o755)
    inventory = tmp_path / "devices.toml"
    inventory.write_text(
        f'[defaults]\nknown_hosts = "{fleet.known_hosts}"\n\n'
        + fleet.device_toml("pi4-bare", fleet.sshd.port, tmp_path / "bare work", f'python = "{bare}"')
    )
    before = cli("devices", "check", "--inventory", inventory)
    assert before.exit_code == 0, before.output
    assert "aarch64" in before.stdout and " none " in before.stdout  # nothing installed yet
    result = cli("profile", INT8, "--data", DIGITS, "--runs", "5", "--on", "pi4-bare", "--inventory", inventory)
    assert result.exit_code == 0, result.output
    site = tmp_path / "bare work" / "site"
    assert (site / "numpy").is_dir() and (site / "ai_edge_litert").is_dir() and (site / "edgeq").is_dir()
    report = json.loads((tmp_path / "results" / "pi4-bare" / "tiny_int8.profile.json").read_text())
    assert report["environment"]["machine"] == "aarch64"
    assert report["model"]["scores"]["value"] > 0.9


def test_a_cold_push_to_a_new_virtualenv_is_five_remote_commands(fleet, tmp_path):
    """Counted by the transport over real SSH: the state read, one probe (the base Python, the
    folders made, the venv's bin and the wheelhouse listed), the venv made, one pip command that
    first checks every wheel's sha256 and writes the marker when it succeeds, the models' commit.
    The wheels go up by SFTP between them. Then the same push again is one command."""
    from edgeq.fleet.inventory import load_inventory
    from edgeq.fleet.remote import push_to

    from .conftest import host_python

    inventory = tmp_path / "devices.toml"
    extra = f'python = "{host_python()}"\nvenv = "{tmp_path / "venv"}"\nwheelhouse = "{fleet.root / "wheelhouse"}"'
    inventory.write_text(
        f'[defaults]\nknown_hosts = "{fleet.known_hosts}"\n\n'
        + fleet.device_toml("fresh-venv", fleet.sshd.port, tmp_path / "work", extra)
    )
    device = load_inventory(inventory).get("fresh-venv")
    cold = push_to(device, [INT8])
    assert cold.runtime.mode == "venv" and cold.runtime.installed == "installed", cold
    assert cold.commands == 5, cold.commands
    assert (tmp_path / "work" / "models" / INT8.name).read_bytes() == INT8.read_bytes()
    again = push_to(device, [INT8])
    assert again.commands == 1 and again.runtime.installed == "unchanged", again


def test_connect_retries_with_backoff_until_sshd_answers(fleet, tmp_path):
    """A transient failure (nothing listens yet) is retried; the sshd started after the first
    failed attempt (from the retry's own log record, not on a timer) is reached."""
    import logging

    from edgeq.fleet.connection import connect
    from edgeq.fleet.inventory import Device

    from .conftest import free_port

    port = free_port()
    holder = {}

    class StartOnRetry(logging.Handler):
        def emit(self, record):
            if "retry" in record.getMessage() and "sshd" not in holder:
                holder["sshd"] = start_sshd(tmp_path / "late", fleet.client_pub, port=port)

    logger = logging.getLogger("edgeq.fleet.transport")
    handler, level = StartOnRetry(logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    device = Device(
        name="late",
        host="127.0.0.1",
        port=port,
        user="root",
        identity_file=str(fleet.client_key),
        known_hosts=str(tmp_path / "known_hosts"),
        host_key_policy="accept-new",
        workdir=str(tmp_path / "w"),
    )
    try:
        with connect(device, attempts=3, backoff_s=0.05) as transport:
            assert transport.run(["uname", "-m"]).stdout.strip()
        assert "sshd" in holder  # the first attempt failed and was retried
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if "sshd" in holder:
            holder["sshd"].kill()


def test_profile_on_with_compare_pushes_the_reference(cli, fleet, tmp_path, monkeypatch):
    from .conftest import FP32

    monkeypatch.chdir(tmp_path)
    result = _run(cli, fleet, "profile", INT8, "--compare", FP32, "--data", DIGITS, "--runs", "5", "--on", "x86-venv")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "results" / "x86-venv" / "tiny_int8.profile.json").read_text())
    assert report["reference"]["model"]["path"].endswith("/models/tiny_fp32.tflite")
    assert report["comparison"]


def test_a_wheel_that_would_write_outside_its_folder_is_refused(tmp_path):
    import zipfile

    from edgeq.fleet.device import extract_wheels

    evil = tmp_path / "evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../outside.txt", "gotcha")
    with pytest.raises(SystemExit, match="would leave"):
        extract_wheels(str(tmp_path / "site"), [str(evil)])
    assert not (tmp_path / "outside.txt").exists()


def _device_processes(transport, marker: str) -> list[str]:
    """The device's processes whose command line holds ``marker``, read with ps on the device."""
    listing = transport.run(["ps", "-eo", "pid,pgid,args"], timeout=60)
    assert listing.ok, listing.stderr
    return [line for line in listing.stdout.splitlines() if marker in line and "ps -eo" not in line]


@pytest.mark.parametrize("name", ["x86-venv", "pi4-emu"])
def test_a_command_timeout_kills_the_remote_process_group(fleet, name):
    """Not only the SSH channel: the command and what it started are gone from the device (ps)."""
    import uuid

    from edgeq.errors import DeviceError
    from edgeq.fleet.connection import connect
    from edgeq.fleet.inventory import load_inventory

    device = load_inventory(fleet.inventory).get(name)
    marker = f"edgeq-stray-{uuid.uuid4().hex[:8]}"
    script = "import sys, time; time.sleep(3600)"
    python = str(PI4_PYTHON)
    if name == "x86-venv":  # a child that starts a grandchild (a shell holding the marker): both must go
        script = "import subprocess, sys, time; subprocess.Popen(['sh', '-c', 'sleep 3600; : ' + sys.argv[1]]); " + (
            "time.sleep(3600)"
        )
        python = "python3"
    with connect(device) as transport:
        with pytest.raises(DeviceError, match="timed out"):
            transport.run([python, "-c", script, marker], timeout=3)
        assert _device_processes(transport, marker) == []


def test_ctrl_c_stops_the_remote_profile_and_leaves_no_process(fleet, tmp_path):
    """Ctrl-C during `profile --on`: exit 130 with one line, and no edgeq profile left on the device."""
    pushed = edgeq_subprocess("push", INT8, "--to", "x86-venv", "--inventory", fleet.inventory, cwd=tmp_path)
    assert pushed.returncode == 0, pushed.stderr
    proc = edgeq_popen(
        "profile", INT8, "--runs", "5", "--min-seconds", "987", "--on", "x86-venv", "--inventory", fleet.inventory,
        cwd=tmp_path,
    )  # fmt: skip
    seen = []
    for line in proc.stderr:  # a blocking read of edgeq's own progress lines, no timer
        seen.append(line)
        if "x86-venv: profiling" in line:
            break
    else:
        pytest.fail("profile ended before it started profiling: " + "".join(seen))
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    errors = _errors(err)
    assert len(errors) == 1 and "interrupted" in errors[0] and "finished on 0 of 1" in errors[0], err
    assert "Traceback" not in err
    from edgeq.fleet.connection import connect
    from edgeq.fleet.inventory import load_inventory

    with connect(load_inventory(fleet.inventory).get("x86-venv")) as transport:
        assert _device_processes(transport, "--min-seconds 987") == []


def test_ssh_config_host_alias_and_proxyjump(fleet, tmp_path, monkeypatch):
    """~/.ssh/config (here EDGEQ_SSH_CONFIG) resolves HostName, Port, User, IdentityFile and ProxyJump."""
    from edgeq.fleet.connection import connect
    from edgeq.fleet.inventory import load_inventory

    port = fleet.sshd.port
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host pi-desk\n  HostName 127.0.0.1\n  Port {port}\n  User root\n  IdentityFile {fleet.client_key}\n\n"
        f"Host pi-behind-jump\n  HostName 127.0.0.1\n  Port {port}\n  User root\n  IdentityFile {fleet.client_key}\n"
        f"  ProxyJump root@127.0.0.1:{port}\n\n"
        f"Host 127.0.0.1\n  IdentityFile {fleet.client_key}\n"
    )
    monkeypatch.setenv("EDGEQ_SSH_CONFIG", str(config))
    inventory = tmp_path / "devices.toml"
    inventory.write_text(
        f'[defaults]\nknown_hosts = "{fleet.known_hosts}"\n\n[devices.desk]\nhost = "pi-desk"\n\n'
        '[devices.behind]\nhost = "pi-behind-jump"\n'
    )
    for name in ("desk", "behind"):
        with connect(load_inventory(inventory).get(name)) as transport:
            result = transport.run(["sh", "-c", "echo $SSH_CONNECTION"], timeout=60)
            assert result.ok, result.stderr
            assert result.stdout.split()[2:4] == ["127.0.0.1", str(port)]  # reached the sshd the config names
            if name == "behind":
                assert transport._jump is not None  # through the jump host's direct-tcpip channel
    monkeypatch.setenv("EDGEQ_SSH_CONFIG", str(tmp_path / "none"))
    from edgeq.errors import DeviceError

    with pytest.raises(DeviceError):  # without the config, "pi-desk" is not a host this machine knows
        connect(load_inventory(inventory).get("desk"), attempts=1)


def test_max_fail_stops_the_rollout_and_leaves_later_batches_untouched(cli, fleet, tmp_path):
    """--batch 1 --max-fail 1: two dead devices first, then the rollout stops (exit 6); with a
    budget of 50% of 4 it goes on to the end and only the failures are reported (exit 5)."""
    from .conftest import free_port

    text = fleet.inventory.read_text()
    x86_block = text[text.index("[devices.x86-venv]") : text.index("[devices.pi4-emu]")]
    dead = [
        x86_block.replace("[devices.x86-venv]", f"[devices.dead{i}]").replace(
            f"port = {fleet.sshd.port}", f"port = {free_port()}"
        )
        for i in (1, 2, 3)
    ]
    inventory = tmp_path / "devices.toml"
    known = f'[defaults]\nknown_hosts = "{fleet.known_hosts}"\n\n'
    inventory.write_text(known + dead[0] + "\n" + dead[1] + "\n" + x86_block + "\n" + dead[2])
    stopped = cli("devices", "check", "all", "--inventory", inventory, "-j", "1", "--batch", "1", "--max-fail", "1")
    assert stopped.exit_code == 6, stopped.output
    rows = {line.split()[0]: line.split()[1] for line in stopped.stdout.splitlines()[1:] if line.split()}
    assert rows == {"dead1": "failed", "dead2": "failed", "x86-venv": "skipped", "dead3": "skipped"}
    errors = _errors(stopped.stderr)
    assert len(errors) == 1 and "rollout stopped" in errors[0] and "2 of 4 not attempted" in errors[0]

    finished = cli("devices", "check", "all", "--inventory", inventory, "--batch", "2", "--max-fail", "50%")
    assert finished.exit_code == 5, finished.output
    rows = {line.split()[0]: line.split()[1] for line in finished.stdout.splitlines()[1:] if line.split()}
    assert rows == {"dead1": "failed", "dead2": "failed", "x86-venv": "ok", "dead3": "failed"}
    assert "failed on 3 of 4 device(s): dead1, dead2, dead3" in finished.stderr


def test_push_keeps_the_previous_version_and_rollback_swaps_it_back(cli, fleet, tmp_path):
    """v1 then v2 of one file: the device keeps v1; --rollback makes v1 live, a second one v2 again."""
    from edgeq.artifacts import sha256_file

    v1, v2 = tmp_path / "v1" / "model.tflite", tmp_path / "v2" / "model.tflite"
    for path, source in ((v1, INT8), (v2, INT8.with_name("tiny_uint8.tflite"))):
        path.parent.mkdir()
        shutil.copy(source, path)
    models = fleet.x86_workdir / "models"
    live = models / ".edgeq-live.json"
    for version in (v1, v2):
        assert _run(cli, fleet, "push", version, "--to", "x86-venv").exit_code == 0
    assert sha256_file(models / "model.tflite") == sha256_file(v2)
    assert sha256_file(models / ".previous" / "model.tflite") == sha256_file(v1)
    record = json.loads(live.read_text())["model.tflite"]
    assert (record["sha256"], record["previous_sha256"]) == (sha256_file(v2), sha256_file(v1))

    back = _run(cli, fleet, "push", "--rollback", "model.tflite", "--to", "x86-venv")
    assert back.exit_code == 0, back.output
    assert sha256_file(models / "model.tflite") == sha256_file(v1)
    assert json.loads(live.read_text())["model.tflite"]["sha256"] == sha256_file(v1)
    assert sha256_file(v1)[:12] in back.stdout
    again = _run(cli, fleet, "push", "--rollback", "model.tflite", "--to", "x86-venv")
    assert again.exit_code == 0 and sha256_file(models / "model.tflite") == sha256_file(v2)
    assert not [n for n in (models / ".previous").iterdir() if n.name.startswith(".")]  # no link left aside

    never = _run(cli, fleet, "push", "--rollback", "never-pushed.tflite", "--to", "x86-venv")
    assert never.exit_code == 5 and "no previous version of never-pushed.tflite" in never.stdout + never.stderr


def test_version_drift_is_named_against_the_host():
    from edgeq.fleet.probe import Probe, host_versions

    host = host_versions()
    probe = Probe(
        machine="aarch64", system="Linux", os="Debian", python="3.11", python_tag="cp311", executable="python3",
        glibc="2.36", numpy=host["numpy"], click="8.1", runtime="ai_edge_litert",
        runtime_version=host["runtime"].split()[1], edgeq=host["edgeq"], free_bytes=1, edgetpu_library=None,
        edgetpu_devices=(), pip=True, venv=False,
    )  # fmt: skip
    assert probe.drift(host) == []
    old = dataclasses.replace(probe, numpy="1.26.4", runtime="tflite_runtime", runtime_version="2.14.0")
    assert old.drift(host) == [
        f"numpy 1.26.4 (host {host['numpy']})",
        f"runtime tflite_runtime 2.14.0 (host {host['runtime']})",
    ]


def test_runtime_rollback_in_a_virtualenv_over_ssh(cli, fleet, tmp_path, monkeypatch):
    """x86-venv: a push of another edgeq build keeps the wheel it replaces; --rollback --runtime
    reinstalls that one and records it as live (and x86-venv ends on this checkout's build)."""
    import hashlib

    from edgeq.fleet.wheels import build_wheel

    from .test_local_fleet import another_build

    monkeypatch.chdir(tmp_path)
    first = build_wheel()
    second = another_build(first, tmp_path / "second")
    assert _run(cli, fleet, "push", INT8, "--to", "x86-venv").exit_code == 0  # this checkout's build
    pushed = _run(cli, fleet, "push", INT8, "--to", "x86-venv", "--wheel", second)
    assert pushed.exit_code == 0 and "venv, installed" in pushed.stdout, pushed.output

    def state():
        record = json.loads((fleet.x86_workdir / ".edgeq-runtime.json").read_text())
        return record["live"]["sha256"], record["previous"]["sha256"]

    def another_build_installed() -> bool:
        return any(fleet.x86_venv.glob("lib/python*/site-packages/edgeq/_another_build.txt"))

    digest = {w: hashlib.sha256(w.read_bytes()).hexdigest() for w in (first, second)}
    assert state() == (digest[second], digest[first]) and another_build_installed()
    rolled = _run(cli, fleet, "push", "--rollback", "--runtime", "--to", "x86-venv")
    assert rolled.exit_code == 0, rolled.output
    assert state() == (digest[first], digest[second]) and not another_build_installed()
    again = _run(cli, fleet, "push", INT8, "--to", "x86-venv")  # the checkout's build is live: nothing to install
    assert again.exit_code == 0 and "venv, unchanged" in again.stdout, again.output
    kept = {p.name for p in (fleet.x86_workdir / "wheels").iterdir() if p.is_dir() and len(p.name) == 16}
    assert kept == {digest[first][:16], digest[second][:16]}  # each build's wheel, for the next rollback


def test_a_regressor_on_a_device_speaks_rmse_and_has_no_top1(cli, fleet, tmp_path, monkeypatch):
    """profile --on and verify of a 1-unit regressor: its RMSE in the table, no top-1 agreement for values."""
    import numpy as np

    from tests.test_verdicts import _regressor

    monkeypatch.chdir(tmp_path)
    model = _regressor(tmp_path / "reg.keras")
    x = np.random.default_rng(0).normal(0, 1, (200, 6)).astype(np.float32)
    np.savez(tmp_path / "reg.npz", x=x, y=model.predict(x, verbose=0).astype(np.float32))
    out = tmp_path / "reg_int8.tflite"
    assert cli("convert", tmp_path / "reg.keras", "--int8-only", "--calib", f"npz:{tmp_path / 'reg.npz'}",
               "--out", out).exit_code == 0  # fmt: skip
    profiled = _run(cli, fleet, "profile", out, "--data", tmp_path / "reg.npz", "--runs", "2", "--on", "x86-venv")
    assert profiled.exit_code == 0, profiled.output
    row = next(line for line in profiled.stdout.splitlines() if line.startswith("x86-venv"))
    assert "RMSE " in row and "%" not in row.split("RMSE")[1].split()[0], row
    verified = _run(cli, fleet, "verify", out, "--data", tmp_path / "reg.npz", "--limit", "16", "--on", "x86-venv",
                    "--json", tmp_path / "v.json")  # fmt: skip
    assert verified.exit_code == 0, verified.output
    (device,) = json.loads((tmp_path / "v.json").read_text())["devices"]
    assert device["top1_agreement"] is None and device["outputs"][0]["top1_agreement"] is None


def test_a_plan_times_its_candidates_on_the_device(cli, fleet, tmp_path):
    """`analyze plan --target --on DEVICE`: each candidate is pushed and profiled there (the fleet's
    remote profile), and the plan records the device's latencies."""
    from edgeq.models.compat import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.Flatten(),
         keras.layers.Dense(10, activation="softmax")]
    )  # fmt: skip
    model.compile("adam", "sparse_categorical_crossentropy")
    path = tmp_path / "small.keras"
    model.save(path)
    out = tmp_path / "plan.json"
    result = _run(cli, fleet, "analyze", "plan", path, "--data", "digits", "--max-drop", "100", "--out", out,
                  "--target", "edgetpu", "--ranges", "minmax", "--runs", "5", "--on", "x86-venv")  # fmt: skip
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["latency_on"] == "x86-venv, 1 thread" and saved["latency_ms"] > 0 and saved["fp32"]["latency_ms"] > 0
    profiles = sorted((tmp_path / "plan.candidates" / "profiles" / "x86-venv").glob("*.profile.json"))
    assert len(profiles) == 3, profiles  # FP32 twice (the faster kept) and the int8 candidate, each on the device
    medians = sorted(json.loads(p.read_text())["model"]["runs"][0]["latency"]["median_ms"] for p in profiles)
    assert saved["fp32"]["latency_ms"] in medians and saved["latency_ms"] in medians
