"""Fleet logic at scale without sshd: devices with ``host = "local"`` (LocalTransport).

Each device has its own work folder and bootstraps on its own (the wheels unpacked into its
``site``), so push, profile, batches, failure budgets and summaries run exactly as over SSH.
test_fleet.py's real sshd stays the proof of the SSH path.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from edgeq.errors import DeviceError
from edgeq.fleet.connection import LocalTransport, connect
from edgeq.fleet.inventory import Device
from edgeq.fleet.transport import backoff_delay

from .conftest import DIGITS, INT8, PI4_PYTHON

DEVICES = 16
BROKEN = ("dev00", "dev01", "dev02")  # a Python that does not exist: they fail, the rest go on


def _inventory(root: Path, names, broken=BROKEN) -> Path:
    blocks = []
    for name in names:
        python = "/nonexistent/python3" if name in broken else sys.executable
        blocks.append(f'[devices.{name}]\nhost = "local"\npython = "{python}"\nworkdir = "{root / name}"\n')
    path = root / "devices.toml"
    path.write_text("\n".join(blocks))
    return path


def _rows(stdout: str) -> dict[str, str]:
    return {line.split()[0]: line.split()[1] for line in stdout.splitlines()[1:] if line.split()}


@pytest.fixture(scope="module")
def local_fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("local-fleet")
    return root, _inventory(root, [f"dev{i:02d}" for i in range(DEVICES)])


def test_push_and_profile_on_a_local_fleet_name_the_failed_devices(cli, local_fleet, tmp_path, monkeypatch):
    root, inventory = local_fleet
    monkeypatch.chdir(tmp_path)
    pushed = cli("push", INT8, DIGITS, "--to", "all", "--inventory", inventory, "-j", "8")
    assert pushed.exit_code == 5, pushed.output  # some failed
    rows = _rows(pushed.stdout)
    assert {n for n, s in rows.items() if s == "failed"} == set(BROKEN)
    assert sum(s == "ok" for s in rows.values()) == DEVICES - len(BROKEN)
    assert f"failed on {len(BROKEN)} of {DEVICES} device(s): {', '.join(BROKEN)}" in pushed.stderr
    for i in range(len(BROKEN), DEVICES):
        assert (root / f"dev{i:02d}" / "models" / INT8.name).read_bytes() == INT8.read_bytes()

    again = cli("push", INT8, DIGITS, "--to", "all", "--inventory", inventory, "-j", "8")
    assert again.exit_code == 5
    unchanged = [line.split() for line in again.stdout.splitlines()[1:] if " ok " in f" {line} "]
    assert unchanged and all(cols[2:4] == ["0", "2"] for cols in unchanged)  # uploaded 0, unchanged 2

    profiled = cli("profile", INT8, "--data", DIGITS, "--runs", "5", "--on", "all", "--inventory", inventory, "-j", "8")
    assert profiled.exit_code == 5, profiled.output
    assert {n for n, s in _rows(profiled.stdout).items() if s == "failed"} == set(BROKEN)
    for i in range(len(BROKEN), DEVICES):
        report = json.loads((tmp_path / "results" / f"dev{i:02d}" / "tiny_int8.profile.json").read_text())
        assert report["model"]["scores"]["value"] > 0.9


def test_a_spent_failure_budget_stops_the_rollout(cli, local_fleet):
    """Batches of 4 with --max-fail 10% (1 of 16): the first batch holds the 3 broken devices,
    so the rollout stops there (exit 6) and the 12 devices of later batches are not touched."""
    _, inventory = local_fleet
    stopped = cli("devices", "check", "all", "--inventory", inventory, "--batch", "4", "--max-fail", "10%")
    assert stopped.exit_code == 6, stopped.output
    rows = _rows(stopped.stdout)
    assert [rows[f"dev{i:02d}"] for i in range(4)] == ["failed", "failed", "failed", "ok"]
    assert {rows[f"dev{i:02d}"] for i in range(4, DEVICES)} == {"skipped"}
    assert "rollout stopped" in stopped.stderr and f"{DEVICES - 4} of {DEVICES} not attempted" in stopped.stderr


def _processes_running(cmdline_part: str) -> list[str]:
    """Processes whose command line (NUL-separated, from /proc) contains ``cmdline_part``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:  # it ended while we looked
                continue
            if cmdline_part in cmdline:
                found.append(f"{entry.name}: {cmdline!r}")
    return found


