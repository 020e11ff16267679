"""Work on many devices at once: check, push, profile and verify over SSH.

Each device runs in its own worker (at most ``parallel`` at a time); a device that fails
is recorded with its error and the others go on. Results come back as frozen dataclasses;
``on_event(device_name, message)`` reports progress for the CLI to show.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgeq.errors import DeviceError, EdgeqError, FleetInterrupted
from edgeq.fleet.bootstrap import ensure_runtime, rollback_runtime, runtime_layout
from edgeq.fleet.connection import connect
from edgeq.fleet.health import DeviceUnhealthy, HealthLimits, check_health
from edgeq.fleet.inventory import Device
from edgeq.fleet.probe import DeviceRuntime, Probe, probe
from edgeq.fleet.push import FileTransfer, Rollback, push_files, rollback_files, upload_and_commit, with_manifests
from edgeq.fleet.rollout import Rollout
from edgeq.fleet.transport import CANCEL, Transport, confine
from edgeq.tasks.metrics import top1_agreement

log = logging.getLogger(__name__)

Event = Callable[[str, str], None]
PROFILE_TIMEOUT_S = 3600


@dataclass(frozen=True)
class DeviceOutcome:
    """What happened on one device: ``status`` is "ok" or "failed" (then ``error`` says why)."""

    device: str
    status: str
    seconds: float
    error: str | None = None
    result: Any = None


@dataclass(frozen=True)
class ProfileOptions:
    """``edgeq profile`` options to run on the device (files are pushed first)."""

    threads: str = "1"
    runs: int = 50
    warmup: int = 5
    min_seconds: float = 0.0
    data: str | None = None
    labels: str | None = None
    delegate: str = "xnnpack"
    runtime: str | None = None
    compare: str | None = None


@dataclass(frozen=True)
class PushSummary:
    runtime: DeviceRuntime
    files: tuple[FileTransfer, ...]
    commands: int = 0  # commands run on the device for this push (each a shell there, a round trip here)


@dataclass(frozen=True)
class RemoteProfile:
    """One device's profile: the JSON it wrote, now at ``local_json`` on this host."""

    local_json: Path
    machine: str
    runtime: str
    mean_ms: float
    median_ms: float
    value: float | None  # the first output's task metric (``metric``: accuracy, rmse, auc, map50)
    push: PushSummary
    report: dict = field(repr=False, default_factory=dict)
    commands: int = 0  # commands run on the device, the push's included, up to the profile's own
    metric: str | None = None


@dataclass(frozen=True)
class VerifyResult:
    """Host interpreter vs device on the same (already quantized) inputs."""

    samples: int
    bit_exact: bool
    max_abs_diff: float  # in the output's own units (integer steps for int8 outputs)
    max_abs_diff_float: float  # after dequantization
    top1_agreement: float | None  # the first class output's (None: no output of the model is classes)
    output_dtype: str
    device_machine: str
    device_runtime: str
    host_runtime: str
    outputs: tuple[dict, ...] = ()  # each output by name: bit_exact, max_abs_diff, top1_agreement


def _noop(device: str, message: str) -> None:
    pass


