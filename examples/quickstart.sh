#!/usr/bin/env bash
# The main job on the bundled example: tokenize the bundled corpus (Python's documentation) with GPT-2's
# BPE into Megatron .bin/.idx files, then pretrain a small GPT-2-style model with TP=2 x DP=2 on 4 CPU
# processes. Extra arguments go to pretrain_gpt.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/quickstart}
mkdir -p "$OUT/data"
read -r VOCAB MERGES < <($PYTHON -c "from megatronish.data.tokenizers import gpt2_files; print(*gpt2_files())")
PREFIX="$OUT/data/python_docs"
if [ ! -f "${PREFIX}_text_document.idx" ]; then
  $PYTHON tools/preprocess_data.py --input examples/corpus/python_docs.jsonl --json-keys text \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod \
    --output-prefix "$PREFIX" --workers 2
fi
OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt.py \
  --tensor-model-parallel-size 2 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
  --attention-dropout 0.0 --hidden-dropout 0.0 \
  --micro-batch-size 8 --global-batch-size 16 --train-iters 100 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 \
  --data-path "${PREFIX}_text_document" --split 98,2,0 --data-cache-path "$OUT/cache" \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
  --log-interval 10 --eval-interval 50 --eval-iters 4 --metrics-file "$OUT/metrics.jsonl" "$@"
