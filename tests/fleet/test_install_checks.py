"""A bootstrap installs only wheels whose sha256 is the host's: the device-side checks, run here.

Both install paths check on the device, in the command that installs: a site install in
device.py's install-site (one Python start-up), a virtualenv install in the `sh` that runs pip.
A wheel that differs is removed (so the next push sends it again), named, and nothing changes.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile

import pytest

from edgeq.fleet.bootstrap import _CHECKED
from edgeq.fleet.device import install_site


def _wheel(path, module: str, text: str):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", text)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_install_site_refuses_a_wheel_whose_sha256_differs_and_removes_it(tmp_path):
    work = tmp_path / "work"
    (work / "versions").mkdir(parents=True)
    good, good_sha = _wheel(tmp_path / "good-1.0-py3-none-any.whl", "good", "x = 1\n")
    bad, _ = _wheel(tmp_path / "bad-1.0-py3-none-any.whl", "bad", "y = 2\n")
    record = json.dumps({"live": {"sha256": "d" * 64, "dir": "versions/dddd"}, "previous": None})
    files = [f"{good}={good_sha}", f"{bad}={'0' * 64}"]
    with pytest.raises(SystemExit, match=r"bad-1.0-py3-none-any.whl: sha256 .* != 0{64}; removed, push again"):
        install_site(str(work), "versions/dddd", ".marker", "d" * 64, f".edgeq-runtime.json={record}", files)
    assert not bad.exists() and good.exists()  # the wrong one goes, to be sent again
    assert not (work / "site").exists() and not (work / "versions" / "dddd").exists()  # nothing switched

    bad, bad_sha = _wheel(bad, "bad", "y = 2\n")  # sent again, right this time
    files = [f"{good}={good_sha}", f"{bad}={bad_sha}"]
    install_site(str(work), "versions/dddd", ".marker", "d" * 64, f".edgeq-runtime.json={record}", files)
    assert (work / "site" / "good" / "__init__.py").is_file() and (work / "site" / "bad" / "__init__.py").is_file()
    assert (work / "site" / ".marker").read_text().strip() == "d" * 64
    assert json.loads((work / ".edgeq-runtime.json").read_text()) == json.loads(record)


def test_the_pip_command_runs_only_after_every_wheel_checks_out(tmp_path):
    wheel, sha = _wheel(tmp_path / "w-1.0-py3-none-any.whl", "w", "")
    ran, mark = tmp_path / "ran", tmp_path / "marker"

    def run(files):
        env = ["env", f"MARK={mark}", "DIGEST=abc"]
        return subprocess.run(
            [*env, "sh", "-c", _CHECKED, "edgeq-install", *files, "--", "touch", str(ran)],
            capture_output=True,
            text=True,
        )

    refused = run([f"{wheel}={'1' * 64}"])
    assert refused.returncode == 3 and "sha256" in refused.stderr and "removed, push again" in refused.stderr
    assert not wheel.exists() and not ran.exists() and not mark.exists()

    wheel, sha = _wheel(wheel, "w", "")
    done = run([f"{wheel}={sha}"])
    assert done.returncode == 0, done.stderr
    assert ran.exists() and mark.read_text().strip() == "abc"