def for_each_device(
    devices: Sequence[Device],
    work: Callable[[Device, Event], Any],
    *,
    parallel: int = 4,
    on_event: Event | None = None,
    rollout: Rollout | None = None,
) -> list[DeviceOutcome]:
    """Run ``work(device, on_event)`` on every device, failures contained, batch by batch.

    Without ``rollout.batch``, a failure budget (``rollout.max_fail``) still holds: no more
    devices run at once than it can lose. Outcomes come back in the devices' order; a device
    that a stopped rollout never reached is "skipped". Ctrl-C stops the running commands
    (remote process groups killed) and raises FleetInterrupted naming the devices that finished.
    """
    on_event = on_event or _noop
    rollout = rollout or Rollout(parallel=parallel)
    budget = rollout.budget(len(devices))

    # --max-fail without --batch: never more devices in flight than the failures the budget still
    # allows plus one, so a rollout overshoots its budget by one failed device at most, as batches
    # of one would (a budget of 0 goes one device at a time), and each device that finishes lets
    # the next one start. With --batch, the budget is asked between batches only.
    windowed = budget is not None and rollout.batch is None

    def room(failed: int) -> int:  # how many devices may be in flight
        return min(rollout.parallel, budget - failed + 1) if windowed else len(devices)

    CANCEL.clear()
    found: dict[int, DeviceOutcome] = {}  # by the device's index, as they finish
    running: dict[Future, int] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, min(rollout.parallel, len(devices))))
    try:
        first = 0
        for batch in rollout.batches(devices):
            queue = list(range(first, first + len(batch)))
            first += len(batch)
            while queue or running:
                failed = sum(o.status in ("failed", "unhealthy") for o in found.values())
                if budget is not None and failed > budget and queue:
                    reason = f"not attempted: the rollout stopped after {failed} failed device(s) (--max-fail "
                    reason += f"{rollout.max_fail})"
                    for index in queue:
                        on_event(devices[index].name, "skipped (rollout stopped)")
                        found[index] = DeviceOutcome(devices[index].name, "skipped", 0.0, reason)
                    queue = []  # what was started still finishes
                while queue and len(running) < room(failed):
                    index = queue.pop(0)
                    running[pool.submit(_run_one, devices[index], work, on_event)] = index
                if not running:
                    continue
                # a batch is waited for whole; the window, for its first device to finish
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED if windowed else ALL_COMPLETED)
                for future in finished:
                    index = running.pop(future)
                    found[index] = future.result()
    except KeyboardInterrupt:
        raise _interrupted(pool, running, found, len(devices)) from None
    finally:
        pool.shutdown(wait=False)
        CANCEL.clear()
    return [found[i] for i in range(len(devices))]


def _run_one(device: Device, work: Callable[[Device, Event], Any], on_event: Event) -> DeviceOutcome:
    """Run ``work`` on one device and record how it went: one broken device must not stop the fleet."""
    start = time.monotonic()
    try:
        result = work(device, on_event)
    except DeviceUnhealthy as exc:
        on_event(device.name, f"skipped: {exc}")
        return DeviceOutcome(device.name, "unhealthy", time.monotonic() - start, str(exc))
    except EdgeqError as exc:
        on_event(device.name, f"failed: {exc}")
        return DeviceOutcome(device.name, "failed", time.monotonic() - start, str(exc))
    except Exception as exc:  # one broken device must not stop the fleet
        log.exception("%s: unexpected failure", device.name)
        message = f"{type(exc).__name__}: {exc}"
        on_event(device.name, f"failed: {message}")
        return DeviceOutcome(device.name, "failed", time.monotonic() - start, message)
    on_event(device.name, f"done in {time.monotonic() - start:.1f} s")
    return DeviceOutcome(device.name, "ok", time.monotonic() - start, None, result)


def _interrupted(
    pool: ThreadPoolExecutor, running: dict[Future, int], found: dict[int, DeviceOutcome], total: int
) -> FleetInterrupted:
    """Stop the fleet on Ctrl-C and the error that says so, naming the devices that finished."""
    # Ctrl-C: every running command kills its remote process group and stops; devices
    # not started yet are not touched; what finished is listed.
    CANCEL.set()
    for future in running:
        future.cancel()
    pool.shutdown(wait=True)
    finished = list(found.values()) + [f.result() for f in running if f.done() and not f.cancelled()]
    done = [o.device for o in finished if o.status == "ok"]
    return FleetInterrupted(
        f"interrupted: remote commands stopped; finished on {len(done)} of {total} device(s)"
        + (f": {', '.join(done)}" if done else "")
    )


def check_device(device: Device, on_event: Event = _noop) -> Probe:
    """Connect and report what the device has (arch, OS, Python, runtime, disk, Edge TPU)."""
    on_event(device.name, "connecting")
    with connect(device) as transport:
        python, env = device.python, None
        if device.venv:
            venv_python = f"{transport.expand(device.venv).rstrip('/')}/bin/python"
            if transport.run(["test", "-x", venv_python], timeout=60).ok:
                python = venv_python
        else:
            site = confine(transport.expand(device.workdir), "site")
            env = {"PYTHONPATH": site}
        return probe(transport, python, env=env)


