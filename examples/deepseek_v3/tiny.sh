#!/usr/bin/env bash
# A tiny DeepSeek-V3 on CPU, end to end: multi-latent attention with a query latent and YaRN, one dense layer then
# three MoE layers (8 experts, 4 per token from the best 2 of 4 groups, sigmoid scores with the expert bias, scaled
# by 2.5, a shared expert), trained for a few iterations on mock data with EP 2 (2 processes), exported with
# tools/checkpoint/convert.py to a transformers DeepseekV3ForCausalLM directory, which gives our logits.
# Extra arguments go to pretrain_gpt.py (e.g. --train-iters 20).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/deepseek_v3_tiny}
rm -rf "$OUT/checkpoints" "$OUT/hf"
echo "== 1/3 training (EP=2, 2 processes)"
OMP_NUM_THREADS=1 $PYTHON -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_gpt.py \
  --expert-model-parallel-size 2 \
  --num-layers 4 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 8 \
  --seq-length 32 --max-position-embeddings 32 \
  --multi-latent-attention --q-lora-rank 24 --kv-lora-rank 20 --qk-head-dim 12 --qk-pos-emb-head-dim 8 \
  --v-head-dim 10 --qk-layernorm --rope-type yarn --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 0.8 \
  --yarn-original-max-position-embeddings 8 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights --position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0 \
  --num-experts 8 --moe-layer-freq "([0]*1+[1]*3)" --moe-ffn-hidden-size 16 --moe-router-topk 4 \
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 4 \
  --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 32 \
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32 \
  --micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-3 --lr-warmup-iters 1 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 127 --seed 1234 \
  --save "$OUT/checkpoints" --log-interval 2 --eval-interval 1000 --eval-iters 1 "$@"
echo "== 2/3 exporting $OUT/checkpoints to transformers' DeepseekV3ForCausalLM ($OUT/hf)"
$PYTHON tools/checkpoint/convert.py --model-type GPT --loader megatronish --saver hf \
  --load-dir "$OUT/checkpoints" --save-dir "$OUT/hf"
echo "== 3/3 transformers' logits against ours"
$PYTHON examples/deepseek_v3/compare_hf.py "$OUT/checkpoints" "$OUT/hf"
