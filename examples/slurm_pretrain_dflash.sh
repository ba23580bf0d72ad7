#!/usr/bin/env bash
# Train a DFlash draft for a Qwen3-8B target on SLURM: 2 nodes x 8 GPUs, TP=2 (draft and megatron target),
# DP=8, torch_dist checkpoints every 500 iterations, resumable (re-submitting the same script resumes from
# the latest checkpoint in $SAVE), HF export of the draft at the end.
#
#   sbatch examples/slurm_pretrain_dflash.sh
#
# Adjust the paths below. The MASK token must be an existing row of the target's embedding (Qwen3 drafters
# use 151669, the first row past the tokenizer's ids: what the trainer chooses without the flag). Data: one chat per line, {"messages": [{"role": ..., "content": ...}]}
# (target-generated responses give the best acceptance), or a Megatron indexed dataset with
# --data-format indexed --data-path PREFIX.
#
#SBATCH --job-name=dflash-qwen3-8b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --exclusive
#SBATCH --output=%x-%j.out

set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
TARGET=${TARGET:-/models/Qwen3-8B}                   # HF directory of the frozen target
TRAIN_DATA=${TRAIN_DATA:-/data/dflash/train.jsonl}   # chat JSONL
VALID_DATA=${VALID_DATA:-/data/dflash/valid.jsonl}
EVAL_PROMPTS=${EVAL_PROMPTS:-/data/dflash/eval_prompts.jsonl}   # {"messages": [...]} / {"prompt": ...} lines
SAVE=${SAVE:-/checkpoints/dflash-qwen3-8b}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=8
export CUDA_DEVICE_MAX_CONNECTIONS=1

ARGS=(
  # parallelism: world 16 = TP 2 x PP 1 x DP 8
  --tensor-model-parallel-size 2
  --pipeline-model-parallel-size 1
  --bf16
  # target
  --target "$TARGET"
  --target-backend megatron
  # draft
  --dflash-variant dflash
  --dflash-num-layers 5
  --dflash-block-size 16
  --dflash-anchors-per-sample 512
  --dflash-decay-gamma 7
  --dflash-mask-token-id 151669
  --dflash-loss-chunk 2048
  # data
  --data-format chat
  --train-data "$TRAIN_DATA"
  --valid-data "$VALID_DATA"
  --pack-sequences
  --seq-length 4096
  --micro-batch-size 1
  --global-batch-size 128
  # optimisation
  --train-iters 20000
  --lr 6e-4
  --min-lr 6e-5
  --lr-warmup-iters 400
  --lr-decay-style cosine
  --weight-decay 0.01
  --adam-beta1 0.9
  --adam-beta2 0.95
  --clip-grad 1.0
  --seed 1234
  # checkpoints, evaluation, logging
  --save "$SAVE"
  --load "$SAVE"
  --save-interval 500
  --eval-interval 1000
  --eval-iters 10
  --log-interval 10
  --tensorboard-dir "$SAVE/tensorboard"
  --dflash-eval-prompts "$EVAL_PROMPTS"
  --dflash-export "$SAVE/hf"
  --no-progress-bar
)

# One torchrun per node; torchrun starts GPUS_PER_NODE ranks and sets RANK / WORLD_SIZE / LOCAL_RANK.
srun --kill-on-bad-exit=1 bash -c "
  cd '$REPO' && torchrun \
    --nnodes \$SLURM_JOB_NUM_NODES --node-rank \$SLURM_NODEID --nproc-per-node $GPUS_PER_NODE \
    --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id \$SLURM_JOB_ID \
    pretrain_dflash.py ${ARGS[*]@Q}
"

# With --target-backend megatron the acceptance evaluation is skipped inside the job (the target runs
# sharded); measure the exported draft on one GPU:
#   python tools/evaluate_acceptance.py --target "$TARGET" --draft "$SAVE/hf" --prompts "$EVAL_PROMPTS"