def push_to_device(
    transport: Transport,
    files: Sequence[str | Path],
    on_event: Event = _noop,
    *,
    wheel: str | Path | None = None,
    wheels_dir: str | Path | None = None,
    state=None,
) -> PushSummary:
    """Bootstrap the device if needed, then upload ``files`` to WORKDIR/models.

    ``state``: the push's first read (edgeq.fleet.state). With it, the bootstrap reads nothing
    again, and the files go up in one commit (upload_and_commit) unless an interrupted upload
    is there to clean up, which push_files does, file by file.
    """
    name = transport.device.name
    on_event(name, "bootstrap")
    runtime = ensure_runtime(transport, wheel=wheel, wheels_dir=wheels_dir, state=state)
    if runtime.installed == "installed":
        on_event(name, f"installed edgeq ({runtime.mode})")
    files = with_manifests(list(files))  # a model and its manifest are one unit on the device
    on_event(name, f"pushing {len(files)} file(s)")
    if not files:
        return PushSummary(runtime, ())
    if state is not None and not state.leftover:
        made = state.models_dir or runtime.installed == "installed"  # an install's probe makes WORKDIR/models
        try:
            return PushSummary(
                runtime, tuple(upload_and_commit(transport, files, state.sha256, dict(state.live), made))
            )
        except EdgeqError as exc:  # e.g. a corrupted upload: the careful path retries file by file
            log.warning("%s: %s; pushing file by file", name, exc)
    return PushSummary(runtime, tuple(push_files(transport, files, python=runtime.python)))


def push_to(
    device: Device,
    files: Sequence[str | Path],
    on_event: Event = _noop,
    health: HealthLimits | None = None,
    **kwargs,
) -> PushSummary:
    """Push ``files`` (each model with its manifest) and this checkout's edgeq to ``device``.

    The first command reads the device's whole state (edgeq.fleet.state: health, the edgeq
    build it runs, each file's sha256, the live record); a push that would change nothing is
    done there, in that one command.
    """
    on_event(device.name, "connecting")
    with connect(device) as transport:
        return _push(transport, files, on_event, health, **kwargs)


def _push(transport: Transport, files, on_event: Event, health: HealthLimits | None, **kwargs) -> PushSummary:
    """One state command first. Where edgeq is current, only the changed files are uploaded and
    one more command makes them live (none when nothing changed); edgeq to install, or an
    interrupted upload to clean up, takes the bootstrap and the careful path."""
    device = transport.device
    files = with_manifests(list(files)) if files else []
    state, current = _current_state(transport, files, health, kwargs.get("wheel"))
    if current:
        try:
            records = upload_and_commit(transport, files, state.sha256, dict(state.live), state.models_dir)
        except EdgeqError as exc:  # e.g. a corrupted upload: the careful path retries file by file
            log.warning("%s: %s; pushing file by file", device.name, exc)
        else:
            uploaded = sum(r.status == "uploaded" for r in records)
            on_event(device.name, f"pushed {uploaded} file(s)" if uploaded else "up to date")
            runtime, _ = runtime_layout(device, expand=transport.expand)
            return PushSummary(runtime, tuple(records), transport.commands)
    # a fast path that failed goes the careful way (its state may be what failed); else the bootstrap
    # and the commit reuse what the first read found
    summary = push_to_device(transport, files, on_event, state=None if current else state, **kwargs)
    return dataclasses.replace(summary, commands=transport.commands)


