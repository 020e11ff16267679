"""FP32 vs INT8 PTQ vs INT8 QAT vs INT4 PTQ vs INT4 QAT for digits-cnn and ds-cnn (recipes' settings)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODELS = ("digits-cnn", "ds-cnn")


def run() -> str:
    from edgeq.analyze.compare import markdown, precision_table

    parts = [
        "## Precision: accuracy and size of each quantization path",
        "",
        "`python tools/bench.py --only precision`: each reference model trained with its recipe "
        "(`models/*.toml`), then converted five ways and measured with `edgeq eval` on the test split "
        "(digits: real handwritten digits; ds-cnn: synthetic 49x10 'MFCC' data, 12 classes).",
        "",
    ]
    for model in MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            parts.append(markdown(model, precision_table(model, tmp)))
    return "\n".join(parts)


if __name__ == "__main__":
    print(run())
