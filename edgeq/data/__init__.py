"""`--data`: every dataset edgeq reads, and its splits.

- ``splits``: ``Dataset`` and its train/val/test/calibration splits (stratified, grouped, held out)
- ``files``: user files: .npz, image folders, TFRecords, COCO JSON
- ``sources``: built-in data and ``load_dataset``, which reads any --data spec
- ``cli``: `edgeq data`
"""
