"""A model, described once: loading (Keras 2 or 3, SavedModel), names, Keras 3 translation, the zoo.

Everything a stage needs to know about a model's inputs and outputs comes from here.
"""
