"""``ModelSpec``: a model described once, where it is loaded; every stage reads it from here.

Its inputs and outputs by name, with shapes, dtypes and activations, in the model's own order;
what its training run or conversion recorded (normalisation, each output's task); what its file's
compile config says of each output; whether it is a QAT model. Stages take it and never re-derive
names or shapes from the Keras object or the interpreter.

numpy only, like the task table it feeds: a .tflite on a device is described here too
(``describe_tflite``). A Keras model is described by ``edgeq.models.load.describe``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from edgeq.runtime.inputs import Normalization, normalization_beside, outputs_beside
from edgeq.tasks.table import OutputSpec, load_task_spec, specs_for

KERAS3 = "keras3"
TF_KERAS = "tf_keras"
TFLITE = "tflite"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: its name (as the .tflite signature calls it), shape without the batch
    axis (None: a free dimension), dtype, and for an output its final activation where known."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str = "float32"
    activation: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """What every stage needs to know about a model, built once where it is loaded."""

    name: str  # how messages name it: its file, else the Keras model's name
    format: str  # keras3, tf_keras, tflite
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    path: Path | None = None
    is_qat: bool = False
    batch: int | None = None  # a batch the model fixes (an Edge TPU model's 1); None: free
    normalization: Normalization | None = None  # what its training run or conversion recorded
    trained_on: str | None = None  # the --data its training run read (run.json)
    recorded: Mapping[str, dict] = field(default_factory=dict)  # each output's record (run.json, manifest)
    compiled: Mapping[str, tuple[str, bool]] = field(default_factory=dict)  # compile config: (family, from_logits)
    compile_config: Mapping = field(default_factory=dict)  # the file's compile config as saved (loss, weights)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def input_shapes(self) -> dict[str, tuple]:
        return {t.name: t.shape for t in self.inputs}

    @property
    def output_shapes(self) -> dict[str, tuple[int, ...]]:
        """{output name: shape}, a free dimension read as -1."""
        return {t.name: tuple(-1 if d is None else int(d) for d in t.shape) for t in self.outputs}

    @property
    def activations(self) -> dict[str, str | None]:
        return {t.name: t.activation for t in self.outputs}

    @property
    def input_shape(self):
        """The one input's shape, or {name: shape} for several (what the data loaders take)."""
        return self.inputs[0].shape if len(self.inputs) == 1 else self.input_shapes

    @property
    def single_io(self) -> bool:
        return len(self.inputs) == 1 and len(self.outputs) == 1

    def output(self, name: str) -> TensorSpec:
        for t in self.outputs:
            if t.name == name:
                return t
        raise KeyError(f"{self.name} has no output named {name!r} (its outputs: {', '.join(self.output_names)})")

    def tasks(self, declared: str | None = None, targets: Mapping | None = None) -> list[OutputSpec]:
        """Each output's task (edgeq.tasks.table.OutputSpec), in the model's order: --task (declared)
        wins, then what was recorded, then the compile config, then activation, shape and targets."""
        names = self.output_names
        one_input = self.inputs[0].shape if len(self.inputs) == 1 else None
        return specs_for(
            names,
            self.output_shapes,
            load_task_spec(declared, names),
            self.recorded,
            self.activations,
            targets or {},
            one_input,
            self.compiled,
        )

    def judged_with(self, reference: ModelSpec | None) -> ModelSpec:
        """This model's outputs with what a reference of the same outputs knows and this one cannot
        (an integer .tflite has no activations and no compile config): for judging it against it."""
        if reference is None:
            return self
        theirs = {t.name: t for t in reference.outputs}
        outputs = tuple(
            replace(t, activation=theirs[t.name].activation) if t.name in theirs and t.activation is None else t
            for t in self.outputs
        )
        compiled = {**reference.compiled, **self.compiled}
        return replace(self, outputs=outputs, compiled=compiled)


def describe_tflite(model, path: str | Path | None = None) -> ModelSpec:
    """A .tflite model (``edgeq.runtime.interpreter.TFLiteModel``) with what its manifest recorded.

    Outputs come in the order the manifest lists them (the Keras model's), else the file's."""
    names = model.output_names
    recorded = {o["name"]: o for o in outputs_beside(path)} if path else {}
    order = [n for n in recorded if n in names] if sorted(recorded) == sorted(names) else names
    inputs = tuple(
        TensorSpec(n, tuple(int(d) for d in t.shape[1:]), str(t.dtype)) for n, t in zip(model.input_names, model.inputs)
    )
    outputs = []
    for n in order:
        t = model.output_named(n)
        outputs.append(TensorSpec(n, tuple(int(d) for d in t.shape[1:]), str(t.dtype)))
    return ModelSpec(
        name=str(path) if path else "model",
        format=TFLITE,
        inputs=inputs,
        outputs=tuple(outputs),
        path=Path(path) if path else None,
        normalization=normalization_beside(path) if path else None,
        recorded=recorded,
    )
