"""edgeq's own TF-MOT QuantizeConfigs: the custom objects a saved QAT model needs to load.

They sit below both training (which builds QAT models with them) and model I/O (which
loads ``qat.h5`` with them in scope), so neither has to import the other.
"""

from __future__ import annotations

from edgeq.models.compat import keras, tfmot

_q = tfmot.quantization.keras


# TFLite ops whose int8 kernels need the output scale equal to the input's (by Keras layer class).
SAME_SCALE_LAYERS = ("Concatenate", "AveragePooling1D", "AveragePooling2D", "MaxPooling1D", "MaxPooling2D")
# Of those, the ones TF-MOT would give an output range of their own: edgeq wraps them with
# SameScaleQuantizeConfig instead (Concatenate and max pooling TF-MOT already leaves alone).
SAME_SCALE_WRAPPED = ("AveragePooling1D", "AveragePooling2D")


class WeightsOnlyQuantizeConfig(_q.QuantizeConfig):
    """Quantize a layer's weights as ``config`` does, but not its output.

    For a Conv/Dense directly followed by a ReLU layer: the ReLU's output quantizer
    covers both, and the converter fuses the two.
    """

    def __init__(self, config):
        self.config = config

    def get_weights_and_quantizers(self, layer):
        return self.config.get_weights_and_quantizers(layer)

    def set_quantize_weights(self, layer, quantize_weights):
        self.config.set_quantize_weights(layer, quantize_weights)

    def get_activations_and_quantizers(self, layer):
        return []

    def set_quantize_activations(self, layer, quantize_activations):
        pass

    def get_output_quantizers(self, layer):
        return []

    def get_config(self):
        return {"config": keras.utils.serialize_keras_object(self.config)}

    @classmethod
    def from_config(cls, config):
        with _q.quantize_scope():
            return cls(keras.utils.deserialize_keras_object(config["config"]))


class OutputQuantizeConfig(_q.QuantizeConfig):
    """Quantize only a layer's output: for weightless layers TF-MOT has no config for.

    TFOpLambda arithmetic (the hard-swish of MobileNetV3 is ``x * relu6(x + 3) / 6``),
    ``Multiply`` (squeeze-and-excite), ``Rescaling``/``Normalization`` (EfficientNet's
    input), ``Activation('hard_sigmoid')`` and the like all have int8 kernels in TFLite;
    they only need the range of their output, which a moving-average fake-quant learns in
    QAT exactly as TF-MOT's own output configs do. Their weights (Normalization's
    mean/variance) are constants folded by the converter, never quantized here.
    """

    def __init__(self, num_bits: int = 8, symmetric: bool = False):
        self.num_bits = int(num_bits)
        self.symmetric = bool(symmetric)

    def get_weights_and_quantizers(self, layer):
        return []

    def set_quantize_weights(self, layer, quantize_weights):
        pass

    def get_activations_and_quantizers(self, layer):
        return []

    def set_quantize_activations(self, layer, quantize_activations):
        pass

    def get_output_quantizers(self, layer):
        return [
            _q.quantizers.MovingAverageQuantizer(
                num_bits=self.num_bits, per_axis=False, symmetric=self.symmetric, narrow_range=False
            )
        ]

    def get_config(self):
        return {"num_bits": self.num_bits, "symmetric": self.symmetric}


class SameScaleQuantizeConfig(OutputQuantizeConfig):
    """No quantizer at all: the output keeps the input's scale.

    TFLite's AVERAGE_POOL_2D (and MAX_POOL_2D) require the same scale on input and
    output; a fake-quant of their own learns a range a hair apart from the input's, and
    the converter then refuses the graph ("violate the same scale constraint").
    """

    def get_output_quantizers(self, layer):
        return []


CUSTOM_OBJECTS = {
    "SameScaleQuantizeConfig": SameScaleQuantizeConfig,
    "WeightsOnlyQuantizeConfig": WeightsOnlyQuantizeConfig,
    "OutputQuantizeConfig": OutputQuantizeConfig,
}


def quantize_scope():
    """Custom objects needed to load a model saved during or after QAT (edgeq's too)."""
    return _q.quantize_scope(CUSTOM_OBJECTS)
