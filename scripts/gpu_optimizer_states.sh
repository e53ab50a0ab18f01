#!/usr/bin/env bash
# One device call for the optimizer states (issue 45), results under $1 (default $OUT): the Llama-3-8B full
# fine-tune with int8 moments and bf16 weights rounded stochastically (configs/llama3-8b-1xh100-8bit.yaml)
# stepped on the attached GPU with `jaxmem bench` (compiled vs the allocator's measured peak, step time), then
# scripts/bench_host_update.py on that machine's host CPU (the update under host compute inside a GPU program,
# against torch's fused AdamW on the same CPU).
# Run from the repo root on a GPU machine: bash scripts/gpu_optimizer_states.sh OUTDIR
set -u
out=${1:-$OUT}
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
python3 -c 'import jax; print("jax", jax.__version__, jax.devices()[0].device_kind)'
timeout "${BENCH_TIMEOUT:-300}" python3 -m jaxmem.cli bench configs/llama3-8b-1xh100-8bit.yaml checkpoint.every=0 \
  data.kind=synthetic --steps 4 --warmup 2 --json "$out/bench_llama3_8b_1xh100_8bit.json" > "$out/bench_8bit.txt" 2>&1
echo "bench rc=$?"; tail -25 "$out/bench_8bit.txt"
timeout "${HOST_TIMEOUT:-200}" python3 scripts/bench_host_update.py --platform cuda --params "${HOST_PARAMS:-2e8}" \
  --rounds 3 --json "$out/host_update_gpu_host.json" --md "$out/host_update_gpu_host.md" > "$out/host_update.txt" 2>&1
echo "host update rc=$?"; tail -30 "$out/host_update.txt"
