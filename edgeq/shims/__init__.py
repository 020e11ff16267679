"""Private APIs of the libraries edgeq builds on, one module per library.

Each use says why no public API does the job, so that an upgrade of TensorFlow or
LiteRT has one place to look. ``litert`` is device-side (no TensorFlow); ``tflite``
is host-side.
"""
