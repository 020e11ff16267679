"""Reference-model recipes (TOML), shipped inside the package as ``edgeq.models``."""
