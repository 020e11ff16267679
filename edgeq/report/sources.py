"""Find edgeq's outputs under the paths given and tell them apart by what they say they are."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeq.errors import UsageError

# what a JSON document says it is -> the report's name for it
KINDS = {
    "edgeq.train": "run",
    "edgeq.convert": "manifest",
    "edgeq.plan": "plan",
    "edgeq.eval": "eval",
    "edgeq.analyze.weights": "weights",
    "edgeq.analyze.sensitivity": "sensitivity",
    "edgeq.verify": "verify",
    "edgeq.optimize": "ladder",
}
SCHEMAS = {"edgeq.profile": "profile", "edgeq.inspect": "inspect"}
SKIPPED_DIRS = {"checkpoint", "__pycache__"}


@dataclass(frozen=True)
class Document:
    """One edgeq JSON file: what it is, where it lies, what it holds."""

    kind: str
    path: Path
    data: dict[str, Any]

    @property
    def device(self) -> str | None:
        """The device a fleet profile came from: `profile --on` writes DIR/DEVICE/MODEL.profile.json."""
        if self.kind == "profile" and self.path.name.endswith(".profile.json"):
            return self.path.parent.name
        return None


@dataclass
class Sources:
    """Everything found, by kind, in the order found."""

    documents: list[Document] = field(default_factory=list)
    tflite: list[Path] = field(default_factory=list)

    def of(self, kind: str) -> list[Document]:
        return [d for d in self.documents if d.kind == kind]

    @property
    def empty(self) -> bool:
        return not self.documents and not self.tflite


def kind_of(data: Any) -> str | None:
    """The report's name for a parsed JSON document, or None when it is not edgeq's."""
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("kind"), str) and data["kind"] in KINDS:
        return KINDS[data["kind"]]
    schema = str(data.get("schema", "")).split("/")[0]
    if schema in SCHEMAS:
        return SCHEMAS[schema]
    if isinstance(data.get("stages"), list) and all(isinstance(s, dict) and "epochs" in s for s in data["stages"]):
        return "history"
    return None


def _read(path: Path, given: bool) -> Document | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if given:
            raise UsageError(f"{path}: not a JSON file edgeq wrote ({exc}); give a run folder or edgeq's JSON") from exc
        return None
    kind = kind_of(data)
    if kind is None:
        if given:
            raise UsageError(
                f"{path}: not an edgeq output (no known 'kind' or 'schema'); give a run folder, a manifest, or the "
                "JSON of eval/analyze/profile/verify"
            )
        return None
    return Document(kind, path, data)


def collect(paths: list[str | Path]) -> Sources:
    """Every edgeq document and .tflite file in PATHS (folders are searched, recursively)."""
    sources = Sources()
    seen: set[Path] = set()

    def add_file(path: Path, given: bool) -> None:
        resolved = path.resolve()
        if resolved in seen:
            return
        seen.add(resolved)
        if path.suffix == ".tflite":
            sources.tflite.append(path)
        elif path.suffix == ".json":
            doc = _read(path, given)
            if doc is not None:
                sources.documents.append(doc)
        elif given:
            raise UsageError(f"{path}: not a run folder, an edgeq JSON file or a .tflite model")

    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                relative = child.relative_to(path).parts
                if any(p in SKIPPED_DIRS or p.startswith(".") for p in relative[:-1]) or not child.is_file():
                    continue
                if child.suffix in (".json", ".tflite"):
                    add_file(child, given=False)
        elif path.is_file():
            add_file(path, given=True)
        else:
            raise UsageError(f"{path}: no such file or folder")
    if sources.empty:
        raise UsageError(
            f"nothing to report in {', '.join(str(p) for p in paths)}: no run.json, manifest, eval/analyze/profile/"
            "verify JSON or .tflite there"
        )
    return sources
