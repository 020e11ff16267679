"""Device side of edgeq: everything here runs without TensorFlow."""
