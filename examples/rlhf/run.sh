#!/usr/bin/env bash
# The example RLHF pipeline on the sorting task with a tiny byte-level GPT, on CPU:
# SFT -> reward model -> PPO (critic from the reward model), then DPO and GRPO from the same SFT
# model, and PPO against the reward model. Each stage writes runs/rlhf-example/<stage>/
# (weights, metrics.jsonl, summary.json, SVG plots). About 2 minutes on 2 CPU cores.
#   bash examples/rlhf/run.sh            (from the repository's root)
set -euo pipefail
cd "$(dirname "$0")/../.."
TESSERA=${TESSERA:-tessera}
for stage in sft rm ppo dpo grpo; do
    "$TESSERA" rlhf "$stage" "examples/rlhf/$stage.yaml"
done
"$TESSERA" rlhf ppo examples/rlhf/ppo-rm.yaml
