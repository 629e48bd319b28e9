#!/usr/bin/env bash
# GPT-2 124M on one GPU node: the flag set a GPU user starts from. Megatron-LM's flags; ~10B tokens
# (19073 iterations x 512 sequences x 1024 tokens), bf16, distributed optimizer, overlapped grad reduction.
#
#   DATA=/data/owt_text_document NPROC=8 bash examples/gpt2_124m.sh [extra pretrain_gpt.py flags]
#
# Tokenize first with tools/preprocess_data.py (GPT2BPETokenizer, --append-eod). TP=1 suits a 124M model;
# everything else is data parallel. On several nodes use scripts/slurm/pretrain_gpt.sbatch with the same flags.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-8}
DATA=${DATA:?set DATA to a .bin/.idx prefix, e.g. /data/owt_text_document}
OUT=${OUT:-runs/gpt2_124m}
read -r VOCAB MERGES < <($PYTHON -c "from megatronish.data.tokenizers import gpt2_files; print(*gpt2_files())")
$PYTHON -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 \
  --position-embedding-type learned_absolute --normalization LayerNorm --init-method-std 0.02 \
  --attention-dropout 0.0 --hidden-dropout 0.0 \
  --micro-batch-size 16 --global-batch-size 512 --train-iters 19073 \
  --optimizer adam --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 715 \
  --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce \
  --data-path "$DATA" --split 990,10,0 --data-cache-path "$OUT/cache" \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 \
  --log-interval 10 --eval-interval 500 --eval-iters 20 --metrics-file "$OUT/metrics.jsonl" \
  --tensorboard-dir "$OUT/tensorboard" "$@"
