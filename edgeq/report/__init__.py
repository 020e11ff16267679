"""`edgeq report`: one self-contained HTML page of what quantization cost.

It reads the files the other stages wrote (run folders, conversion manifests, eval,
analyze, profile and verify JSON, .tflite files) and writes one HTML file whose plots are
inline, so that it opens anywhere, offline, and can be sent on. No TensorFlow: a report
is made from files, on any machine that has them.

- ``sources``: the records found in the folders given (``collect``)
- ``sections``: each section's rows and figures, from those records; ``format``: numbers in their units
- ``figures``: the plots (matplotlib, inlined as SVG)
- ``build``: ``build_report``: records in, one HTML page out
- ``cli``: `edgeq report`
"""