def _current_state(transport: Transport, files: list[Path], health: HealthLimits | None, wheel):
    """The device's state, read in one command (edgeq.fleet.state), and whether it is current:
    it runs this edgeq build and holds no interrupted upload. A failed health check raises
    DeviceUnhealthy from that same read."""
    from edgeq.fleet.bootstrap import wheel_digest
    from edgeq.fleet.push import safe_name
    from edgeq.fleet.state import read_state

    device = transport.device
    _, marker = runtime_layout(device, expand=lambda path: path)  # ~ is expanded on the device
    state = read_state(transport, device.workdir, marker, [safe_name(Path(f).name) for f in files])
    if state.home.startswith("/"):
        transport.home = state.home
    if health is not None:
        need = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
        check_health(transport, device.workdir, health, need, state.health)
    current = state.marker is not None and state.marker == wheel_digest(wheel) and not state.leftover
    return state, current


def rollback_on(device: Device, names: Sequence[str], on_event: Event = _noop, runtime: bool = False) -> list[Rollback]:
    """`push --rollback`: the previous version of each named file (and with ``runtime``, of
    the edgeq runtime) becomes live again."""
    on_event(device.name, "connecting")
    with connect(device) as transport:
        done = []
        if runtime:
            on_event(device.name, "rolling back the edgeq runtime")
            done.append(rollback_runtime(transport))
        if names:
            on_event(device.name, f"rolling back {len(names)} file(s)")
            done += rollback_files(transport, [Path(n).name for n in names])
        return done


def _remote_path(pushed: PushSummary, local: str | Path) -> str:
    name = Path(local).name
    for record in pushed.files:
        if record.name == name:
            return record.remote_path
    raise DeviceError(f"{local} was not pushed")  # pragma: no cover


def profile_on(
    device: Device,
    model: str | Path,
    options: ProfileOptions,
    results_dir: str | Path,
    on_event: Event = _noop,
    health: HealthLimits | None = None,
) -> RemoteProfile:
    """Push the model (and --compare/--data files), run ``edgeq profile`` there, fetch the JSON."""
    files = [Path(model)] + [Path(p) for p in (options.compare, options.data) if p]
    on_event(device.name, "connecting")
    with connect(device) as transport:
        pushed = _push(transport, files, on_event, health)
        runtime = pushed.runtime
        remote_model = _remote_path(pushed, model)
        stem = Path(model).stem
        results_remote = confine(runtime.workdir, "results")
        remote_json = confine(results_remote, f"{stem}.profile.json")
        args = ["profile", remote_model, "--threads", options.threads, "--runs", str(options.runs)]
        args += ["--warmup", str(options.warmup), "--min-seconds", str(options.min_seconds)]
        args += ["--delegate", options.delegate, "--json", remote_json, "--no-progress"]
        if options.compare:
            args += ["--compare", _remote_path(pushed, options.compare)]
        if options.data:
            args += ["--data", _remote_path(pushed, options.data)]
        if options.labels:
            args += ["--labels", options.labels]
        if options.runtime or device.runtime:
            args += ["--runtime", options.runtime or device.runtime]
        on_event(device.name, "profiling")
        # the results folder is made by the same command that profiles: one shell, one Python start-up
        argv = ["sh", "-c", 'mkdir -p -- "$0" && exec "$@"', results_remote, *runtime.argv(*args)]
        result = transport.run(argv, env=runtime.env, cwd=runtime.workdir, timeout=PROFILE_TIMEOUT_S)
        if not result.ok:
            raise DeviceError(f"{device.name}: edgeq profile failed: {result.last_error_line()}")
        commands = transport.commands
        local = Path(results_dir) / device.name / f"{stem}.profile.json"
        on_event(device.name, "fetching results")
        transport.download(remote_json, local)
        report = json.loads(local.read_text(encoding="utf-8"))
        detection = ((report.get("model") or {}).get("scores") or {}).get("detection")
        if detection and detection.get("map50") is None and options.data:
            # the device decoded its own outputs; pycocotools scores them here, against the same file's boxes
            found = confine(results_remote, f"{stem}.profile.detections.npz")
            local_found = local.with_name(f"{stem}.profile.detections.npz")
            transport.download(found, local_found)
            report = _score_device_detections(report, local_found, options.data)
            from edgeq.artifacts import write_json_atomic

            write_json_atomic(local, report)
    run = report["model"]["runs"][0]["latency"]
    scored = report["model"].get("scores") or {}
    env = report["environment"]
    return RemoteProfile(
        local_json=local,
        machine=env["machine"],
        runtime=f"{env['runtime']} {env['runtime_version']}",
        mean_ms=float(run["mean_ms"]),
        median_ms=float(run["median_ms"]),
        value=scored.get("value"),
        push=pushed,
        report=report,
        commands=commands,
        metric=scored.get("metric") or ("map50" if scored.get("detection") else "accuracy"),
    )


