"""The fleet at 50 devices, over real SSH (EDGEQ_SLOW=1; about 8 minutes on 2 cores).

Each device is an OpenSSH sshd of its own on a loopback port, with its own host key and
work folder, so one device can die without the others noticing. Half are virtualenv
devices, half run edgeq from unpacked wheels (site mode). No device can reach a package
index (tests/fleet/conftest.py NO_INDEX); all of them name one wheelhouse, so the
dependency wheels are uploaded once and installed 50 times.

What it shows, in the order it runs:

1. ``push`` + ``profile --on all`` from a cold start: all 50 ok, each with the host's
   versions, wall time and the host process's peak RSS printed (BENCHMARKS.md).
2. a second ``push`` of the same files: nothing uploaded, nothing installed (one remote
   command per device); then a rollout to the warm fleet: a retrained model pushed and
   profiled on all 50 (BENCHMARKS.md: under 100 s).
3. ``--batch 10 --max-fail 10%`` with 8 broken devices in the first batch: the rollout
   stops, the other 40 are listed as skipped and untouched (exit 6).
4. 5 devices die while they profile (their sshd and every session killed from inside the
   run, by the device's own Python when it is asked to run `edgeq profile`): those 5 fail
   and are named, 45 finish (exit 5).
"""

from __future__ import annotations

import json

import pytest

from .conftest import DIGITS, HOST_CPU, INT8, free_port, host_python, loopback_fleet
from .conftest import run_edgeq as _edgeq
from .conftest import summary_rows as _rows

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fleet_env")]

N = 50
VICTIMS = ("dev01", "dev11", "dev21", "dev31", "dev41")  # site devices that die mid-profile
BROKEN = tuple(f"dev{i:02d}" for i in range(8))  # step 3: unreachable (a port nothing listens on)

