"""The public Python API: edgeq.train, .convert, .evaluate, .analyze, .profile, .push, .verify, .report."""

import inspect
import json
import os
import subprocess
import sys

import pytest

import edgeq

PUBLIC = ("train", "convert", "evaluate", "analyze", "optimize", "profile", "push", "verify", "report")


def test_every_public_name_is_a_documented_typed_function():
    assert set(PUBLIC) <= set(edgeq.__all__) and set(PUBLIC) <= set(dir(edgeq))
    for name in PUBLIC:
        function = getattr(edgeq, name)
        assert inspect.isfunction(function), name
        doc = inspect.getdoc(function)
        assert "Args:" in doc and "Returns:" in doc and "Raises:" in doc, name
        signature = inspect.signature(function)
        assert signature.return_annotation is not inspect.Signature.empty, name
        assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values()), name
    with pytest.raises(AttributeError):
        edgeq.no_such_stage  # noqa: B018


def test_importing_edgeq_and_its_names_loads_no_stage_and_no_tensorflow():
    """`import edgeq` and reading its names import nothing heavy; fd 2 is left alone."""
    code = (
        "import os, sys, json\n"
        "before = os.fstat(2).st_ino\n"
        "import edgeq\n"
        "names = [getattr(edgeq, n) for n in edgeq.__all__ if n != '__version__']\n"
        "heavy = [m for m in ('tensorflow', 'tf_keras', 'keras', 'edgeq.convert.run', 'edgeq.train',"
        " 'edgeq.models.compat') if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'fd2': os.fstat(2).st_ino == before}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"heavy": [], "fd2": True}


def test_a_library_import_of_tensorflow_leaves_stderr_alone():
    """Only the edgeq command silences TensorFlow's start-up (fd 2 to /dev/null while it loads);
    a program that imports edgeq's host side keeps its own stderr."""
    code = (
        "import os, sys\n"
        "redirected = []\n"
        "real = os.dup2\n"
        "os.dup2 = lambda a, b, *k: (redirected.append(b), real(a, b, *k))[1]\n"
        "import edgeq.models.compat\n"
        "print(2 in redirected)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEQ_QUIET_TF", "EDGEQ_VERBOSE")}
    library = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert library.stdout.strip() == "False"
    command = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env | {"EDGEQ_QUIET_TF": "1"}
    )
    assert command.stdout.strip() == "True"


def test_the_api_runs_a_stage_like_the_cli(digits_run, tmp_path):
    """edgeq.convert and edgeq.evaluate take what their commands take and return their results."""
    result = edgeq.convert(digits_run.qat_model, tmp_path / "m.tflite", mode="int8-only")
    assert result.path.is_file() and result.verification.passed
    evaluated = edgeq.evaluate(result.path, digits_run.fp32_model, "digits", max_drop_pp=2.0)
    assert evaluated.worse_by <= 2.0
    profiled = edgeq.profile(result.path, runs=3)
    assert profiled.model.runs[0].latency.median_ms > 0
    with pytest.raises(edgeq.errors.UsageError, match="unknown option"):
        edgeq.train("digits-cnn", data="digits", out_dir=tmp_path / "x", epoch=3)


def test_public_names_stay_functions_beside_their_stage_packages():
    """`edgeq.convert` is the function, also after `edgeq/convert/` (the package) is imported."""
    code = (
        "import json, edgeq, inspect\n"
        "from edgeq.convert.options import MODES\n"
        "from edgeq.train import cli; from edgeq.evaluate import cli; from edgeq.analyze import cli\n"
        "from edgeq.profile import cli; from edgeq.report import cli\n"
        "from edgeq import convert\n"
        "names = ('convert', 'train', 'evaluate', 'analyze', 'profile', 'report')\n"
        "print(json.dumps({'functions': [inspect.isfunction(getattr(edgeq, n)) for n in names],\n"
        "                  'same': convert is edgeq.api.convert, 'modes': bool(MODES)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"functions": [True] * 6, "same": True, "modes": True}
