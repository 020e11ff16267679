"""The package's layering, checked from the source: every import, module-level or lazy.

- A module imports only from its own layer or from layers below it.
- The device side (what `pip install "edgeq[litert]"` runs: profile, inspect, the runtime, the
  scripts run on devices) never imports TensorFlow, Keras, TF-MOT or a host stage.
- The fleet does not need TensorFlow either (`profile --on` from a machine without it), nor
  does the report (it is made from files).
- No import cycles between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "edgeq"

# Bottom to top. A module belongs to the entry that names it or, failing that, the nearest package above it.
LAYERS: list[tuple[str, ...]] = [
    ("edgeq.errors",),
    # numpy: numerics, range methods and observers, the plan file's format
    ("edgeq.quantize.numerics", "edgeq.quantize.ranges", "edgeq.quantize.plan_file", "edgeq.quantize.targets"),
    ("edgeq.tasks.metrics",),
    ("edgeq.tasks",),  # the task table, detection, verdicts
    ("edgeq.shims.litert",),
    ("edgeq.artifacts",),
    ("edgeq.runtime",),  # the device runtime: interpreter, flatbuffer, inputs, Edge TPU
    ("edgeq.models.spec",),  # ModelSpec: a model described once (a .tflite on the device too)
    ("edgeq.profile",),  # profile on the device: latency, memory, scores
    # ---- host side from here up: TensorFlow may be imported (through edgeq.models.compat)
    ("edgeq.models.names",),  # no TensorFlow: attribute reads of a Keras model
    ("edgeq.models.compat",),
    ("edgeq.shims.tflite", "edgeq.shims.tfmot"),
    # TF-MOT configs, below training, which wraps with them; the Keras 3 QAT engine's layers, below loading,
    # which registers them
    ("edgeq.quantize.configs", "edgeq.quantize.keras3_qat"),
    ("edgeq.data",),
    ("edgeq.models",),  # loading, Keras 3 translation
    ("edgeq.models.zoo",),
    ("edgeq.transforms",),
    ("edgeq.train",),
    ("edgeq.quantize",),  # the engine: calibration, PTQ, TFLite passes, mixed precision
    ("edgeq.evaluate",),
    ("edgeq.convert",),
    ("edgeq.analyze",),
    ("edgeq.fleet",),
    ("edgeq.report",),
    ("edgeq.optimize",),  # the ladder over convert, analyze and train; its folder's report
    # each command's module, in or beside its stage, over what they share (ui)
    ("edgeq.ui",),
    (
        "edgeq.data.cli",
        "edgeq.convert.cli",
        "edgeq.train.cli",
        "edgeq.evaluate.cli",
        "edgeq.analyze.cli",
        "edgeq.optimize.cli",
        "edgeq.profile.cli",
        "edgeq.report.cli",
        "edgeq.fleet.cli",
        "edgeq.runtime.cli",
    ),
    ("edgeq.cli", "edgeq.__main__", "edgeq.api"),
]
ROOTS = {"edgeq", "edgeq.shims"}  # `edgeq` holds __version__ and the public names (edgeq.api, loaded lazily)
HOST_FIRST = LAYERS.index(("edgeq.models.compat",))
HOST_STAGES_END = LAYERS.index(("edgeq.fleet",))
DEVICE_SIDE_EXTRA = (
    "edgeq.cli",
    "edgeq.__main__",
    "edgeq.ui",
    "edgeq.profile.cli",
    "edgeq.runtime.cli",
    "edgeq.fleet.device",
    "edgeq.fleet._probe",
    "edgeq.fleet.release",
    "edgeq.fleet.cli.release",
)
HEAVY = ("tensorflow", "tf_keras", "keras", "tensorflow_model_optimization", "ai_edge_quantizer", "litert_quantizer")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement, wherever it stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((base, node.lineno))
            # `from edgeq.x import y` may name a submodule y
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists():
                    found.append((candidate, node.lineno))
    return found


def layer_of(module: str) -> int | None:
    """The layer of the longest entry that is ``module`` or a package above it."""
    found = [
        (len(m), index)
        for index, members in enumerate(LAYERS)
        for m in members
        if module == m or module.startswith(m + ".")
    ]
    return max(found)[1] if found else None


def is_device_side(module: str) -> bool:
    rank = layer_of(module)
    return module in DEVICE_SIDE_EXTRA or module in ROOTS - {"edgeq.shims"} or (rank is not None and rank < HOST_FIRST)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def edges() -> dict[str, list[tuple[str, int]]]:
    """Every import between edgeq's modules, except the root's lazy facade: ``edgeq.__getattr__``
    imports edgeq.api when a public name is first read, never while a module is loading."""
    return {
        name: [
            (m, line)
            for m, line in imports_of(path)
            if (m == "edgeq" or m.startswith("edgeq.")) and not (name == "edgeq" and m == "edgeq.api")
        ]
        for name, path in MODULES.items()
    }


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if m not in ROOTS and layer_of(m) is None]
    assert not missing, f"modules outside every layer (add them to LAYERS): {missing}"


def layer_violations(graph) -> list[str]:
    bad = []
    for module, targets in graph.items():
        mine = layer_of(module)
        for target, line in targets:
            if target in ROOTS:
                continue
            theirs = layer_of(target)
            if mine is None or theirs is None or theirs > mine:
                bad.append(
                    f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {module} imports {target} (above it)"
                )
    return bad


def device_violations(modules) -> list[str]:
    """Imports of TensorFlow & co or of a host stage by the device side or the fleet."""
    bad = []
    for module, path in modules.items():
        if not (is_device_side(module) or module.startswith(("edgeq.fleet", "edgeq.report"))):
            continue
        for target, line in imports_of(path):
            rank = layer_of(target) if target.startswith("edgeq.") else None
            host_stage = rank is not None and HOST_FIRST <= rank < HOST_STAGES_END
            if target.split(".")[0] in HEAVY or host_stage:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {target}")
    return bad


def cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _ in graph.get(v, []):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return result


def test_layers_import_only_downward():
    assert layer_violations(edges()) == []


def test_device_side_never_imports_tensorflow_or_a_host_stage():
    assert device_violations(MODULES) == []


def test_no_import_cycles():
    assert cycles(edges()) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The checks themselves: a device module that imports TensorFlow, an upward import, a cycle."""
    fake = tmp_path / "edgeq" / "runtime"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    import tensorflow as tf\n    from edgeq.convert.run import convert\n")
    global PACKAGE, MODULES
    saved = PACKAGE, MODULES
    try:
        PACKAGE = tmp_path / "edgeq"
        MODULES = {"edgeq.runtime.bad": fake / "bad.py"}
        found = device_violations(MODULES)
        assert any("imports tensorflow" in line for line in found)
        assert any("imports edgeq.convert.run" in line for line in found)
        assert layer_violations({"edgeq.runtime.bad": [("edgeq.convert.run", 3)]})
    finally:
        PACKAGE, MODULES = saved
    assert cycles({"a": [("b", 1)], "b": [("a", 1)], "c": [("a", 1)]}) == [["a", "b"]]


