#!/usr/bin/env bash
# On a machine with a CUDA GPU: moetool's CUDA tests, then its GPU benchmarks, logged under $OUT
# (default gpu-out/). The CPU suite (make test) runs these tests too but skips them without a GPU.
#     OUT=gpu-out bash scripts/gpu_check.sh [tests] [kernels] [decode] [bench]   (bench: all three benchmarks)
#     BENCH_ARGS="--layers 8 --time-limit 900" bash scripts/gpu_check.sh bench
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
what=${*:-tests bench}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/device.txt"
rc=0
if [[ $what == *tests* ]]; then
    # Only the modules with CUDA tests: the others need packages a bare GPU image may lack (lm-eval, ray).
    $py -m pytest -q -ra -m cuda -p no:cacheprovider $(grep -l "mark.cuda" tests/test_*.py) 2>&1 \
        | tee "$out/cuda-tests.log" || rc=1
fi
work=${WORK:-/tmp/moetool-bench}
if [[ $what == *kernels* || $what == *bench* ]]; then
    # The fused low-bit experts kernels against dequantize-then-GEMM, per precision (issue 42's rows).
    $py scripts/bench_kernels.py --out "$out" 2>&1 | tee "$out/bench-kernels.log" || rc=1
fi
if [[ $what == *bench* ]]; then
    # The checkpoint and bundle (GBs) go to $WORK, not under $out.
    $py scripts/bench_gpu.py --out "$out" --work "$work" ${BENCH_ARGS:-} 2>&1 \
        | tee "$out/bench-gpu.log" || rc=1
fi
if [[ $what == *decode* || $what == *bench* ]]; then
    # The captured step against the host-driven one and plain transformers, on bench_gpu's model.
    ckpt=$(ls -d "$work"/qwen1.5-moe-x* 2>/dev/null | head -1)
    if [[ -n $ckpt ]]; then
        $py scripts/bench_decode.py --device cuda --model "$ckpt" --bundle "$work/bundle" --bundle-all \
            --tokens 64 --json "$out/decode.json" ${DECODE_ARGS:-} 2>&1 | tee "$out/bench-decode.log" || rc=1
    fi
fi
exit $rc
