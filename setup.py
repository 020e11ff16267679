"""edgeq: Keras model -> verified integer-only TFLite model -> proven on an edge device.

On a device: `pip install "edgeq[litert]"` (numpy, click, LiteRT), or on a numpy 1.x device
that has tflite-runtime (Coral boards, older Raspberry Pi OS) `pip install "edgeq[tflite-runtime]"`,
which installs no LiteRT. The host extras bring TensorFlow and TF-MOT: `pip install "edgeq[train]"`.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "edgeq" / "__init__.py").read_text()).group(1)

# LiteRT has wheels for x86-64 and aarch64 (Linux, macOS arm64, Windows AMD64).
LITERT = (
    "ai-edge-litert>=2.0; platform_machine=='x86_64' or platform_machine=='aarch64' "
    "or platform_machine=='AMD64' or platform_machine=='arm64'"
)

setup(
    name="edgeq",
    version=VERSION,
    description="Quantization-aware training, integer-only TFLite conversion and on-device proof",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["edgeq", "edgeq.*"]),
    # Reference-model recipes (edgeq/models/recipes/*.toml) ship inside the package, so an
    # installed edgeq finds them without the checkout.
    package_data={"edgeq.models": ["recipes/*.toml"], "edgeq.quantize": ["targets.toml"], "edgeq.report": ["templates/*.j2"]},
    # The interpreter is an extra, one of two: an extra can add a requirement but never take one
    # away, so a base that required LiteRT could not give a tflite-runtime device an install
    # without it. A bare `pip install edgeq` says which extra to add when it needs a runtime.
    install_requires=[
        "numpy>=1.23",
        "click>=8.1",
    ],
    extras_require={
        "litert": [LITERT],
        # Coral boards and older Raspberry Pi OS images: tflite-runtime 2.14 is built against
        # NumPy 1.x (its import fails under numpy 2) and ships no .tflite schema, which the
        # `tflite` package (pure Python, on flatbuffers) gives edgeq's model reader.
        "tflite-runtime": [
            "tflite-runtime>=2.14",
            "numpy>=1.23,<2",
            "tflite>=2.18",
        ],
        "train": [
            LITERT,
            # tf-keras depends on the full "tensorflow" package, so depending on
            # tensorflow-cpu too would only install TensorFlow twice.
            "tensorflow==2.21.0",
            "tf-keras==2.21.0",
            "tensorflow-model-optimization==0.8.1",
            "scikit-learn>=1.3",
            "pillow>=9",
            "matplotlib>=3.7",
            # LiteRT Quantizer: INT4 PTQ (weight-only / dynamic) and mixed int8/int16 integer-only PTQ.
            "litert-quantizer==0.11.0",  # was ai-edge-quantizer (renamed): INT4 and mixed int8/int16
            "tqdm>=4.60",
            # COCO mAP for detectors (eval, train, analyze, and the host side of profile --on)
            "pycocotools>=2.0.8",
            "tomli>=2; python_version<'3.11'",
        ],
        # Host side of `edgeq push/devices/profile --on`: SSH to the devices.
        "deploy": [
            LITERT,  # verify runs the models here too, and tflite-runtime devices get its schema
            "paramiko>=3.4",
            "pyyaml>=6",  # Ansible-style YAML inventories
            "tomli>=2; python_version<'3.11'",
        ],
        # `edgeq report`: one HTML page, plots inline.
        "report": [
            "jinja2>=3.1",
            "matplotlib>=3.7",
        ],
        "dev": [
            "pytest>=8",
            # make test runs the suite in two workers, a test file per worker (module fixtures built once)
            "pytest-xdist>=3.5",
            # the report test loads the page in Debian's headless Chromium (deploy/test-env.sh)
            "playwright>=1.40",
            "ruff>=0.6",
            "hypothesis>=6",
        ],
    },
    entry_points={"console_scripts": ["edgeq=edgeq.cli:main"]},
)
