"""`edgeq report`: one self-contained HTML page of what quantization cost.

It reads the files the other stages wrote (run folders, conversion manifests, eval,
analyze, profile and verify JSON, .tflite files) and writes one HTML file whose plots are
inline, so that it opens anywhere, offline, and can be sent on. No TensorFlow: a report
is made from files, on any machine that has them.
"""

from edgeq.reporting.build import ReportResult, build_report
from edgeq.reporting.sources import Sources, collect

__all__ = ["ReportResult", "Sources", "build_report", "collect"]
