#!/usr/bin/env bash
# GPU training throughput: ResNet-50 at 224 px in bf16 with channels_last (eager and torch.compile),
# set against the GPU's own measured bf16 matmul throughput. Run it on a machine with a CUDA GPU,
# from the repository root, with the project installed (make test DEVICE=gpu, or pip install -e ".[gpu,train]").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" bench/train.py --device cuda --backbone resnet50 --image-size 224 --batch-size 256 \
    --precisions fp32,bf16 --channels-last --steps 30 --warmup 5 --workers 8
"$PYTHON" bench/train.py --device cuda --backbone resnet50 --image-size 224 --batch-size 256 \
    --precisions bf16 --channels-last --compile --steps 30 --warmup 5 --no-trainer
