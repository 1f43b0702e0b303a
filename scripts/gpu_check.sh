#!/usr/bin/env bash
# On a machine with a CUDA GPU: moetool's CUDA tests, then its GPU benchmarks, logged under $OUT
# (default gpu-out/). The CPU suite (make test) runs these tests too but skips them without a GPU.
#     OUT=gpu-out bash scripts/gpu_check.sh [tests] [kernels] [tune] [model] [timing] [bench] [decode] [sim]
#         tests:   the tests marked cuda (tests/test_cuda.py: engine, captured step, fused kernels)
#         kernels: scripts/bench_kernels.py (the fused low-bit experts kernels against dequantize + GEMM)
#         tune:    scripts/bench_kernels.py --tune: the kernels' configs searched on this device, written
#                  to kernel-configs-<device>.json and used by the parts after it (MOETOOL_KERNEL_CONFIGS)
#         model:   the 4-layer Qwen1.5-MoE checkpoint and its 16/8/4/2-bit bundle (scripts/bench_gpu.py's)
#         timing:  `moetool profile --what timing` on it: hw-profile.json, each precision timed on the
#                  engine's path there (the fused kernels in a CUDA graph), to recalibrate profiles/hw
#         bench:   scripts/bench_gpu.py's whole run (policies, timing profile, accelerate)
#         decode:  scripts/bench_decode.py on it (captured step vs host-driven vs plain transformers)
#         sim:     the decode part's rows again on the simulated clock of the timing part's profile,
#                  each against its wall-clock row (sim_over_wall: the goal is the sim clock within 10% of the wall)
#     Parts run in the order above, whatever order they are named in (default: tests kernels bench).
#     T_TESTS=600 T_KERNELS=300 T_TUNE=420 T_TIMING=300 T_DECODE=600 T_SIM=300: each part's time limit in
#         seconds, the defaults shown (a part past it is cut, not the rest); model and bench have none
#     BENCH_ARGS="--layers 8 --time-limit 900" DECODE_ARGS="--policies resident,lru" bash scripts/gpu_check.sh bench decode
#     KERNELS_ARGS: bench_kernels.py's arguments in the kernels part (e.g. "--shapes qwen1.5-moe-a2.7b")
#     SIM_ARGS: the sim part's bench_decode arguments (default DECODE_ARGS), e.g. fewer rows: "--paths captured"
# A GPU image without this project's pins: wheels put in `.whl/` (e.g. `pip download --no-deps -d .whl
# transformers==5.24.0 hqq termcolor`) are installed first, into a directory ahead of the image's packages.
set -uo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0; fi
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
site=
if compgen -G ".whl/*.whl" > /dev/null; then
    site=${SITE:-/tmp/moetool-site}
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
what=${*:-tests kernels bench}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
$py -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__,
'triton', triton.__version__)" | tee -a "$out/device.txt"
rc=0
work=${WORK:-/tmp/moetool-bench}
if [[ $what == *tests* ]]; then
    # Only the modules with CUDA tests: the others need packages a bare GPU image may lack (lm-eval, ray).
    # Spread over worker processes where pytest-xdist is there (it can come from .whl/): each worker has
    # its own CUDA context and allocator, so the budget tests still read their own peaks.
    workers=$($py -c "import xdist" 2>/dev/null && echo "-n ${T_WORKERS:-6}")
    timeout "${T_TESTS:-600}" $py -m pytest -q -ra -m cuda -p no:cacheprovider --durations=15 $workers \
        $(grep -l "mark.cuda" tests/test_*.py) 2>&1 | tee "$out/cuda-tests.log" || rc=1
