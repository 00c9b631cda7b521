#!/usr/bin/env bash
# The GPU checks, as one prepared script for the lent device machine (see the device tool's README):
#   run(command="bash tests/gpu/run_on_device.sh", carry=[".whl"], timeout_s=560)
# `.whl/` (git-excluded) holds the cp312 wheels the GPU image lacks: megatron-core 0.19.x, msgspec,
# structlog. Rebuild it here with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl megatron-core==0.19.2 msgspec==0.23.0 structlog==26.1.0
# Results land in $OUT: gpu_tests.log (pytest -v) and gpu_report.json (step / sync timings).
set -uo pipefail
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/src:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)" \
    | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest tests/gpu/test_gpu_trainer.py -v -rs -p no:cacheprovider -o addopts="" \
    --timeout 280 2>&1 | tee "$OUT/gpu_tests.log"
timeout 200 python3 tests/gpu/gpu_report.py --output "$OUT/gpu_report.json" 2>&1 | tail -40