def _score_device_detections(report: dict, detections_file: Path, data: str | Path) -> dict:
    """The device's decoded detections scored by pycocotools on this host (COCO mAP)."""
    from edgeq.profile.run import read_detections
    from edgeq.runtime.inputs import read_npz
    from edgeq.tasks.detection import mean_average_precision

    arrays = read_npz(data)
    scores = report["model"]["scores"]
    spec = scores["detection"]
    x = next(v for k, v in arrays.items() if k == "x" or k.startswith("x_"))
    size = tuple(int(d) for d in x.shape[1:3])
    found = mean_average_precision(
        read_detections(detections_file), arrays["gt_boxes"], arrays["gt_classes"], size, int(spec["classes"])
    )
    scores["detection"] = {**spec, **found, "scored_by": "pycocotools on the host, from the device's detections"}
    scores["value"] = found["map50"]
    return report


def quantized_inputs(model, data: str | Path, inputs: str = "x", limit: int | None = None) -> dict[str, np.ndarray]:
    """The inputs of ``data`` in each model input's dtype, by input name, exactly as both sides will see them.

    Read by the input contract (edgeq.runtime.inputs) with the normalisation of the manifest
    beside the model: raw uint8, float samples, or int8 codes of an int8 input. A model with
    several inputs reads ``x_<input name>`` arrays.
    """
    from edgeq.runtime.inputs import model_inputs, normalization_beside, read_npz, samples_for

    arrays = read_npz(data)
    normalization = normalization_beside(model.path) if model.path else None
    result = {}
    for name, info in zip(model.input_names, model.inputs):
        key = inputs if len(model.inputs) == 1 else f"{inputs}_{name}"
        x = samples_for(arrays, key, tuple(info.shape[1:]), data)
        if limit:
            x = x[:limit]
        result[name] = model_inputs(x, info.dtype, info.scale, info.zero_point, normalization, str(data))
    return result


def _class_outputs(model, names: list[str]) -> set[str]:
    """The outputs that are classes, by the task the conversion manifest records (else by their shape:
    one score vector per sample)."""
    from edgeq.runtime.inputs import outputs_beside
    from edgeq.tasks.table import TASKS

    recorded = {o["name"]: o.get("task") for o in outputs_beside(model)}
    if recorded:
        return {n for n in names if recorded.get(n) in TASKS and TASKS[recorded[n]].classes}
    return set(names) if len(names) == 1 else set()


def verify_on(
    device: Device,
    model: str | Path,
    data: str | Path,
    *,
    inputs: str = "x",
    limit: int | None = 100,
    delegate: str = "xnnpack",
    on_event: Event = _noop,
) -> VerifyResult:
    """Same inputs on the device and on this host's interpreter; compare the raw outputs."""
    from edgeq.runtime.interpreter import TFLiteModel

    host = TFLiteModel(model, num_threads=1, delegate=delegate)
    x = quantized_inputs(host, data, inputs, limit)
    count = len(next(iter(x.values())))
    host_out = _host_outputs(host, x, count)
    dev_out, machine, dev_runtime = _device_outputs(device, model, x, count, delegate, on_event)
    rows = _compare_outputs(device, model, host, host_out, dev_out, count)
    first = rows[0]
    return VerifyResult(
        samples=count,
        bit_exact=all(r["bit_exact"] for r in rows),
        max_abs_diff=max(r["max_abs_diff"] for r in rows),
        max_abs_diff_float=max(r["max_abs_diff_float"] for r in rows),
        top1_agreement=next((r["top1_agreement"] for r in rows if r["top1_agreement"] is not None), None),
        output_dtype=first["dtype"],
        device_machine=machine,
        device_runtime=dev_runtime,
        host_runtime=f"{host.backend.name} {host.backend_version}",
        outputs=tuple(rows),
    )


