"""A few hundred fuzz cases of tools/fuzz.py: mutated .tflite, .npz, inventory, task, plan, report
and release files are read or refused with an edgeq error, never a traceback, a crash or a half-written
device. Thousands per kind: tools/bench.py."""

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import fuzz  # noqa: E402


def test_mutated_files_get_an_edgeq_error_never_a_traceback_or_crash():
    result = fuzz.fuzz(400, seed=1)  # 50 of each kind of file
    assert result["cases"] == 400
    assert result["crashes"] == [] and result["tracebacks"] == [] and result["multiline_errors"] == [], result
    assert result["partial_writes"] == [], result  # a refused pull leaves the device as it was
    assert result["reads_accepted"] > 0  # some mutants still load: the readers behind the checks are reached


def test_mutated_model_on_the_command_line_is_one_error_line(tmp_path):
    """What a user sees: `edgeq inspect` and `edgeq profile` on a damaged file print one `error:` line."""
    data = (ROOT / "tests" / "data" / "tiny_int8.tflite").read_bytes()
    seen_errors = 0
    for case in range(6):
        path = tmp_path / f"m{case}.tflite"
        path.write_bytes(fuzz.mutate(data, np.random.default_rng([7, case])))
        for command in (["inspect"], ["profile", "--runs", "1", "--warmup", "0"]):
            proc = subprocess.run(
                [sys.executable, "-m", "edgeq", command[0], str(path), *command[1:]],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            assert proc.returncode in (0, 1, 2, 3, 4, 5), proc.stderr
            assert "Traceback" not in proc.stderr
            if proc.returncode:
                lines = [line for line in proc.stderr.splitlines() if line.strip()]
                assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
                seen_errors += 1
    assert seen_errors > 0
