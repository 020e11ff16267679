"""edgeq: from a Keras model to a verified integer-only TFLite model on an edge device.

This module must stay importable without TensorFlow: the device install has none.
"""

__version__ = "0.1.0"
