"""Click commands of the ``edgeq`` CLI, one module per command, loaded lazily by edgeq.cli."""
