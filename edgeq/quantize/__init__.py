"""The quantization engine: what every command that quantizes goes through.

- ``ranges``: range methods (minmax, percentile, MSE, entropy) and the observers they choose
  from (numpy only).
- ``configs``: edgeq's TF-MOT quantize configs and which layers need one scale in and out.
- ``calibration``: the one way edgeq's activation ranges reach a model (``ActivationRanges``:
  the converter's calibration, each min/max re-chosen by a method), and calibrate once, then
  quantize with any layers left float (analyze, plans, ``convert --ptq``).
- ``ptq``: edgeq's weight ranges, rounding and 4-bit codes (``--weight-ranges``, ``--rounding``,
  W4A8), written into the converted model by ``passes``.
- ``passes``: rewrites of converted TFLite flatbuffers (requantize pairs, chosen weight codes,
  HARD_SWISH as ADD/MUL for XNNPACK).
- ``mixed``: integer-only models with chosen layers at 16-bit activations (16x8) and the
  rest int8, through LiteRT Quantizer's per-op recipes.
"""