def _host_outputs(host, x: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """The host interpreter's raw outputs, one sample at a time as the device runs them, by output name."""
    host_parts: dict[str, list] = {name: [] for name in host.output_names}
    for i in range(count):
        for name, value in host.invoke_raw_outputs({k: v[i : i + 1] for k, v in x.items()}).items():
            host_parts[name].append(value)
    return {name: np.concatenate(parts, axis=0) for name, parts in host_parts.items()}


def _device_outputs(
    device: Device, model: str | Path, x: dict[str, np.ndarray], count: int, delegate: str, on_event: Event
) -> tuple[dict[str, np.ndarray], str, str]:
    """Push the model and the inputs, run them on the device, and bring back its raw outputs, machine and runtime."""
    with tempfile.TemporaryDirectory(prefix="edgeq-verify-") as tmp:
        stem = Path(model).stem
        inputs_file = Path(tmp) / f"{stem}.verify-inputs.npz"
        np.savez(
            inputs_file,
            input_names=np.array(list(x)),
            **{f"input_{i}": value for i, value in enumerate(x.values())},
        )
        on_event(device.name, "connecting")
        with connect(device) as transport:
            pushed = push_to_device(transport, [Path(model), inputs_file], on_event)
            runtime = pushed.runtime
            results_remote = confine(runtime.workdir, "results")
            transport.makedirs(results_remote)
            remote_out = confine(results_remote, f"{stem}.verify-outputs.npz")
            argv = [runtime.python, "-m", "edgeq.fleet.device", "raw", _remote_path(pushed, model)]
            argv += [_remote_path(pushed, inputs_file), remote_out, "--delegate", delegate]
            if device.runtime:
                argv += ["--runtime", device.runtime]
            on_event(device.name, f"running {count} samples")
            result = transport.run(argv, env=runtime.env, cwd=runtime.workdir, timeout=PROFILE_TIMEOUT_S)
            if not result.ok:
                raise DeviceError(f"{device.name}: running the model failed: {result.last_error_line()}")
            local_out = Path(tmp) / "outputs.npz"
            transport.download(remote_out, local_out)
        with np.load(local_out) as npz:
            names = [str(n) for n in npz["output_names"]]
            dev_out = {name: np.asarray(npz[f"output_{i}"]) for i, name in enumerate(names)}
            machine, dev_runtime = str(npz["machine"]), str(npz["runtime"])
    return dev_out, machine, dev_runtime


def _compare_outputs(device: Device, model: str | Path, host, host_out: dict, dev_out: dict, count: int) -> list[dict]:
    """One row per output: the device's against the host's, raw and dequantized, and top-1 where it is classes."""
    from edgeq.runtime.interpreter import dequantize

    rows = []
    classes = _class_outputs(model, host.output_names)
    for name in host.output_names:
        got, mine, info = dev_out.get(name), host_out[name], host.output_named(name)
        if got is None or got.shape != mine.shape or got.dtype != mine.dtype:
            raise DeviceError(
                f"{device.name}: output {name!r} came back as {None if got is None else (got.shape, str(got.dtype))}, "
                f"the host's is {mine.shape} {mine.dtype}"
            )
        diff = np.abs(got.astype(np.float64) - mine.astype(np.float64))
        fdiff = np.abs(dequantize(got, info).astype(np.float64) - dequantize(mine, info))
        rows.append(
            {
                "name": name,
                "bit_exact": bool(np.array_equal(got, mine)),
                "max_abs_diff": float(diff.max()) if diff.size else 0.0,
                "max_abs_diff_float": float(fdiff.max()) if fdiff.size else 0.0,
                # only where the output is classes (its task in the manifest): a box or a value has no top-1
                "top1_agreement": (top1_agreement(dequantize(mine, info), dequantize(got, info)) if count else 1.0)
                if name in classes
                else None,
                "dtype": str(mine.dtype),
            }
        )
    return rows
