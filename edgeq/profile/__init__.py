"""`edgeq profile`: the device runtime measured (no TensorFlow: it runs on the device).

- ``results``: what a profile reports (its JSON schema as dataclasses)
- ``host``: the machine it runs on: CPU, temperature and throttling, memory
- ``samples``: the samples it profiles on (a split exported to .npz)
- ``run``: ``profile_model``: latency, memory, scores, the comparison with an FP32 twin
- ``cli``: `edgeq profile`
"""
