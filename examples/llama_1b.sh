#!/usr/bin/env bash
# A Llama-style 1B model (Llama 3.2 1B's shape: 16 layers, hidden 2048, SwiGLU 8192, 32 heads with 8 KV groups,
# RoPE base 500000, RMSNorm, tied embeddings, no biases) on GPU nodes: bf16, TP=2 with sequence parallelism,
# distributed optimizer, overlapped grad reduction and param gather, selective recompute.
#
#   DATA=/data/corpus_text_document TOKENIZER=/models/llama3/tokenizer.json NPROC=8 bash examples/llama_1b.sh
#
# Tokenize with tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER".
# Add --fp8-format hybrid --transformer-impl transformer_engine on Hopper with Transformer Engine installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-8}
DATA=${DATA:?set DATA to a .bin/.idx prefix}
TOKENIZER=${TOKENIZER:?set TOKENIZER to a tokenizer.json file or directory}
OUT=${OUT:-runs/llama_1b}
$PYTHON -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --tensor-model-parallel-size 2 --sequence-parallel \
  --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 \
  --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 \
  --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu \
  --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 \
  --micro-batch-size 2 --global-batch-size 256 --train-iters 50000 \
  --optimizer adam --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --recompute-granularity selective \
  --data-path "$DATA" --split 990,10,0 --data-cache-path "$OUT/cache" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 \
  --log-interval 10 --eval-interval 1000 --eval-iters 20 --metrics-file "$OUT/metrics.jsonl" \
  --tensorboard-dir "$OUT/tensorboard" "$@"
