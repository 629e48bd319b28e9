#!/usr/bin/env bash
# The main job on the bundled example, end to end on CPU:
#   1. tokenize the bundled corpus (Python's documentation) with GPT-2's BPE into Megatron .bin/.idx files;
#   2. pretrain a small GPT-2-style model with TP=2 x PP=2 x DP=2 on 8 CPU processes, saving a checkpoint;
#   3. export the checkpoint to a Hugging Face GPT2LMHeadModel directory;
#   4. load that directory with transformers and sample a few tokens;
#   5. sample from our own checkpoint (saved at TP=2 x PP=2, loaded at TP=1) with tools/generate.py.
# Extra arguments go to pretrain_gpt.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/quickstart}
mkdir -p "$OUT/data"
read -r VOCAB MERGES < <($PYTHON -c "from megatronish.data.tokenizers import gpt2_files; print(*gpt2_files())")
PREFIX="$OUT/data/python_docs"
if [ ! -f "${PREFIX}_text_document.idx" ]; then
  echo "== 1/5 tokenizing examples/corpus/python_docs.jsonl"
  $PYTHON tools/preprocess_data.py --input examples/corpus/python_docs.jsonl --json-keys text \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod \
    --output-prefix "$PREFIX" --workers 2
fi
echo "== 2/5 training (TP=2 x PP=2 x DP=2, 8 processes)"
rm -rf "$OUT/checkpoints" "$OUT/hf"
OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc-per-node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
  --attention-dropout 0.0 --hidden-dropout 0.0 \
  --micro-batch-size 4 --global-batch-size 16 --train-iters 80 \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 8 --weight-decay 0.1 --clip-grad 1.0 \
  --data-path "${PREFIX}_text_document" --split 98,2,0 --data-cache-path "$OUT/cache" \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
  --save "$OUT/checkpoints" \
  --log-interval 10 --eval-interval 40 --eval-iters 2 --metrics-file "$OUT/metrics.jsonl" "$@"
echo "== 3/5 exporting $OUT/checkpoints to Hugging Face ($OUT/hf)"
$PYTHON tools/checkpoint/convert.py --model-type GPT --loader megatronish --saver hf \
  --load-dir "$OUT/checkpoints" --save-dir "$OUT/hf"
echo "== 4/5 sampling from the exported model with transformers"
$PYTHON examples/sample_hf.py "$OUT/hf" --prompt "The Python" --max-new-tokens 32 --temperature 0.8
echo "== 5/5 sampling from our checkpoint with tools/generate.py (KV cache, TP=1)"
$PYTHON tools/generate.py --load "$OUT/checkpoints" --use-checkpoint-args \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
  --prompts "The Python" --num-tokens-to-generate 32 --temperature 0.8 --top_k 0 --seed 1234
