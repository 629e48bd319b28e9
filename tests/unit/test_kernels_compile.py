"""The compiled path without a GPU: every kernel, as the model launches it in bf16, compiles for an H100/H200
(sm_90) with Triton's bundled ptxas. Runs in a fresh process: this one interprets its kernels."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is not installed: the kernels extra (pip install -e '.[kernels]')")

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megatronish.kernels import fused_cross_entropy as C, fused_norms as N, fused_rope as R, fused_swiglu as S

    def compile_(fn, sig, consts):
        sig.update({k: "constexpr" for k in consts})
        triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        print("compiled", fn.__name__, consts)

    i32 = "i32"
    for rms in (True, False):
        flags = dict(RMS=rms, HAS_BIAS=not rms, BLOCK=4096, EXACT_BF16=False)
        compile_(N._norm_fwd, dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16", MEAN="*fp32", RSTD="*fp32",
                                   stride_x=i32, stride_y=i32, H=i32, eps="fp32"), flags)
        compile_(N._norm_bwd, dict(X="*bf16", W="*bf16", DY="*bf16", DX="*bf16", MEAN="*fp32", RSTD="*fp32",
                                   DW="*fp32", DB="*fp32", stride_x=i32, stride_dy=i32, stride_dx=i32, rows=i32,
                                   H=i32, rows_per_program=i32), flags)
    rope = dict(X="*bf16", COS="*fp32", SIN="*fp32", OUT="*bf16", B=i32, NH=i32, sx_s=i32, sx_b=i32, sx_h=i32,
                sx_d=i32, so_s=i32, so_b=i32, so_h=i32, so_d=i32, sc_s=i32, ss_s=i32, HALF=i32, D=i32)
    for backward in (False, True):
        compile_(R._rope, rope, dict(BACKWARD=backward, COPY_PASS=backward, BLOCK_H=32, BLOCK_HALF=64,
                                     BLOCK_PASS=64, EXACT_BF16=False))
    compile_(S._swiglu_fwd, dict(H="*bf16", OUT="*bf16", stride_h=i32, stride_o=i32, F=i32),
             dict(BLOCK=1024, EXACT_BF16=False))
    compile_(S._swiglu_bwd, dict(H="*bf16", G="*bf16", DH="*bf16", stride_h=i32, stride_g=i32, stride_dh=i32,
                                 F=i32), dict(BLOCK=1024, EXACT_BF16=False))
    compile_(C._ce_fwd, dict(LOGITS="*bf16", TARGET="*i64", MAX="*fp32", SUMEXP="*fp32", PRED="*fp32",
                             SUMX="*fp32", stride_row=i32, part=i32, start=i32, total_vocab=i32), dict(BLOCK_V=4096))
    compile_(C._ce_bwd, dict(LOGITS="*bf16", GRAD="*bf16", TARGET="*i64", MAX="*fp32", SUMEXP="*fp32",
                             GLOSS="*fp32", stride_row=i32, stride_grad=i32, part=i32, start=i32, total_vocab=i32,
                             target_weight="fp32", delta="fp32"), dict(BLOCK_V=4096, EXACT_BF16=False))
''')


def test_kernels_compile_for_sm90(tmp_path):
    try:
        import triton.backends.nvidia  # noqa: F401 - only whether it imports
    except ImportError:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1", MEGATRONISH_DEVICE="cpu")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("compiled") == 10, r.stdout
