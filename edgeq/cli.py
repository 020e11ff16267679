"""The ``edgeq`` command: a thin click group whose subcommands load lazily.

Device-side commands (``profile``, ``inspect``) must never pay for TensorFlow, so this
module imports no subcommand until it is invoked. Errors derived from EdgeqError become
one line on stderr and a non-zero exit code; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import click

from edgeq import __version__
from edgeq.errors import EdgeqError

# name -> (module, attribute, one-line help). Help lives here so `edgeq --help`
# lists every command without importing any of them.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("edgeq.train.cli", "train", "FP32 training, then quantization-aware fine-tuning (TF-MOT)."),
    "convert": ("edgeq.convert.cli", "convert", "Convert a Keras model to a verified TFLite model."),
    "eval": ("edgeq.evaluate.cli", "eval_command", "Compare a quantized model with its FP32 reference."),
    "analyze": ("edgeq.analyze.cli", "analyze", "Weight statistics, layer sensitivity, budgeted precision plans."),
    "optimize": (
        "edgeq.optimize.cli",
        "optimize",
        "The fastest verified model: PTQ, the target plan, then QAT, confirmed on test.",
    ),
    "data": ("edgeq.data.cli", "data", "Look at datasets and export splits to .npz for devices."),
    "profile": (
        "edgeq.profile.cli",
        "profile",
        "Latency, memory and accuracy of a .tflite model (no TensorFlow).",
    ),
    "devices": ("edgeq.fleet.cli.devices", "devices", "The device inventory, and what each device has (over SSH)."),
    "push": ("edgeq.fleet.cli.push", "push", "Push models (and the edgeq runtime) to devices over SSH."),
    "verify": ("edgeq.fleet.cli.verify", "verify", "Compare a device's outputs with this host's interpreter."),
    "release": ("edgeq.fleet.cli.release", "release", "Write a signed release for devices to pull (large fleets)."),
    "pull": ("edgeq.fleet.cli.release", "pull", "On a device: make a release from a URL live (no TensorFlow)."),
    "report": ("edgeq.report.cli", "report", "One self-contained HTML page: what quantization cost."),
    "inspect": (
        "edgeq.runtime.cli",
        "inspect",
        "Ops, dtypes, quantization and Edge TPU checks of a .tflite file.",
    ),
}


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when that command runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module_name, attr, _ = COMMANDS[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # the command is not part of this build
                return None
            raise
        return getattr(module, attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except EdgeqError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgeq")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.option("-v", "--verbose", is_flag=True, help="Log what the library does.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, verbose: bool) -> None:
    """edgeq: Keras model -> integer-only TFLite -> proven on the device."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    if verbose:  # keep TensorFlow's own start-up log lines (edgeq.models.compat hides them otherwise)
        os.environ["EDGEQ_VERBOSE"] = "1"
    else:  # the terminal shows edgeq's words: TensorFlow starts quietly when a command imports it
        os.environ.setdefault("EDGEQ_QUIET_TF", "1")


def main() -> None:
    cli(prog_name="edgeq")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
