"""LiteRT / tflite_runtime / tf.lite Interpreter internals (device side: no TensorFlow here)."""

from __future__ import annotations


def ops_details(interpreter) -> list[dict]:
    """Every op of the primary subgraph: index, op_name, inputs, outputs.

    ``Interpreter._get_ops_details`` is private, but it is the only way any of the three
    interpreter backends (ai_edge_litert, tflite_runtime, tf.lite) lists the ops of a
    loaded model; it has the same form in all of them.
    """
    return interpreter._get_ops_details()  # noqa: SLF001
