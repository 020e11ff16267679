"""Which ops XNNPACK takes: the delegate structure of a .tflite, read from a loaded interpreter.

What makes an int8 file fast on a CPU is whether XNNPACK takes the whole graph: every op it leaves
out runs on LiteRT's reference kernels, and each gap splits the graph into another partition. This
holds on every CPU (x86 here, the Pi's Cortex-A72), so it is the check a host can make for a device,
where a latency measured here is only a hint.

The interpreter lists the original nodes and, after them, one ``DELEGATE`` node per partition; the
ops a partition replaced are those between its inputs and its outputs, found by walking back from
each of its outputs through the ops that wrote them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from edgeq.shims.litert import ops_details


@dataclass(frozen=True)
class DelegateStructure:
    """XNNPACK's partitions of a graph and the ops it left to LiteRT's own kernels."""

    partitions: int
    ops: int  # the graph's ops, before delegation
    outside: dict[str, int] = field(default_factory=dict)  # op type -> how many ran outside the delegate

    @property
    def outside_count(self) -> int:
        return sum(self.outside.values())

    @property
    def whole(self) -> bool:
        """One partition and no op outside it: the graph runs in XNNPACK alone."""
        return self.partitions == 1 and not self.outside

    def summary(self) -> str:
        if self.whole:
            return f"XNNPACK: 1 partition, all {self.ops} ops inside"
        if not self.partitions:
            return f"XNNPACK: no partition, all {self.ops} ops on LiteRT's own kernels"
        ops = ", ".join(f"{n} x{c}" for n, c in sorted(self.outside.items(), key=lambda kv: (-kv[1], kv[0])))
        return f"XNNPACK: {self.partitions} partitions, {self.outside_count} of {self.ops} ops outside ({ops})"

    def to_dict(self) -> dict:
        return {"partitions": self.partitions, "ops": self.ops, "outside": dict(sorted(self.outside.items()))}


def delegate_structure(interpreter) -> DelegateStructure:
    """The partitions and outside ops of an interpreter loaded with its default (XNNPACK) delegate."""
    details = ops_details(interpreter)
    delegates = [op for op in details if op["op_name"] == "DELEGATE"]
    original = [op for op in details if op["op_name"] != "DELEGATE"]
    writer = {int(t): op for op in original for t in op["outputs"] if int(t) >= 0}
    inside: set[int] = set()
    for node in delegates:
        stop = {int(t) for t in node["inputs"] if int(t) >= 0}
        todo = [int(t) for t in node["outputs"] if int(t) >= 0]
        while todo:
            tensor = todo.pop()
            op = writer.get(tensor)
            if tensor in stop or op is None or int(op["index"]) in inside:
                continue
            inside.add(int(op["index"]))
            todo.extend(int(t) for t in op["inputs"] if int(t) >= 0)
    outside = Counter(str(op["op_name"]) for op in original if int(op["index"]) not in inside)
    return DelegateStructure(partitions=len(delegates), ops=len(original), outside=dict(outside))


def structure_of(content: bytes) -> DelegateStructure:
    """The delegate structure of a .tflite's bytes, loaded as profile loads it (1 thread, XNNPACK)."""
    from edgeq.runtime.interpreter import TFLiteModel

    return delegate_structure(TFLiteModel(model_content=content, num_threads=1).interpreter)
