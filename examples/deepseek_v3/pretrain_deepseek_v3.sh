#!/usr/bin/env bash
# DeepSeek-V3's shape (671B parameters, 37B active): 61 layers, hidden 7168, 128 heads of multi-latent attention
# (query latent 1536, key/value latent 512, 128 + 64 query/key channels, 128 value channels), YaRN (factor 40 over a
# 4096-token original context), the first three layers dense (FFN 18432), then 256 routed experts (FFN 2048), 8 per
# token from the best 4 of 8 groups, sigmoid scores with the expert bias, scaled by 2.5, and one shared expert;
# bf16, TP 8 with sequence parallelism, EP 64, the distributed optimizer, full recompute. On GPU nodes:
#
#   DATA=/data/corpus_text_document TOKENIZER=/models/deepseek-v3 NPROC=8 NNODES=128 \
#     MASTER_ADDR=... NODE_RANK=... bash examples/deepseek_v3/pretrain_deepseek_v3.sh
#
# 61 layers do not split evenly over pipeline stages and an uneven split is not available here, so this layout has
# no pipeline parallelism. Multi-token prediction is not built (docs/deepseek.md). Start from DeepSeek-V3's
# released weights (FP8, dequantized to bf16 on import) with
#   python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatronish \
#     --load-dir /models/deepseek-v3 --save-dir "$OUT/checkpoints" --target-tensor-parallel-size 8
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-8}
NNODES=${NNODES:-128}
DATA=${DATA:?set DATA to a .bin/.idx prefix}
TOKENIZER=${TOKENIZER:?set TOKENIZER to a tokenizer.json file or directory}
OUT=${OUT:-runs/deepseek_v3}
$PYTHON -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" \
  pretrain_gpt.py \
  --tensor-model-parallel-size 8 --sequence-parallel --expert-model-parallel-size 64 \
  --expert-tensor-parallel-size 1 \
  --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 \
  --seq-length 4096 --max-position-embeddings 163840 \
  --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 \
  --v-head-dim 128 --qk-layernorm --rope-type yarn --rotary-base 10000 --rotary-scaling-factor 40 \
  --mscale 1.0 --mscale-all-dim 1.0 --yarn-original-max-position-embeddings 4096 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights --position-embedding-type rope \
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.006 \
  --num-experts 256 --moe-layer-freq "([0]*3+[1]*58)" --moe-ffn-hidden-size 2048 --moe-router-topk 8 \
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 \
  --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 \
  --moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss \
  --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32 --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
  --micro-batch-size 1 --global-batch-size 1536 --train-iters 100000 \
  --optimizer adam --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --adam-beta1 0.9 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 \
  --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --data-path "$DATA" --split 990,10,0 --data-cache-path "$OUT/cache" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 \
  --log-interval 10 --eval-interval 1000 --eval-iters 20 --metrics-file "$OUT/metrics.jsonl" \
  --tensorboard-dir "$OUT/tensorboard" "$@"
