"""Device side of edgeq: everything here runs without TensorFlow.

- ``interpreter``: the table of LiteRT backends and ``TFLiteModel`` (float in, float out)
- ``flatbuffer``: reads and verifies a .tflite file with the schema shipped in ai-edge-litert
- ``inspect``: what a file holds (signature, tensors, ops, dtypes, integer-only, Edge TPU)
- ``edgetpu``: Edge TPU compatibility checks and the ``edgetpu_compiler`` wrapper
- ``delegates``: ``xnnpack`` / ``none`` / ``edgetpu`` / a library path
- ``profile``: latency, memory, accuracy and the comparison against an FP32 twin
"""
