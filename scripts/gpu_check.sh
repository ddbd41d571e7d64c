#!/usr/bin/env bash
# On a GPU machine: the GPU-marked tests, hfcp's tile kernels against SDPA (flash) and per emulated rank, a short
# benchmark (one GPU: cp=1 model step and attention) and the job's full fine-tune mode.
# Under 8 minutes on one GPU: each step has its own time limit (seconds, first argument of `step`); a step that fails
# or runs out of time is reported, the others still run, and the script exits non-zero at the end.
# Multi-GPU: add --cps 1 2 4 to the bench lines (NCCL, one process per GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine')" || exit 1
failed=()
step() {  # step SECONDS COMMAND...: run COMMAND under its own time limit; note a failure and go on
  local limit=$1
  shift
  echo "== gpu_check.sh: $* (limit ${limit} s)"
  if ! timeout --kill-after 10 "$limit" "$@"; then
    failed+=("$*")
    echo "gpu_check.sh: FAILED or ran past ${limit} s: $*" >&2
  fi
}
step 90 python -m pytest -q -m gpu tests/attention/test_gpu.py
# the tile kernels: hfcp against SDPA's flash backend at 8K-32K tokens, and each emulated rank's tiles of a packed row
# at cp 2 / 4, balance='auto' against 'row' (every step of it has its own limit too)
step 120 python scripts/tools/gpu_kernels_check.py --step-timeout 20 --json runs/gpu_kernels.json
step 60 python scripts/bench/bench.py --level attention --lengths 8192 32768 --cps 1 --repeats 3 --out runs/bench_gpu_attention
step 60 python scripts/bench/bench.py --lengths 8192 32768 --cps 1 --repeats 3 --out runs/bench_gpu_model
# the full fine-tune mode on the GPU (one process: FSDP2 applies from two GPUs on, with the same command under
# accelerate launch --multi_gpu --num_processes N)
step 60 python scripts/finetune_lora.py --full-finetune --max-steps 20 --seq-len 4096 --eval-docs 2 --output-dir runs/gpu_full_finetune
# generation after a long prompt on the GPU (one process; under accelerate launch --multi_gpu --num_processes N the
# prompt and its KV cache spread over the GPUs), with --check against the unpatched model
step 60 python scripts/examples/generate_long.py --prompt-tokens 32768 --max-new-tokens 32 --width 256 --layers 4 --check --json runs/gpu_generate.json
# tensor parallelism x CP over NCCL (tp 2 x cp 2) when the machine has four GPUs
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 4 ]; then
  for s in ring ulysses; do step 90 torchrun --standalone --nproc-per-node 4 scripts/tools/check_tp_cp.py --strategy "$s"; done
else
  echo "gpu_check.sh: fewer than 4 GPUs, the tensor-parallel x CP check (scripts/tools/check_tp_cp.py) is skipped"
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf 'gpu_check.sh: %d step(s) failed or timed out:\n' "${#failed[@]}" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "gpu_check.sh: every step passed"
