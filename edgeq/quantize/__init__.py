"""Quantization engines that write integer models edgeq's own way.

- ``mixed``: integer-only models with chosen layers at 16-bit activations (16x8) and the
  rest int8, through LiteRT Quantizer's per-op recipes.
"""
