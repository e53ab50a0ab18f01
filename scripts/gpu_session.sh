#!/usr/bin/env bash
# One device call: train-step benches (`jaxmem bench`, each case in its own process), results under $1 (default $OUT).
# Run from the repo root on a GPU machine: PYTHONPATH=. bash scripts/gpu_session.sh OUTDIR [CASE ...]
# With no CASE, every case below runs in order; GMM=1 also runs scripts/bench_grouped_matmul.py (GMM_ARGS: its
# extra flags), KERNELS=1 scripts/bench_kernels_gpu.py, NUMERICS=1 (first) scripts/gpu_kernel_numerics.py,
# HOST_ADAMW=1 (first) scripts/gpu_host_update_check.py (the fused host update's numerics and speed on the GPU).
# The device tool brings back 8 files at most: tar OUTDIR.
set -u
out=${1:-$OUT}; shift || true
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
common="parallel.fsdp=1 parallel.rules=fsdp precision.param_dtype=bfloat16 precision.compute_dtype=bfloat16
  precision.master_weights=true checkpoint.every=0 data.kind=synthetic train.micro_batch=1"
one_b="model.preset=llama3.2-1b train.seq_len=8192 remat.preset=selective"
qwen3_qlora="model.preset=qwen3-30b-a3b model.n_layers=4 train.seq_len=8192 remat.preset=full lora.rank=16
  lora.targets=all-linear lora.base_dtype=nf4"
mixtral="model.preset=mixtral-8x7b model.n_layers=2 train.seq_len=8192 remat.preset=full"
declare -A CASES=(
  [1b_s8k_sel_auto]="configs/tiny.yaml $common $one_b"
  [1b_s8k_sel_pallas]="configs/tiny.yaml $common $one_b kernels.attention=pallas"
  [8bx8_s8k_full_auto]="configs/tiny.yaml $common model.preset=llama3-8b model.n_layers=8 train.seq_len=8192 remat.preset=full"
  [qwen3moe_x2_s4k_full]="configs/tiny.yaml $common model.preset=qwen3-30b-a3b model.n_layers=2 train.seq_len=4096 remat.preset=full"
  [qwen3moe_x4_s8k_full]="configs/tiny.yaml $common model.preset=qwen3-30b-a3b model.n_layers=4 train.seq_len=8192 remat.preset=full"
  [qwen3moe_x4_s8k_full_pallas]="configs/tiny.yaml $common model.preset=qwen3-30b-a3b model.n_layers=4 train.seq_len=8192 remat.preset=full kernels.grouped_matmul=pallas"
  [qwen3moe_x4_s8k_qlora_blocked]="configs/tiny.yaml $common $qwen3_qlora kernels.grouped_matmul=blocked"
  [qwen3moe_x4_s8k_qlora_pallas]="configs/tiny.yaml $common $qwen3_qlora kernels.grouped_matmul=pallas"
  [mixtral_x2_s8k_full_blocked]="configs/tiny.yaml $common $mixtral kernels.grouped_matmul=blocked"
  [mixtral_x2_s8k_full_auto]="configs/tiny.yaml $common $mixtral"
  [qlora_8b_qv_s512]="configs/lora/llama3-8b-qlora-qv-seq512.yaml checkpoint.every=0 data.kind=synthetic"
  [4090_8bx8_s4k]="configs/llama3-8b-1x4090.yaml model.n_layers=8 checkpoint.every=0 data.kind=synthetic"
  [gptoss_x2_s64k_qlora]="configs/moe/gpt-oss-20b-qlora-1xh100.yaml model.n_layers=2 checkpoint.every=0
    data.kind=synthetic"
  [gemma3_x6_s8k_host]="configs/gemma3-12b-1xh100.yaml model.n_layers=6 checkpoint.every=0 data.kind=synthetic"
  [gemma3_x6_s8k_hostupd]="configs/gemma3-12b-1xh100.yaml model.n_layers=6 checkpoint.every=0 data.kind=synthetic
    offload.optimizer_update=host kernels.host_update=xla"
  [gemma3_x6_s8k_hostupd_fused]="configs/gemma3-12b-1xh100.yaml model.n_layers=6 checkpoint.every=0
    data.kind=synthetic offload.optimizer_update=host kernels.host_update=fused"
)
ORDER=(8bx8_s8k_full_auto qwen3moe_x2_s4k_full qlora_8b_qv_s512 1b_s8k_sel_auto 1b_s8k_sel_pallas)
[ $# -gt 0 ] && ORDER=("$@")
python3 -c 'import jax; print("jax", jax.__version__, jax.devices()[0].device_kind)'
if [ "${NUMERICS:-0}" = 1 ]; then
  timeout "${NUMERICS_TIMEOUT:-150}" python3 scripts/gpu_kernel_numerics.py "$out/kernel_numerics.json" \
    > "$out/kernel_numerics.txt" 2>&1
  echo "numerics rc=$?"; grep -E ": (ok|FAIL)" "$out/kernel_numerics.txt"
fi
if [ "${HOST_ADAMW:-0}" = 1 ]; then
  timeout "${HOST_ADAMW_TIMEOUT:-240}" python3 scripts/gpu_host_update_check.py "$out/host_update_check.json" \
    > "$out/host_update_check.txt" 2>&1
  echo "host adamw rc=$?"; grep -E "^(numerics|median)" "$out/host_update_check.txt"
fi
for name in "${ORDER[@]}"; do
  # shellcheck disable=SC2086
  timeout "${CASE_TIMEOUT:-150}" python3 -m jaxmem.cli bench ${CASES[$name]} --steps "${STEPS:-8}" \
    --json "$out/bench_$name.json" > "$out/bench_$name.txt" 2>&1
  echo "bench $name rc=$?"; grep -E "step time|tokens/s|device bytes|peak|MFU" "$out/bench_$name.txt" | head -8
done
if [ "${GMM:-0}" = 1 ]; then timeout "${GMM_TIMEOUT:-150}" python3 scripts/bench_grouped_matmul.py --out "$out" --no-plan ${GMM_ARGS:-} > "$out/gmm.txt" 2>&1; echo "gmm rc=$?"; tail -12 "$out/gmm.txt"; fi
if [ "${KERNELS:-0}" = 1 ]; then python3 scripts/bench_kernels_gpu.py "$out" --budget "${KERNEL_BUDGET:-300}"; fi
