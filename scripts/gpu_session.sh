#!/usr/bin/env bash
# One device call: train-step benches (`jaxmem bench`) and kernel timings, results under $1 (default $OUT).
# Run from the repo root on a GPU machine: PYTHONPATH=. bash scripts/gpu_session.sh OUTDIR
set -u
out=${1:-$OUT}
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
base="model.preset=llama3.2-1b train.seq_len=8192 train.micro_batch=1 remat.preset=selective parallel.fsdp=1
  parallel.rules=fsdp precision.param_dtype=bfloat16 precision.compute_dtype=bfloat16 precision.master_weights=true
  checkpoint.every=0 data.kind=synthetic"
bench() {  # name, overrides...
  local name=$1; shift
  timeout 150 python3 -m jaxmem.cli bench configs/tiny.yaml $base "$@" --steps 10 --json "$out/bench_$name.json" \
    > "$out/bench_$name.txt" 2>&1; echo "bench $name rc=$?"; grep -E "step time|tokens/s|device bytes|MFU" "$out/bench_$name.txt" | head -8
}
bench 1b_s8k_sel_auto
bench 8bx8_s8k_full_auto model.preset=llama3-8b model.n_layers=8 remat.preset=full
bench 1b_s8k_sel_pallas kernels.attention=pallas
python3 scripts/bench_kernels_gpu.py "$out" "${@:2}" --budget "${KERNEL_BUDGET:-300}"