# Run by a victim's Python instead of `edgeq profile`: kills the device's sshd and every
# process it forked (this one included), as a device losing power does.
KILL_DEVICE = """
import os, signal, sys
pid = int(open(sys.argv[1]).read())
children = {}
for entry in os.listdir("/proc"):
    if entry.isdigit():
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
victims, todo = [pid], [pid]
while todo:
    for child in children.get(todo.pop(), []):
        victims.append(child)
        todo.append(child)
for victim in victims:  # the listener first, so nothing reconnects; this process last
    if victim != os.getpid():
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def fifty(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet50")
    python = host_python()

    def device_python(name: str) -> str:
        if name not in VICTIMS:
            return python
        kill = root / name / "kill_device.py"
        kill.write_text(KILL_DEVICE)
        wrapper = root / name / "python"
        wrapper.write_text(
            "#!/bin/sh\n"
            f'if [ -e "{root / "armed"}" ]; then case " $* " in\n'
            f'  *" edgeq profile "*) exec "{python}" "{kill}" "{root / name / "sshd" / "sshd.pid"}" ;;\n'
            "esac; fi\n"
            f'exec "{python}" "$@"\n'
        )
        wrapper.chmod(0o755)
        return str(wrapper)

    names = [f"dev{i:02d}" for i in range(N)]
    with loopback_fleet(root, names, device_python, venvs=names[::2]) as (inventory, servers):
        yield root, inventory, servers


def test_fifty_devices_push_profile_budget_and_dead_devices(fifty, tmp_path):
    root, inventory, servers = fifty
    work = tmp_path / "host"
    work.mkdir()
    common = ["--inventory", inventory, "--parallel", "8"]
    numbers = {}

    # 1. cold start: every device bootstraps (25 venvs, 25 sites) from the one wheelhouse
    code, push_s, push_rss, out = _edgeq("push", INT8, DIGITS, "--to", "all", *common, cwd=work, log=root / "1.log")
    assert code == 0, out[-3000:]
    rows = _rows(out, "device")
    assert len(rows) == N and all(r[1] == "ok" for r in rows.values()), out[-3000:]
    modes = [" ".join(r[4:6]) for r in rows.values()]
    assert modes.count("venv, installed") == N // 2 and modes.count("site, installed") == N // 2, modes
    for mode in ("venv", "site"):  # one device's push, bootstrap included, at --parallel 8
        seconds = [float(r[6]) for r in rows.values() if r[4] == f"{mode},"]
        numbers[f"{mode}_device_push_mean_s"] = sum(seconds) / len(seconds)
    code, profile_s, profile_rss, out = _edgeq(
        "profile", INT8, "--data", DIGITS, "--runs", "20", "--on", "all", *common, cwd=work, log=root / "2.log"
    )
    assert code == 0, out[-3000:]
    for i in range(N):
        report = json.loads((work / "results" / f"dev{i:02d}" / "tiny_int8.profile.json").read_text())
        assert report["model"]["scores"]["value"] > 0.9
    numbers |= {"cold_push_s": push_s, "profile_s": profile_s, "cold_total_s": push_s + profile_s}
    numbers |= {"push_peak_rss_mib": push_rss, "profile_peak_rss_mib": profile_rss}
    numbers |= {"push_host_cpu_s": HOST_CPU["1"], "profile_host_cpu_s": HOST_CPU["2"]}
    uploaded = sorted(p.name for p in (root / "wheelhouse").glob("*.whl"))
    assert any(n.startswith("ai_edge_litert-") for n in uploaded)

    code, _, _, out = _edgeq("devices", "check", "all", *common, cwd=work, log=root / "3.log")
    assert code == 0, out[-3000:]
    checked = _rows(out, "device")
    assert len(checked) == N and all(r[-1] == "same" for r in checked.values()), out[-3000:]

    # 2. the same files again: nothing to send, nothing to install
    code, again_s, _, out = _edgeq("push", INT8, DIGITS, "--to", "all", *common, cwd=work, log=root / "4.log")
    assert code == 0, out[-3000:]
    for row in _rows(out, "device").values():
        assert row[1:4] == ["ok", "0", "2"] and row[5] == "unchanged", row
    numbers |= {"second_push_s": again_s, "second_push_host_cpu_s": HOST_CPU["4"]}

    # 2b. a rollout to the warm fleet: a retrained model pushed, then profiled, on all 50
    retrained = tmp_path / "new" / INT8.name
    retrained.parent.mkdir()
    retrained.write_bytes(INT8.read_bytes() + b"retrained")  # a trailing byte: the same graph, another file
    code, update_s, _, out = _edgeq("push", retrained, "--to", "all", *common, cwd=work, log=root / "4b.log")
    assert code == 0 and all(r[1:3] == ["ok", "1"] for r in _rows(out, "device").values()), out[-3000:]
    code, warm_profile_s, _, out = _edgeq(
        "profile", retrained, "--data", DIGITS, "--runs", "20", "--on", "all", *common, cwd=work, log=root / "4c.log"
    )
    assert code == 0, out[-3000:]
    numbers |= {"update_push_s": update_s, "warm_profile_s": warm_profile_s, "rollout_s": update_s + warm_profile_s}

    # 3. a failure budget: 8 broken devices in the first batch of 10, --max-fail 10% (5)
    broken = root / "broken.toml"
    text = inventory.read_text()
    for name in BROKEN:
        head = f"[devices.{name}]\n"
        block = text[text.index(head) :].split("\n\n")[0]
        port_line = next(line for line in block.splitlines() if line.startswith("port = "))
        text = text.replace(block, block.replace(port_line, f"port = {free_port()}"))  # nothing listens
    broken.write_text(text)
    marker = tmp_path / "budget.txt"
    marker.write_text("budget\n")
    code, _, _, out = _edgeq(
        "push", marker, "--to", "all", "--inventory", broken, "--parallel", "8", "--batch", "10", "--max-fail", "10%",
        cwd=work, log=root / "5.log",
    )  # fmt: skip
    assert code == 6, out[-3000:]
    rows = _rows(out, "device")
    assert sorted(n for n, r in rows.items() if r[1] == "failed") == sorted(BROKEN)
    skipped = [n for n, r in rows.items() if r[1] == "skipped"]
    assert len(skipped) == N - 10
    for name in skipped:  # untouched: the new file never reached them
        assert not (root / name / "home" / "edgeq" / "models" / "budget.txt").exists()

    # 4. five devices die while they profile; the other 45 finish
    (root / "armed").write_text("the victims' Python kills its device at `edgeq profile`\n")
    code, _, _, out = _edgeq(
        "profile", INT8, "--data", DIGITS, "--runs", "20", "--on", "all", *common, cwd=work, log=root / "6.log"
    )
    assert code == 5, out[-3000:]
    rows = _rows(out, "device")
    failed = sorted(n for n, r in rows.items() if r[1] != "ok")
    assert failed == sorted(VICTIMS), out[-3000:]
    assert all(servers[name].proc.poll() is not None for name in VICTIMS)  # really gone
    last = [line for line in out.splitlines() if line.strip()][-1]
    assert "failed on 5 of 50" in last and all(name in last for name in VICTIMS), last
    assert "Traceback" not in out

    print("\nFLEET50 " + json.dumps({k: round(v, 1) for k, v in numbers.items()}))
