#!/usr/bin/env bash
# The one-GPU check (issue 9): QLoRA steps and decode on a random Qwen2.5-7B-shaped model in NF4, qwenft vs the
# plain transformers + peft baseline. Needs a CUDA machine with torch, transformers, peft, bitsandbytes,
# accelerate and this package installed; downloads nothing, installs nothing, reads no model files.
#
#   bash benchmarks/gpu/run.sh                       # full run (one H200: about 3-5 minutes)
#   bash benchmarks/gpu/run.sh --tiny                # shape-reduced model on the CPU (what the tests run)
#   bash benchmarks/gpu/run.sh --tiny --device cuda  # the tiny model on the GPU: a quick smoke check
#   OUT=/some/dir bash benchmarks/gpu/run.sh         # JSON into $OUT instead of benchmarks/results/
#
# Other options: python benchmarks/gpu/qlora_7b.py --help
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec python benchmarks/gpu/qlora_7b.py "$@"