def test_device_script_is_standalone():
    """fleet/device.py runs as `python -c` before edgeq is installed on the device."""
    path = PACKAGE / "fleet" / "device.py"
    tree = ast.parse(path.read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top_level if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "edgeq" or n.startswith("edgeq.")]


def test_no_import_statement_reaches_a_stage_through_a_public_name():
    """`edgeq.convert`, `edgeq.report` ... are the public functions, not the stage packages of the
    same names, so `import edgeq.report.figures as figures` would read the function's attribute:
    a stage's modules are imported with `from edgeq.<stage>(.x) import y`."""
    import edgeq

    public = set(edgeq.__all__) - {"__version__"}
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [
                    f"{name}:{node.lineno}: import {a.name}"
                    for a in node.names
                    if a.name.split(".")[:2][-1] in public and a.name.startswith("edgeq.")
                ]
    assert bad == []


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def oversized(modules) -> list[str]:
    """Modules over MAX_MODULE_LINES lines, functions over MAX_FUNCTION_LINES (def line to last line)."""
    bad = []
    for name, path in modules.items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            bad.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{name}.{node.name}: {length} lines")
    return bad


def test_no_room_over_600_lines_and_no_function_over_80():
    assert oversized(MODULES) == []


def test_the_size_check_catches_a_long_function_and_a_long_module(tmp_path):
    long_function = tmp_path / "f.py"
    long_function.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    long_module = tmp_path / "m.py"
    long_module.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    short = tmp_path / "s.py"
    short.write_text("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1))
    assert oversized({"f": long_function, "m": long_module, "s": short}) == ["f.f: 81 lines", "m: 601 lines"]
