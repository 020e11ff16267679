"""Graph changes on float Keras models, each returning a new model (the given one untouched).

``fold``: batch-norm folding; ``equalize``: cross-layer equalization; ``bias_correction``:
empirical bias correction; ``int4``: INT4-valued weight copies. ``convert`` applies them
on request, ``train`` folds before per-tensor QAT, ``analyze`` measures what they change.
"""
