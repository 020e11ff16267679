#!/bin/sh
# One machine with several GPUs: MirroredStrategy, one process, every GPU.
# --batch-size is the global batch (split across the GPUs); BatchNormalization statistics
# are computed over the global batch, so the result is the model a single device would train.
#
#   sh deploy/distributed/multi-gpu.sh model.keras /data/train runs/model
set -eu
MODEL=${1:?model file (.keras/.h5/SavedModel)}
DATA=${2:?image folder (one sub-folder per class)}
OUT=${3:?output folder}
RESUME=""
[ -f "$OUT/checkpoint/state.json" ] && RESUME="--resume"   # a crashed run continues where it stopped
exec edgeq train "$MODEL" --data "images:$DATA" --out "$OUT" $RESUME \
    --strategy mirrored --batch-size 256 --epochs 30 --qat-epochs 5 --augment flip,crop
