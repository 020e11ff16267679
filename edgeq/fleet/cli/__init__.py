"""The fleet's commands: `edgeq push`, `verify`, `devices`, `release` and `pull`."""
