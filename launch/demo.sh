#!/usr/bin/env bash
# The main job: build the embedded default corpus (Python's own sources and docs, no download),
# train a sentencepiece tokenizer, write webdataset shards, then train a small GPT on 2 CPU ranks
# through the real `deepspeed` launcher (DeepSpeed ZeRO over megatron-core layers), writing
# TensorBoard logs and a checkpoint. Run launch/setup.sh first (the README's command does).
#
#   bash launch/demo.sh [--set key=value ...]
#   DEMO_DIR=runs/demo-ascender bash launch/demo.sh --set model.architecture=ascender
#     (another model needs another DEMO_DIR: a re-run resumes DEMO_DIR's checkpoint, which must match)
# Environment: DEMO_DIR (runs/demo), DEMO_CONFIG (configs/demo.yaml), DEMO_CORPUS_BYTES (6000000),
#              DEMO_VOCAB (4096), DEMO_SEQ (128), NUM_RANKS (2)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
DEMO_DIR=${DEMO_DIR:-runs/demo}
DEMO_CONFIG=${DEMO_CONFIG:-configs/demo.yaml}
DATA="$DEMO_DIR/data"
NUM_RANKS=${NUM_RANKS:-2}

# each step's output appears only once complete (written atomically; the tokenizer's .model after its
# .vocab and .json) and is never replaced: a re-run after an interruption skips the steps that finished
if [ ! -f "$DATA/shards/manifest.json" ]; then
  [ -f "$DATA/corpus.jsonl" ] ||
    data-pipeline build-corpus --out "$DATA/corpus.jsonl" --max-bytes "${DEMO_CORPUS_BYTES:-6000000}"
  [ -f "$DATA/tokenizer.model" ] ||
    data-pipeline train-tokenizer --input "$DATA/corpus.jsonl" --out-prefix "$DATA/tokenizer" \
      --vocab-size "${DEMO_VOCAB:-4096}"
  data-pipeline shard --input "$DATA/corpus.jsonl" --tokenizer "$DATA/tokenizer.model" \
    --out-dir "$DATA/shards" --seq-length "${DEMO_SEQ:-128}" --samples-per-shard 512 --val-fraction 0.05
fi

# The deepspeed launcher leaves OMP_NUM_THREADS unset (every rank would use every core).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NUM_RANKS > 0 ? $(nproc) / NUM_RANKS : 1 ))}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
PORT=$(python -c 'from ascender_dist.ports import free_port; print(free_port())')  # below the ephemeral range
# --hostfile /dev/null: this machine alone, even where DeepSpeed's default /job/hostfile exists (it
# would make this a pdsh launch over that file's hosts)
deepspeed --hostfile /dev/null --num_accelerators "$NUM_RANKS" --master_port "$PORT" launch/train.py \
  --config "$DEMO_CONFIG" \
  --set "output_dir=$DEMO_DIR" \
  --set "data.manifest=$DATA/shards/manifest.json" \
  --set "data.tokenizer=$DATA/tokenizer.model" \
  --set "model.vocab_size=${DEMO_VOCAB:-4096}" \
  --set "model.seq_length=${DEMO_SEQ:-128}" \
  "$@"
printf 'TensorBoard: %q --logdir %q\n' "$PWD/.venv/bin/tensorboard" "$(cd "$DEMO_DIR" && pwd)/tensorboard"