fi
if [[ $what == *kernels* ]]; then
    # The fused low-bit experts kernels against dequantize-then-GEMM, per precision (the rows docs/bench/gpu keeps).
    timeout "${T_KERNELS:-300}" $py scripts/bench_kernels.py --out "$out" ${KERNELS_ARGS:-} 2>&1 | tee "$out/bench-kernels.log" || rc=1
    # The same kernels' machine code for this device's arch and this image's Triton (registers,
    # loads, conversions: what the timings above ran), into compile_only.json. SASS=0 skips it
    # (it needs no GPU: `bench_kernels.py --compile-only SM` gives the same rows on any machine).
    if [[ ${SASS:-1} != 0 ]]; then
        sm=$($py -c "import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)")
        timeout 120 $py scripts/bench_kernels.py --compile-only "$sm" --compile-sets 16 8 4 2 4,2 --out "$out" \
            2>&1 | tee "$out/compile-only.log" || rc=1
    fi
fi
if [[ $what == *tune* ]]; then
    # The search stops itself at TUNE_SECONDS and writes what it found; the timeout is a backstop.
    timeout "${T_TUNE:-420}" $py scripts/bench_kernels.py --tune --tune-seconds "${TUNE_SECONDS:-300}" \
        --shapes qwen1.5-moe-a2.7b --out "$out" 2>&1 | tee "$out/tune.log" || rc=1
    tuned=$(ls "$out"/kernel-configs-*.json 2>/dev/null | head -1)
    [[ -n $tuned ]] && export MOETOOL_KERNEL_CONFIGS="$(realpath "$tuned")"
fi
if [[ $what == *model* ]]; then
    # Only the checkpoint and its bundle (GBs, to $WORK, not under $out).
    $py scripts/bench_gpu.py --out "$work/model-only" --work "$work" \
        --skip bandwidth,p1,policies,timing,sim,accelerate ${BENCH_ARGS:-} 2>&1 | tee "$out/model.log" || rc=1
fi
if [[ $what == *timing* ]]; then
    # Only the timing profile, on the model part's checkpoint and bundle (the kernels' recalibration of the hw profile).
    timeout "${T_TIMING:-300}" $py scripts/bench_gpu.py --out "$out" --work "$work" \
        --skip bandwidth,p1,policies,sim,accelerate ${BENCH_ARGS:-} 2>&1 | tee "$out/timing.log" || rc=1
fi
if [[ $what == *bench* ]]; then
    $py scripts/bench_gpu.py --out "$out" --work "$work" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench-gpu.log" || rc=1
fi
if [[ $what == *decode* ]]; then
    # The captured step against the host-driven one and plain transformers, on bench_gpu's model.
    ckpt=$(ls -d "$work"/qwen1.5-moe-x* 2>/dev/null | head -1)
    if [[ -n $ckpt ]]; then
        # The timing part's profile, where it ran, for what cost-aware policies read (Fate's n): the sim
        # part reads the same, so the two runs make the same decisions and only their clocks differ.
        hw=()
        [[ -f $out/hw-profile.json ]] && hw=(--hw "$out/hw-profile.json")
        timeout "${T_DECODE:-600}" $py scripts/bench_decode.py --device cuda --model "$ckpt" --bundle "$work/bundle" \
            --bundle-all --tokens 64 ${hw[@]+"${hw[@]}"} --json "$out/decode.json" ${DECODE_ARGS:-} 2>&1 | tee "$out/bench-decode.log" || rc=1
    else
        echo "decode: no checkpoint under $work (run the model or bench part first)" | tee "$out/bench-decode.log"
        rc=1
    fi
fi
if [[ $what == *sim* ]]; then
    ckpt=$(ls -d "$work"/qwen1.5-moe-x* 2>/dev/null | head -1)
    if [[ -n $ckpt && -f $out/hw-profile.json && -f $out/decode.json ]]; then
        timeout "${T_SIM:-300}" $py scripts/bench_decode.py --device cuda --model "$ckpt" --bundle "$work/bundle" \
            --bundle-all --tokens 64 --clock sim --hw "$out/hw-profile.json" --against "$out/decode.json" \
            --json "$out/decode-sim.json" ${SIM_ARGS:-${DECODE_ARGS:-}} 2>&1 | tee "$out/bench-sim.log" || rc=1
    else
        echo "sim: needs the model, timing and decode parts' outputs first" | tee "$out/bench-sim.log"
        rc=1
    fi
fi
exit $rc
