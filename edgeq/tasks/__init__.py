"""What each output of a model is, and how it is judged (numpy only: the device side uses it too).

- ``table``: the task table (classification ... detection), each output's ``OutputSpec``, scores
- ``metrics``: paired comparisons of a quantized output with its FP32 twin
- ``detection``: boxes, NMS and COCO mAP (pycocotools)
- ``verdicts``: a change against a budget, with n and a paired interval
"""
