"""The fleet code never pulls in TensorFlow; the device-side helpers not even paramiko."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _loaded(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_fleet_commands_do_not_import_tensorflow():
    out = _loaded(
        "import sys\n"
        "import edgeq.fleet.cli.devices, edgeq.fleet.cli.push, edgeq.fleet.cli.verify, edgeq.profile.cli\n"
        "import edgeq.fleet.remote, edgeq.fleet.transport, edgeq.fleet.bootstrap, edgeq.fleet.inventory\n"
        "print('TF' if 'tensorflow' in sys.modules else 'NO_TF')\n"
    )
    assert "NO_TF" in out


def test_device_side_needs_no_paramiko():
    out = _loaded(
        "import sys\nimport edgeq.fleet, edgeq.fleet.device\n"
        "print('PARAMIKO' if 'paramiko' in sys.modules else 'NO_PARAMIKO')\n"
    )
    assert "NO_PARAMIKO" in out


def test_example_inventory_loads():
    from edgeq.fleet.inventory import load_inventory

    inventory = load_inventory(ROOT / "deploy" / "devices.example.toml")
    assert {"pi4-desk", "pi5-lab", "coral-devboard"} <= set(inventory.names())
    assert [d.name for d in inventory.select("tag:coral")] == ["coral-devboard"]
