"""The quantization engine: what every command that quantizes goes through.

- ``ranges``: range methods (minmax, percentile, MSE, entropy) and the observers they choose
  from (numpy only).
- ``configs``: edgeq's TF-MOT quantize configs and which layers need one scale in and out.
- ``calibration``: calibrate once with the converter, then quantize with any layers left float
  (analyze, plans).
- ``ptq``: edgeq's ranges and weight rounding set into fake-quant ops (``convert --ptq``, W4A8).
- ``passes``: rewrites of converted TFLite flatbuffers.
- ``mixed``: integer-only models with chosen layers at 16-bit activations (16x8) and the
  rest int8, through LiteRT Quantizer's per-op recipes.
"""