def test_a_local_timeout_kills_the_whole_process_group(tmp_path):
    seconds = random.randrange(600_000, 900_000)  # a sleep no other process on this machine has
    transport = connect(Device(name="here", host="local", workdir=str(tmp_path)))
    assert isinstance(transport, LocalTransport)
    script = f"sleep {seconds} & sleep {seconds}"  # a child in the background, as a profile's workers are
    with pytest.raises(DeviceError, match="timed out after 1 s"):
        transport.run(["sh", "-c", script], timeout=1)
    assert not _processes_running(f"sleep\0{seconds}")
    transport.close()
    with pytest.raises(DeviceError, match="not connected"):
        transport.run(["true"])


def test_retries_back_off_exponentially_with_jitter():
    rng = random.Random(0)
    for attempt in (1, 2, 3):
        delays = [backoff_delay(attempt, 0.5, rng) for _ in range(200)]
        base = 0.5 * 2 ** (attempt - 1)
        assert all(0.5 * base <= d < 1.5 * base for d in delays)
        assert len({round(d, 6) for d in delays}) > 150  # spread, not one instant for every device


def _fake_sysfs(root: Path, milli_c: int) -> Path:
    zone = root / "class" / "thermal" / "thermal_zone0"
    zone.mkdir(parents=True, exist_ok=True)
    (zone / "temp").write_text(f"{milli_c}\n")
    return root


def test_health_check_skips_hot_devices_before_anything_is_uploaded(cli, tmp_path, monkeypatch):
    """A 91 °C thermal zone (EDGEQ_SYSFS, as profile reads it): every device is skipped with the
    reason and nothing reaches it; --max-temp 95 or --no-health-check lets the push through."""
    names = ["hot0", "hot1", "hot2"]
    inventory = _inventory(tmp_path, names, broken=())
    monkeypatch.setenv("EDGEQ_SYSFS", str(_fake_sysfs(tmp_path / "sys", 91_000)))
    skipped = cli("push", INT8, "--to", "all", "--inventory", inventory)
    assert skipped.exit_code == 5, skipped.output
    assert set(_rows(skipped.stdout).values()) == {"unhealthy"}
    assert "skipped by the health check: 91.0 °C, over 80 °C" in skipped.stdout
    assert not any((tmp_path / n / "models").exists() for n in names)  # not even bootstrapped
    # an unhealthy device spends the failure budget like a failed one
    stopped = cli("push", INT8, "--to", "all", "--inventory", inventory, "--batch", "1", "--max-fail", "0")
    assert stopped.exit_code == 6 and list(_rows(stopped.stdout).values()) == ["unhealthy", "skipped", "skipped"]
    assert cli("push", INT8, "--to", "hot0", "--inventory", inventory, "--max-temp", "95").exit_code == 0
    assert cli("push", INT8, "--to", "hot1", "--inventory", inventory, "--no-health-check").exit_code == 0
    assert (tmp_path / "hot0" / "models" / INT8.name).is_file() and not (tmp_path / "hot2" / "models").exists()


def test_health_reads_disk_temperature_throttling_and_load(tmp_path, monkeypatch):
    from edgeq.fleet.health import HealthLimits, read_health

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vcgencmd").write_text('#!/bin/sh\n[ "$1" = get_throttled ] && echo "throttled=0x50005"\n')
    (bindir / "vcgencmd").chmod(0o755)  # the Raspberry Pi firmware tool, as a Pi 4 that throttles answers
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("EDGEQ_SYSFS", str(_fake_sysfs(tmp_path / "sys", 62_500)))
    transport = LocalTransport(Device(name="pi", host="local", workdir=str(tmp_path / "not-yet" / "edgeq")))
    health = read_health(transport, str(tmp_path / "not-yet" / "edgeq"))  # the nearest existing parent is measured
    assert health.temperature_c == 62.5 and health.throttled == "0x50005"
    assert health.free_mib is not None and health.free_mib > 0 and health.load_per_cpu is not None
    problems = health.problems(HealthLimits())
    assert problems == ["throttled now (vcgencmd get_throttled: 0x50005)"]
    assert health.problems(HealthLimits(allow_throttled=True)) == []
    assert "needs" in health.problems(HealthLimits(allow_throttled=True, min_free_mib=health.free_mib * 4))[0]
    assert "per CPU" in health.problems(HealthLimits(allow_throttled=True, max_load_per_cpu=-1))[0]


