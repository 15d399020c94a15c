#!/usr/bin/env bash
# GPU smoke check (under 2 minutes): train (killed after its first checkpoint, then train.resume=auto), eval, generate
# and merge on the tiny-random model in NF4, each a real `python -m qwenft` process checked for its exit code and
# files; on CUDA also train under dist=fsdp (and deepspeed_zero2/3 where installed), one process each. Runs on the
# GPU when CUDA is there, else on the CPU (as the tests run it).
#
#   bash benchmarks/gpu/smoke.sh            # a table of steps; exit 1 if any failed
#   OUT=/some/dir bash benchmarks/gpu/smoke.sh   # also $OUT/gpu_smoke.json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec python benchmarks/gpu/smoke.py "$@"
