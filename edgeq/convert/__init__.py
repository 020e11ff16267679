"""`edgeq convert`: a model in, a verified TFLite model and its manifest out.

- ``options``: modes, range methods, roundings, ``ConvertOptions``, ``ConversionResult``
- ``converter``: the TFLite converter driven (calibration, conversion)
- ``search``: `--ptq auto` and the range search on held-out data
- ``plans``: precision plans (16-bit and float layers) through LiteRT Quantizer
- ``verify``: the converted model against its source, output by output
- ``manifest``: the manifest, and the commit of model and manifest together
- ``edgetpu``: `--edgetpu`
- ``run``: ``convert``, which takes a model through all of these
- ``cli``: `edgeq convert`
"""