@pytest.fixture(scope="module")
def tflite_runtime_python(tmp_path_factory) -> str:
    """A device Python as Coral boards and older Raspberry Pi OS images have it: numpy 1.x and
    tflite-runtime 2.14, no ai-edge-litert (and no click: the bootstrap brings what is missing)."""
    venv = tmp_path_factory.mktemp("tflite-runtime") / "venv"
    # without ensurepip, and nothing byte-compiled: this pip installs into it (the device needs no pip)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--disable-pip-version-check"]
    pip += ["--no-compile", "numpy<2", "tflite-runtime==2.14.0"]
    install = subprocess.run(pip, capture_output=True, text=True, timeout=1200, env=env)
    if install.returncode != 0 and "No matching distribution found for tflite-runtime" in install.stderr:
        pytest.skip(f"tflite-runtime 2.14 has no wheel for Python {sys.version_info[0]}.{sys.version_info[1]} here")
    assert install.returncode == 0, install.stderr
    return python


def test_a_tflite_runtime_device_profiles_and_verifies_bit_exact(cli, tflite_runtime_python, digits_int8, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """push picks the runtime the device has (tflite_runtime: no LiteRT installed there, only its
    .tflite schema and flatbuffers); profile runs on it; verify finds the built-in int8 kernels'
    outputs bit-exact with this host's ai-edge-litert on the tiny models and the trained digits-cnn.
    XNNPACK's int8 kernels (tflite-runtime 2.14's vs LiteRT 2.3's) differed here by up to 8 steps
    with the same top-1: verify reports that difference and exits 4."""
    monkeypatch.chdir(tmp_path)
    inventory = tmp_path / "devices.toml"
    device = f'host = "local"\npython = "{tflite_runtime_python}"\nworkdir = "{tmp_path}/dev"\n'
    inventory.write_text(f"[devices.coral]\n{device}")
    models = [INT8, INT8.with_name("tiny_uint8.tflite"), digits_int8.path]
    pushed = cli("push", *models, DIGITS, "--to", "coral", "--inventory", inventory)
    assert pushed.exit_code == 0, pushed.output
    site = tmp_path / "dev" / "site"
    assert (site / "click").is_dir() and not list(site.glob("ai_edge_litert*")) and not (site / "numpy").exists()

    profiled = cli("profile", INT8, "--data", DIGITS, "--runs", "5", "--on", "coral", "--inventory", inventory)
    assert profiled.exit_code == 0, profiled.output
    report = json.loads((tmp_path / "results" / "coral" / "tiny_int8.profile.json").read_text())
    environment = report["environment"]
    assert environment["runtime"] == "tflite_runtime" and environment["numpy_version"].startswith("1.")
    assert report["model"]["scores"]["value"] > 0.9
    for model in models:
        for delegate in ("none", "xnnpack"):
            checked = cli("verify", model, "--data", DIGITS, "--on", "coral", "--inventory", inventory,
                          "--delegate", delegate, "--json", "v.json")  # fmt: skip
            device = json.loads((tmp_path / "v.json").read_text())["devices"][0]
            assert device["device_runtime"] == "tflite_runtime 2.14.0", device
            if delegate == "none":  # the built-in int8 kernels: the same integers as LiteRT's
                assert checked.exit_code == 0 and device["bit_exact"], checked.output
            else:  # XNNPACK of 2023 vs 2026 may round otherwise: verify says by how much (exit 4), or nothing
                assert checked.exit_code == (0 if device["bit_exact"] else 4), checked.output
                assert device["bit_exact"] or ("max |diff|" in checked.stdout and device["max_abs_diff"] > 0)
                assert device["top1_agreement"] >= 0.99


def another_build(wheel: Path, folder: Path) -> Path:
    """The same edgeq wheel with one file more (edgeq/_another_build.txt): another build, another sha256."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    out = folder / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            dst.writestr(item, src.read(item.filename))
        dst.writestr("edgeq/_another_build.txt", "another build\n")
    return out


def test_runtime_rollback_swaps_the_site_back_atomically(cli, tmp_path, monkeypatch):
    """A push of another edgeq keeps the one it replaces; --rollback --runtime makes it live
    again (WORKDIR/site is a symlink renamed over in one step), and back again."""
    import hashlib

    from edgeq.fleet.wheels import build_wheel

    monkeypatch.chdir(tmp_path)
    first = build_wheel()
    second = another_build(first, tmp_path / "second")
    digest = {w: hashlib.sha256(w.read_bytes()).hexdigest() for w in (first, second)}
    work = tmp_path / "dev"
    inventory = tmp_path / "devices.toml"
    inventory.write_text(f'[devices.dev]\nhost = "local"\npython = "{sys.executable}"\nworkdir = "{work}"\n')
    site = work / "site"

    def live():
        state = json.loads((work / ".edgeq-runtime.json").read_text())
        return state["live"]["sha256"], (state.get("previous") or {}).get("sha256")

    def device_sees_another_build() -> bool:
        code = "import importlib.resources as r; print(r.files('edgeq').joinpath('_another_build.txt').is_file())"
        env = {**os.environ, "PYTHONPATH": str(site)}
        out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, check=True)
        return out.stdout.strip() == "True"

    nothing = cli("push", "--rollback", "--runtime", "--to", "dev", "--inventory", inventory)
    assert nothing.exit_code != 0 and "no previous edgeq runtime" in nothing.output
    for wheel in (first, second):
        pushed = cli("push", INT8, "--to", "dev", "--inventory", inventory, "--wheel", wheel)
        assert pushed.exit_code == 0, pushed.output
    assert live() == (digest[second], digest[first])
    assert site.is_symlink() and os.readlink(site) == f"versions/{digest[second][:16]}"
    assert device_sees_another_build()

    rolled = cli("push", "--rollback", "--runtime", "--to", "dev", "--inventory", inventory)
    assert rolled.exit_code == 0, rolled.output
    assert live() == (digest[first], digest[second]) and not device_sees_another_build()
    assert os.readlink(site) == f"versions/{digest[first][:16]}"
    again = cli("push", "--rollback", "--runtime", "--to", "dev", "--inventory", inventory)
    assert again.exit_code == 0 and live() == (digest[second], digest[first]) and device_sees_another_build()
    # only the live and the previous runtime stay on the device
    assert sorted(p.name for p in (work / "versions").iterdir()) == sorted(d[:16] for d in digest.values())
    # a push of the live build changes nothing
    same = cli("push", INT8, "--to", "dev", "--inventory", inventory, "--wheel", second)
    assert same.exit_code == 0 and "site, unchanged" in same.stdout and live() == (digest[second], digest[first])
    runtime_alone = cli("push", "--runtime", "--to", "dev", "--inventory", inventory)
    assert runtime_alone.exit_code == 2 and "--rollback" in runtime_alone.output


def test_a_site_installed_before_runtime_versions_is_kept_for_rollback(cli, tmp_path, monkeypatch):
    """A device bootstrapped by an older edgeq has a real WORKDIR/site folder and no
    .edgeq-runtime.json: the next push of another build moves it aside as the previous runtime."""
    import shutil

    from edgeq.fleet.wheels import build_wheel

    monkeypatch.chdir(tmp_path)
    first = build_wheel()
    work = tmp_path / "dev"
    inventory = tmp_path / "devices.toml"
    inventory.write_text(f'[devices.dev]\nhost = "local"\npython = "{sys.executable}"\nworkdir = "{work}"\n')
    assert cli("push", INT8, "--to", "dev", "--inventory", inventory, "--wheel", first).exit_code == 0
    # turn it into what an older edgeq left: site a real folder, no runtime record
    real = (work / "site").resolve()
    (work / "site").unlink()
    shutil.move(real, work / "site")
    shutil.rmtree(work / "versions")
    (work / ".edgeq-runtime.json").unlink()

    second = another_build(first, tmp_path / "second")
    assert cli("push", INT8, "--to", "dev", "--inventory", inventory, "--wheel", second).exit_code == 0
    state = json.loads((work / ".edgeq-runtime.json").read_text())
    assert state["previous"]["dir"] == "versions/legacy" and (work / "versions" / "legacy" / "edgeq").is_dir()
    rolled = cli("push", "--rollback", "--runtime", "--to", "dev", "--inventory", inventory)
    assert rolled.exit_code == 0, rolled.output
    assert os.readlink(work / "site") == "versions/legacy"
    assert not (work / "site" / "edgeq" / "_another_build.txt").exists()


def test_an_emulated_pi5_profiles_and_verifies_bit_exact(cli, tmp_path, monkeypatch):
    """A Raspberry Pi 5 core (Cortex-A76) under qemu-user: the emulated Pi 4's aarch64 userland
    with QEMU_CPU=cortex-a76. The offline bootstrap, profile and a bit-exact verify run on it."""
    if not PI4_PYTHON.is_file():
        pytest.skip(f"no emulated Pi userland at {PI4_PYTHON.parent.parent} (deploy/make-emulated-pi4.sh)")
    text = PI4_PYTHON.read_text()
    assert "QEMU_CPU=cortex-a72" in text, text
    pi5 = tmp_path / "pi5-python"
    pi5.write_text(text.replace("QEMU_CPU=cortex-a72", "QEMU_CPU=cortex-a76").replace("Pi 4", "Pi 5"))
    pi5.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    inventory = tmp_path / "devices.toml"
    inventory.write_text(f'[devices.pi5]\nhost = "local"\npython = "{pi5}"\nworkdir = "{tmp_path}/pi5"\n')
    profiled = cli("profile", INT8, "--data", DIGITS, "--runs", "5", "--on", "pi5", "--inventory", inventory)
    assert profiled.exit_code == 0, profiled.output
    report = json.loads((tmp_path / "results" / "pi5" / "tiny_int8.profile.json").read_text())
    assert report["environment"]["machine"] == "aarch64" and report["model"]["scores"]["value"] > 0.9
    checked = cli("verify", INT8, "--data", DIGITS, "--on", "pi5", "--inventory", inventory, "--json", "v.json")
    assert checked.exit_code == 0, checked.output
    assert json.loads((tmp_path / "v.json").read_text())["devices"][0]["bit_exact"]


def test_devices_sharing_a_wheelhouse_get_the_wheels_uploaded_once_and_run_the_hosts_versions(cli, tmp_path):
    """Two devices whose Python sees no numpy/click/LiteRT (``-S``) name one wheelhouse: the
    first push uploads the dependency wheels there, the second finds them (sha256) and uploads
    none; both unpack them, and `devices check` finds the host's edgeq, numpy and LiteRT."""
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    house = tmp_path / "shared wheels"
    inventory = tmp_path / "devices.toml"
    inventory.write_text(
        "".join(
            f'[devices.{name}]\nhost = "local"\npython = "{bare}"\nworkdir = "{tmp_path / name}"\n'
            f'wheelhouse = "{house}"\n\n'
            for name in ("first", "second")
        )
    )
    before = cli("devices", "check", "all", "--inventory", inventory)
    assert before.exit_code == 0, before.output
    assert "DRIFT" in before.stdout and "numpy none" in before.stdout  # nothing there yet

    first = cli("push", INT8, "--to", "first", "--inventory", inventory)
    assert first.exit_code == 0, first.output
    shared = {p.name: p.stat().st_mtime_ns for p in house.glob("*.whl")}
    assert any(n.startswith("numpy-") for n in shared) and any(n.startswith("ai_edge_litert-") for n in shared)
    second = cli("push", INT8, "--to", "second", "--inventory", inventory)
    assert second.exit_code == 0, second.output
    assert {p.name: p.stat().st_mtime_ns for p in house.glob("*.whl")} == shared  # nothing uploaded again
    for name in ("first", "second"):
        assert "site, installed" in (first if name == "first" else second).stdout
        assert (tmp_path / name / "site" / "numpy").is_dir()
        own = [p.name for p in (tmp_path / name / "wheels").glob("*.whl")]
        assert len(own) == 1 and own[0].startswith("edgeq-"), own  # its edgeq build; the rest in the house

    after = cli("devices", "check", "all", "--inventory", inventory)
    assert after.exit_code == 0, after.output
    rows = [line for line in after.stdout.splitlines()[1:] if line.split()]
    assert len(rows) == 2 and all(row.rstrip().endswith("same") for row in rows), after.stdout


def test_a_wheelhouse_must_be_a_folder_of_its_own(tmp_path):
    from edgeq.errors import InventoryError
    from edgeq.fleet.inventory import load_inventory

    for bad in ("wheels", "/", "~", "/srv/../etc"):
        path = tmp_path / "devices.toml"
        path.write_text(f'[devices.d]\nhost = "local"\nwheelhouse = "{bad}"\n')
        with pytest.raises(InventoryError, match="wheelhouse"):
            load_inventory(path)


def test_the_host_keeps_only_the_last_few_source_builds(tmp_path, monkeypatch):
    """Every edit of a checkout is another source state and another cached edgeq wheel: a build
    prunes the cache to the KEEP_SOURCE_BUILDS most recently used, and a reused build counts as
    used. The dependency wheels beside them stay."""
    import time

    from edgeq.fleet import wheels

    monkeypatch.setattr(wheels, "WHEEL_CACHE", tmp_path / "wheels")
    old = []
    for i in range(6):  # six earlier source states, the first used longest ago
        folder = tmp_path / "wheels" / f"edgeq-src-{i:016x}"
        folder.mkdir(parents=True)
        (folder / "edgeq-0-py3-none-any.whl").write_bytes(b"an earlier build")
        os.utime(folder, (time.time() - 3600 + 60 * i,) * 2)
        old.append(folder)
    deps = tmp_path / "wheels" / "deps-x86_64-cp311-0123456789"
    deps.mkdir()
    os.utime(old[0], None)  # the oldest was used again just now

    built = wheels.build_wheel()
    assert built.is_file() and built.parent.name.startswith("edgeq-src-") and built.parent not in old
    kept = sorted(p.name for p in (tmp_path / "wheels").glob("edgeq-src-*"))
    assert kept == sorted([built.parent.name, old[0].name, old[5].name, old[4].name])
    assert wheels.KEEP_SOURCE_BUILDS == 4 and deps.is_dir()
    assert wheels.build_wheel() == built  # cached: nothing rebuilt, nothing pruned
    assert len(list((tmp_path / "wheels").glob("edgeq-src-*"))) == 4


def test_a_batch_percentage_rounds_up_to_one_device_and_the_budget_stops_the_rollout(cli, tmp_path):
    """--batch 10% of 9 devices is one device per batch, never all nine at once: with the first
    device broken and --max-fail 0, the other eight are left untouched (they all got the file before)."""
    from edgeq.fleet.rollout import Rollout

    assert [len(b) for b in Rollout(batch="10%").batches(list(range(9)))] == [1] * 9
    assert [len(b) for b in Rollout(batch="25%").batches(list(range(9)))] == [3, 3, 3]
    assert [len(b) for b in Rollout(batch="100%").batches(list(range(9)))] == [9]
    assert Rollout(max_fail="10%").budget(9) == 0  # a failure budget rounds down: 0.9 devices is none
    names = [f"pct{i}" for i in range(9)]
    inventory = _inventory(tmp_path, names, broken=(names[0],))
    result = cli("push", INT8, "--to", "all", "--inventory", inventory, "--batch", "10%", "--max-fail", "0")
    assert result.exit_code == 6, result.output
    assert list(_rows(result.stdout).values()) == ["failed"] + ["skipped"] * 8
    assert not any((tmp_path / n / "models").exists() for n in names[1:])


@pytest.mark.parametrize("max_fail, parallel", [("10%", "4"), ("0", "8")])
def test_max_fail_without_batch_starts_no_more_devices_than_the_budget_can_lose(cli, tmp_path, max_fail, parallel):
    """--max-fail means the same without --batch: 9 devices, the first broken, a budget of none
    (0, or 10% of 9 rounded down). Devices then go one at a time whatever --parallel says, so the
    first failure stops the rollout and the other eight are not attempted (before, all nine were
    pushed at once and the budget was never asked)."""
    names = [f"wave{i}" for i in range(9)]
    inventory = _inventory(tmp_path, names, broken=(names[0],))
    result = cli("push", INT8, "--to", "all", "--inventory", inventory, "--max-fail", max_fail, "-j", parallel)
    assert result.exit_code == 6, result.output
    assert list(_rows(result.stdout).values()) == ["failed"] + ["skipped"] * 8
    assert "rollout stopped: failed on 1 device(s) (wave0), over the --max-fail budget" in result.stderr
    assert "8 of 9 not attempted" in result.stderr
    assert "not attempted: the rollout stopped after 1 failed device(s)" in result.stdout
    assert not any((tmp_path / n / "models").exists() for n in names[1:])


@pytest.mark.parametrize("broken, statuses", [((0, 1, 2), ["failed"] * 2), ((0, 2), ["failed", "ok", "failed"])])
def test_max_fail_without_batch_keeps_what_can_fail_at_once_within_the_budget(cli, tmp_path, broken, statuses):
    """--max-fail 1 -j 8 without --batch: never more devices in flight than the failures still
    allowed plus one (two, then one after a failure), so the rollout stops at the second failure,
    whichever device finishes first, and the devices after it are untouched."""
    names = [f"win{i}" for i in range(9)]
    inventory = _inventory(tmp_path, names, broken=tuple(names[i] for i in broken))
    result = cli("push", INT8, "--to", "all", "--inventory", inventory, "--max-fail", "1", "-j", "8")
    assert result.exit_code == 6, result.output
    untouched = 9 - len(statuses)
    assert list(_rows(result.stdout).values()) == statuses + ["skipped"] * untouched
    assert f"{untouched} of 9 not attempted" in result.stderr
    assert not any((tmp_path / n / "models").exists() for n in names[len(statuses) :])


class _ReplyLostOnRename(LocalTransport):
    """The device renames the file, then the connection drops before the reply comes back."""

    def __init__(self, device, target_name):
        super().__init__(device)
        self.target_name, self.dropped = target_name, 0

    def rename(self, src, dst):
        super().rename(src, dst)
        if Path(dst).name == self.target_name and not self.dropped:
            self.dropped += 1
            from edgeq.errors import ConnectionLost

            raise ConnectionLost(f"{self.device.name}: connection reset after the rename")


def test_a_retried_upload_whose_rename_went_through_keeps_the_rollback_copy(tmp_path):
    """The retry reads the device again: the new file is live already, so it is not linked into
    .previous/ over the version it replaced, and --rollback restores that version (before, the
    retry linked the new model into .previous/ and "restored" it)."""
    from edgeq.fleet.push import push_files, rollback_files

    device = Device(name="flaky", host="local", workdir=str(tmp_path / "work"))
    old, new = tmp_path / "v1" / "m.tflite", tmp_path / "v2" / "m.tflite"
    for path, content in ((old, b"version one"), (new, b"version two")):
        path.parent.mkdir()
        path.write_bytes(content)
    models = tmp_path / "work" / "models"
    push_files(LocalTransport(device), [old], python=sys.executable)
    flaky = _ReplyLostOnRename(device, "m.tflite")
    records = push_files(flaky, [new], python=sys.executable, backoff_s=0.0)
    assert flaky.dropped == 1 and records[0].attempts == 2
    assert (models / "m.tflite").read_bytes() == b"version two"
    assert (models / ".previous" / "m.tflite").read_bytes() == b"version one"
    assert not list(models.glob(".m.tflite.part-*"))
    rollback_files(LocalTransport(device), ["m.tflite"])
    assert (models / "m.tflite").read_bytes() == b"version one"


def test_a_model_and_its_manifest_are_pushed_and_rolled_back_together(cli, tmp_path):
    """The manifest says how raw data is normalised for its model: push sends it with the model,
    and --rollback restores the pair, so a retrained model is never read with a stale manifest."""
    inventory = _inventory(tmp_path, ["pair"], broken=())
    models = tmp_path / "pair" / "models"
    first, second = tmp_path / "first" / "m.tflite", tmp_path / "second" / "m.tflite"
    for path, scale in ((first, 1 / 16), (second, 1 / 255)):
        path.parent.mkdir()
        path.write_bytes(INT8.read_bytes() + path.parent.name.encode())  # two versions of one model
        path.with_name("m.manifest.json").write_text(json.dumps({"normalization": {"scale": scale}}))
    assert cli("push", first, "--to", "pair", "--inventory", inventory).exit_code == 0
    assert json.loads((models / "m.manifest.json").read_text())["normalization"]["scale"] == 1 / 16
    assert cli("push", second, "--to", "pair", "--inventory", inventory).exit_code == 0
    assert (models / "m.tflite").read_bytes() == second.read_bytes()
    assert json.loads((models / "m.manifest.json").read_text())["normalization"]["scale"] == 1 / 255
    rolled = cli("push", "--rollback", "m.tflite", "--to", "pair", "--inventory", inventory)
    assert rolled.exit_code == 0, rolled.output
    assert (models / "m.tflite").read_bytes() == first.read_bytes()
    assert json.loads((models / "m.manifest.json").read_text())["normalization"]["scale"] == 1 / 16
    live = json.loads((models / ".edgeq-live.json").read_text())
    assert (
        live["m.manifest.json"]["sha256"] == hashlib.sha256(first.with_name("m.manifest.json").read_bytes()).hexdigest()
    )

    # a model pushed before it had a manifest: rolling back to it retires the newer manifest
    bare = tmp_path / "bare" / "b.tflite"
    bare.parent.mkdir()
    bare.write_bytes(INT8.read_bytes())
    assert cli("push", bare, "--to", "pair", "--inventory", inventory).exit_code == 0
    bare.write_bytes(INT8.read_bytes() + b"retrained")
    bare.with_name("b.manifest.json").write_text("{}")
    assert cli("push", bare, "--to", "pair", "--inventory", inventory).exit_code == 0
    assert (models / "b.manifest.json").is_file()
    assert cli("push", "--rollback", "b.tflite", "--to", "pair", "--inventory", inventory).exit_code == 0
    assert (models / "b.tflite").read_bytes() == INT8.read_bytes() and not (models / "b.manifest.json").exists()


def test_a_push_that_changes_nothing_is_one_command_and_the_health_check_rides_on_it(tmp_path, monkeypatch):
    """Remote commands per device, counted by the transport: a cold push bootstraps and uploads;
    the same push again reads the device's state in one command and stops there; a changed model
    goes the long way again; a hot device is refused from that same one read."""
    from edgeq.fleet.health import HealthLimits
    from edgeq.fleet.inventory import load_inventory
    from edgeq.fleet.remote import push_to

    inventory = _inventory(tmp_path, ["counted"], broken=())
    (device,) = load_inventory(inventory).select(["counted"])
    model = tmp_path / "m.tflite"
    model.write_bytes(INT8.read_bytes())
    cold = push_to(device, [model])
    assert [f.status for f in cold.files] == ["uploaded"] and cold.runtime.installed == "installed"
    again = push_to(device, [model], health=HealthLimits())
    assert [f.status for f in again.files] == ["unchanged"] and again.commands == 1, again
    assert again.runtime.python == cold.runtime.python and again.runtime.env == cold.runtime.env
    model.write_bytes(INT8.read_bytes() + b"retrained")
    changed = push_to(device, [model])  # state, upload (a file transfer), then one command makes it live
    assert [f.status for f in changed.files] == ["uploaded"] and changed.commands == 2, changed
    models = tmp_path / "counted" / "models"
    assert (models / "m.tflite").read_bytes() == model.read_bytes()
    assert (models / ".previous" / "m.tflite").read_bytes() == INT8.read_bytes()  # kept for --rollback
    live = json.loads((models / ".edgeq-live.json").read_text())["m.tflite"]
    assert live["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert live["previous_sha256"] == hashlib.sha256(INT8.read_bytes()).hexdigest()
    assert not list(models.glob(".*.part-*"))
    from edgeq.fleet.remote import ProfileOptions, profile_on

    profiled = profile_on(device, model, ProfileOptions(runs=3, warmup=1), tmp_path / "results")
    # the model is there: the state command, then one that makes the results folder and profiles
    assert profiled.commands == 2 and profiled.median_ms > 0, profiled.commands
    monkeypatch.setenv("EDGEQ_SYSFS", str(_fake_sysfs(tmp_path / "sys", 95000)))
    from edgeq.fleet.health import DeviceUnhealthy

    with pytest.raises(DeviceUnhealthy, match="95.0 °C"):
        push_to(device, [model], health=HealthLimits())
    print(
        f"remote commands per device: cold {cold.commands}, no-op {again.commands}, one new model "
        f"{changed.commands}, profile --on {profiled.commands}"
    )


def test_two_processes_filling_one_wheel_cache_folder_take_turns(tmp_path):
    """Two `edgeq push` runs (or test workers) downloading into one cache folder: the second waits
    for the first's lock instead of reading half-downloaded wheels. Checked without a clock: while
    this process holds the lock, another process's non-blocking try fails; after it, it succeeds."""
    from edgeq.artifacts import folder_lock

    folder = tmp_path / "wheels" / "cp311-aarch64"
    probe = (
        "import fcntl, sys\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    try:\n"
        "        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "    except BlockingIOError:\n"
        "        sys.exit(3)\n"
    )
    lock = f"{folder}.lock"
    with folder_lock(folder):
        held = subprocess.run([sys.executable, "-c", probe, lock])
    free = subprocess.run([sys.executable, "-c", probe, lock])
    assert (held.returncode, free.returncode) == (3, 0)


def test_a_commands_peak_rss_is_its_own_whatever_the_size_of_the_test_process(tmp_path):
    """Why test_fleet200 read 750 MiB in a full fleet run and 79 MiB alone (issue 42): wait4's
    ru_maxrss counts the RSS a child had before exec, a copy of the (grown) test process. The fleet
    benchmarks' peak RSS is the child's own VmHWM now: a 400 MiB test process does not show in it."""
    from .conftest import run_edgeq

    ballast = bytearray(400 * 1024 * 1024)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # touched: resident in this process
    code, _, peak_mib, out = run_edgeq("--version", cwd=tmp_path, log=tmp_path / "version.log")
    assert code == 0, out
    assert 5 < peak_mib < 300, peak_mib  # edgeq --version: tens of MiB; the test process: over 400
    del ballast
