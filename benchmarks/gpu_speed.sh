#!/usr/bin/env bash
# The GPU half of the speed comparison with pfl-research, as one prepared command for a lent GPU machine.
#
#   bash benchmarks/gpu_speed.sh prepare   # here, once: the shared bench and the missing packages, to travel along
#   bash benchmarks/gpu_speed.sh run       # there, in the checkout's copy (about 8 minutes on one H200)
#   DEVICE=cpu QUICK=1 PY=.venv/bin/python PFL_PY=<pfl venv>/bin/python bash benchmarks/gpu_speed.sh run
#                                          # a dry run of the same steps on a CPU machine (after `prepare`)
#
# `run` writes every step's output to $OUT (default /tmp/gpu_speed) and a one-line status per step to
# $OUT/steps.txt; a failing step is recorded and the next one runs. The steps:
#   1. benchmarks/overhead.py on the device: train.py's client fits against a plain loop on the same GPU;
#   2. W1 (the shared bench's workload) on the device, whole process and rounds, interleaved over $REPEATS:
#      train.py (`--trainer.accelerator=gpu`) and pfl-research (PFL_PYTORCH_DEVICE=cuda), with the raw loop,
#      which the shared bench keeps on the CPU, as the reference;
#   3. benchmarks/medical_speed.py --device cuda: the medical-size workload (UNet, 128 px, 4 clients), the raw loop
#      and train.py on the GPU, whole processes, interleaved over $REPEATS;
#   4. benchmarks/distributed.py --device cuda: 100 small-CNN clients on 1, 2, 4 and 8 ranks sharing the GPU.
#
# `prepare` copies ../shared/bench into shared/bench (a shared/ folder inside the checkout travels) and downloads,
# as Python 3.12 wheels into .whl/, the packages the GPU image lacks (the image has torch, Lightning, torchmetrics,
# torchvision, timm, scipy); .whl/ and shared/ go into .git/info/exclude so they are never committed. Carry .whl:
#   run(command="bash benchmarks/gpu_speed.sh run", carry=[".whl"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."

# What train.py imports beyond the GPU image, and what pfl-research 0.6.0 needs beyond it (both pure or abi3 where
# they can be; no torch among them).
WHEELS=(jsonargparse docstring-parser typeshed-client importlib-resources wandb pydantic pydantic-core
        annotated-types typing-inspection platformdirs lpips segmentation-models-pytorch opacus cryptography cffi
        pycparser pfl==0.6.0 dp-accounting prv-accountant dm-tree multiprocess dill)

prepare() {
    mkdir -p shared .whl
    rm -rf shared/bench && cp -r ../shared/bench shared/bench
    for path in /.whl/ /shared/; do grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude; done
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "${WHEELS[@]}"
    du -sh .whl shared
}

run() {
    local out=${OUT:-/tmp/gpu_speed} py=${PY:-python3} device=${DEVICE:-cuda} repeats=${REPEATS:-3}
    local pfl_py=${PFL_PY:-$py}  # pfl's own interpreter, where it is not installed beside train.py's
    mkdir -p "$out"
    : > "$out/steps.txt"
    if [ -d .whl ] && [ "$device" = cuda ]; then  # the wheels are Python 3.12's, for the GPU image
        "$py" -m pip install -q --no-index --no-deps --find-links .whl "${WHEELS[@]}" 2>&1 | tail -3
    fi
    step() {  # step NAME COMMAND...: run it, keep its output, record its status
        local name=$1 t0=$SECONDS
        shift
        echo "== $name: $*"
        "$@" > "$out/$name.txt" 2>&1
        local rc=$?
        tail -n 25 "$out/$name.txt"
        echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$out/steps.txt"
    }
    local accel=gpu rounds=20 clients=100 cuda_rounds=5
    [ "$device" = cpu ] && accel=cpu
    [ -n "${QUICK:-}" ] && rounds=2 clients=6 cuda_rounds=2 repeats=1
    step environment "$py" -c "import torch, lightning; print(torch.__version__, lightning.__version__,
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
    step overhead "$py" benchmarks/overhead.py --device "$device" --rounds "$rounds" --repeats "$repeats"
    local bench=shared/bench w1_dir
    # the whole process's wall time, around the command (bc and GNU time need not be there)
    local timed=(-c "import subprocess, sys, time; t = time.perf_counter(); rc = subprocess.call(sys.argv[1:]);
print(f'WALL {time.perf_counter() - t:.2f} s'); sys.exit(rc)")
    w1_dir=$(mktemp -d)
    for rep in $(seq 1 "$repeats"); do
        step "w1_raw_$rep" "$py" "${timed[@]}" "$py" "$bench/raw_loop.py"  # its 20 rounds (it takes no --rounds)
        step "w1_pfl_$rep" env PFL_PYTORCH_DEVICE="$device" "$py" "${timed[@]}" "$pfl_py" "$bench/pfl_sim.py" \
            --rounds "$rounds"
        step "w1_fl_$rep" "$py" "${timed[@]}" "$py" train.py --config "$bench/fl_w1.yaml" "--trainer.accelerator=$accel" \
            "--federation.rounds=$rounds" "--federation.output_dir=$w1_dir" "--federation.run_name=r$rep"
        "$py" -c "import csv, sys; t = [float(r['time/round']) for r in csv.DictReader(open(sys.argv[1]))]
print(f'RESULT rounds {sum(t):.2f} s, rounds 2+ {sum(t[1:]):.2f} s')" "$w1_dir/r$rep/rounds.csv" \
            | tee -a "$out/w1_fl_$rep.txt"
    done
    local medical=(--repeats "$repeats")
    [ -n "${QUICK:-}" ] && medical=(--repeats 1 --rounds 1 --image-size 32 --local-epochs 1)
    step medical "$py" benchmarks/medical_speed.py --python "$py" --device "$device" "${medical[@]}"
    if [ "$device" = cuda ]; then
        step ranks "$py" benchmarks/distributed.py --device cuda --clients "$clients" --rounds "$cuda_rounds" \
            --ranks 1 2 4 8 --repeats 1
    else
        step ranks "$py" benchmarks/distributed.py --clients "$clients" --rounds "$cuda_rounds" --ranks 2 --repeats 1
    fi
    cat "$out/steps.txt"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: bash benchmarks/gpu_speed.sh prepare|run" >&2; exit 2 ;;
esac
