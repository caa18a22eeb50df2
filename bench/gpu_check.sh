#!/usr/bin/env bash
# The GPU check, in under 8 minutes on one GPU: training throughput (bf16, channels_last, eager and
# torch.compile), ONNX Runtime CUDA embedding (float32 and float16 exports, and the indexing pipeline),
# and faiss-gpu build and search of the 1M benchmark; all output in one file, one section per part.
# Run from anywhere, on a CUDA machine with the project installed with the gpu extra:
#   pip install -e ".[gpu,train]" && bash bench/gpu_check.sh [OUTPUT_FILE]
# Without a GPU it exits with status 2 and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
REPORT=${1:-gpu_check.txt}
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU visible to PyTorch here; run it on a GPU machine, installed with pip install -e '.[gpu,train]'" >&2
    exit 2
fi
failed=0
section() {  # section TITLE SECONDS COMMAND...: one part of the check, bounded in time, its output in the report
    local title=$1 limit=$2
    shift 2
    echo "## $title" | tee -a "$REPORT"
    if ! timeout "$limit" "$@" 2>&1 | tee -a "$REPORT"; then
        echo "(failed or over ${limit} s)" | tee -a "$REPORT"
        failed=1
    fi
}
: > "$REPORT"
section "GPU" 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
section "training, resnet50 at 224 px, bf16 and fp32, channels_last, eager" 120 \
    "$PYTHON" bench/train.py --device cuda --backbone resnet50 --image-size 224 --batch-size 256 \
    --precisions fp32,bf16 --channels-last --steps 20 --warmup 5 --no-trainer
section "training, bf16, channels_last, torch.compile" 150 \
    "$PYTHON" bench/train.py --device cuda --backbone resnet50 --image-size 224 --batch-size 256 \
    --precisions bf16 --channels-last --compile --steps 20 --warmup 5 --no-trainer
section "ONNX Runtime CUDA embedding, float32" 60 "$PYTHON" bench/embed.py --image-size 224 --small 2000 --large 4000 --repeats 2
section "ONNX Runtime CUDA embedding, float16" 60 "$PYTHON" bench/embed.py --image-size 224 --small 2000 --large 4000 --repeats 2 --fp16
section "faiss-gpu, 1M vectors" 60 "$PYTHON" bench/gpu_faiss.py
echo "report: $REPORT"
exit $failed
