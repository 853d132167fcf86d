"""AOT-compile every tree_verify, build_tree and tree-step kernel for NVIDIA targets without a GPU.

Run as a script in a process WITHOUT ``TRITON_INTERPRET`` (the @triton.jit
decorator picks interpreter mode at import time). Prints one line per compiled
variant and exits non-zero on the first failure.

    python tests/kernels/aot_compile.py 90 80
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _shim import ensure_kernels_importable  # noqa: E402

ensure_kernels_importable()

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import importlib  # noqa: E402

# NOTE: the package attributes `tree_verify`/`build_tree` are the functions; take the modules.
K = importlib.import_module("ddtree_patcher.kernels.tree_verify")
BT = importlib.import_module("ddtree_patcher.kernels.build_tree")
TA = importlib.import_module("ddtree_patcher.kernels.tree_attention")
KC = importlib.import_module("ddtree_patcher.kernels.kv_compact")


def _sig(fn, types, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = types[name]
    return sig


WALK_PTRS = dict(
    output_token_ids_ptr="*i32", accepted_rows_ptr="*i32", num_accepted_ptr="*i32",
    scratch_ptr="*i32", draft_token_ids_ptr="*i32", draft_parent_ids_ptr="*i32",
    cu_num_draft_tokens_ptr="*i32", target_argmax_ptr="*i64", target_probs_ptr="*fp32",
    is_greedy_ptr="*i1", coins_ptr="*fp64", seeds_ptr="*i64", positions_ptr="*i64",
    batch_size="i32", width="i32", vocab_size="i32",
)
SAMPLE_PTRS = dict(
    block_max_ptr="*fp32", block_idx_ptr="*i32", scratch_ptr="*i32", num_accepted_ptr="*i32",
    draft_token_ids_ptr="*i32", draft_parent_ids_ptr="*i32", cu_num_draft_tokens_ptr="*i32",
    target_probs_ptr="*fp32", is_greedy_ptr="*i1", inv_exp_noise_ptr="*fp32",
    seeds_ptr="*i64", positions_ptr="*i64", batch_size="i32", width="i32", vocab_size="i32",
)
REDUCE_PTRS = dict(
    output_token_ids_ptr="*i32", block_max_ptr="*fp32", block_idx_ptr="*i32", scratch_ptr="*i32",
    num_accepted_ptr="*i32", is_greedy_ptr="*i1", batch_size="i32", width="i32",
)


CHUNK_PTRS = dict(
    logits_ptr="*bf16", active_ptr="*i1", part_key_ptr="*i64", part_m_ptr="*fp32",
    part_s_ptr="*fp32", idx_scr_ptr="*i32", L="i32", V="i32", stride_b="i32", stride_l="i32",
    NCH="i32",
)
MERGE_PTRS = dict(
    part_key_ptr="*i64", part_m_ptr="*fp32", part_s_ptr="*fp32", active_ptr="*i1",
    top_lp_ptr="*fp32", top_id_ptr="*i32", lse_ptr="*fp32", L="i32", V="i32", NCH="i32",
)
SEG_PTRS = dict(
    logits_ptr="*bf16", active_ptr="*i1", part_key_ptr="*i64", part_m_ptr="*fp32",
    part_s_ptr="*fp32", scr_ptr="*i32", ticket_ptr="*i32", top_lp_ptr="*fp32", top_id_ptr="*i32",
    lse_ptr="*fp32", L="i32", V="i32", stride_b="i32", stride_l="i32", NSEG="i32", SEG="i32",
    K="i32",
)
TREE_PTRS = dict(
    top_lp_ptr="*fp32", top_id_ptr="*i32", active_ptr="*i1", tok_ptr="*i32", par_ptr="*i32",
    dep_ptr="*i32", score_ptr="*fp32", mask_ptr="*i32", exact_ptr="*i1", ord_ptr="*i32", L="i32",
    K="i32", budget="i32", NW="i32",
)


# as launched: 4 warps, the register cap, 16-divisible strides / vocab / segment (the JIT
# specialises them so: the 16-byte loads depend on it)
SEG_OPTS = dict(num_warps=4, maxnreg=BT.PRODUCTION.seg_maxnreg, div=("V", "stride_b", "stride_l", "SEG"))


def build_tree_variants():
    """The variants bench_build_tree.py launches (L = 16, V = 151,936, budgets 16/64/256)."""
    for dtype, vec, kp, active, ntp, nsegp in (("*bf16", 8, 16, False, 64, 1),
                                               ("*bf16", 8, 16, True, 2, 32),
                                               ("*fp32", 4, 32, False, 16, 4)):
        if True:
            yield f"build_tree seg {dtype[1:]} KP={kp} active={active}", BT._seg_kernel, dict(
                SEG_PTRS, logits_ptr=dtype), dict(
                active_ptr="keep" if active else None, U=4096 // (128 * vec), NTHR=128, VEC=vec,
                NTP=ntp, KP=kp, CS=16, NSEGP=nsegp, HAS_ACTIVE=active, STAGES=BT.PRODUCTION.seg_stages), SEG_OPTS
    for dtype in ("*bf16", "*fp32"):  # K + 1 > 32: chunk + merge kernels
        for kp, active in ((64, False), (64, True)):
            yield f"build_tree chunk {dtype[1:]} KP={kp} active={active}", BT._chunk_kernel, dict(
                CHUNK_PTRS, logits_ptr=dtype), dict(
                active_ptr="keep" if active else None, CHUNK=8192, KP=kp,
                CAPT=max(128, 8 * kp), SUB=1024, HAS_ACTIVE=active,
                KEY32=dtype == "*bf16"), 0
    for kp, active in ((64, False), (64, True)):
        yield f"build_tree merge KP={kp} active={active}", BT._merge_kernel, MERGE_PTRS, dict(
            active_ptr="keep" if active else None, NCHP=32, KP=kp, HAS_ACTIVE=active), 0
    # the runtime's builds: no mask, spine-first (ddtree_patcher.runtime.ddtree.SPINE_FIRST)
    for n, mask, active, sf in ((16, True, False, False), (64, True, True, False), (256, True, False, False),
                                (256, False, False, False), (64, True, True, True), (63, False, True, True),
                                (256, False, False, True)):
        np_ = max(32, 1 << (n - 1).bit_length())
        nwp = 1 << ((n + 32) // 32 - 1).bit_length()
        yield f"build_tree tree n={n} mask={mask} active={active} spine_first={sf}", BT._tree_kernel, TREE_PTRS, dict(
            active_ptr="keep" if active else None, mask_ptr="keep" if mask else None,
            ord_ptr="keep" if sf else None, KP=16,
            NP=np_, NWP=nwp, RB=max(1, min(1 << n.bit_length(), 1024 // nwp)), HAS_ACTIVE=active,
            WRITE_MASK=mask, TP=256, SPINE_FIRST=sf, W0=min(np_, BT.PRODUCTION.frontier_start),
            NPH=(np_ // min(np_, BT.PRODUCTION.frontier_start)).bit_length() - 1), dict(num_warps=1)


def variants():
    yield from build_tree_variants()
    for block_n in (16, 1024):
        yield "walk all-greedy", K.tree_verify_walk_kernel, WALK_PTRS, dict(
            target_probs_ptr=None, is_greedy_ptr=None, coins_ptr=None, seeds_ptr=None,
            positions_ptr=None, BLOCK_N=block_n, BLOCK_W=16, ALL_GREEDY=True, ALL_SAMPLED=False,
            HAS_COINS=False, HAS_POSITIONS=False, CHECK_DUPLICATES=True, DUP_CHUNK=K.DUP_CHUNK), block_n
        yield "walk sampled+coins", K.tree_verify_walk_kernel, WALK_PTRS, dict(
            target_argmax_ptr=None, is_greedy_ptr=None, seeds_ptr=None, positions_ptr=None,
            BLOCK_N=block_n, BLOCK_W=16, ALL_GREEDY=False, ALL_SAMPLED=True, HAS_COINS=True,
            HAS_POSITIONS=False, CHECK_DUPLICATES=True, DUP_CHUNK=K.DUP_CHUNK), block_n
        yield "walk mixed+philox", K.tree_verify_walk_kernel, WALK_PTRS, dict(
            coins_ptr=None, BLOCK_N=block_n, BLOCK_W=16, ALL_GREEDY=False, ALL_SAMPLED=False,
            HAS_COINS=False, HAS_POSITIONS=True, CHECK_DUPLICATES=False, DUP_CHUNK=K.DUP_CHUNK), block_n
    for noise in (True, False):
        yield f"sample noise={noise}", K.tree_verify_sample_kernel, SAMPLE_PTRS, dict(
            is_greedy_ptr=None, inv_exp_noise_ptr=None if not noise else "keep",
            seeds_ptr=None if noise else "keep", positions_ptr=None if noise else "keep",
            NUM_VBLOCKS=38, BLOCK_V=4096, BLOCK_N=64, ALL_SAMPLED=True, HAS_NOISE=noise,
            HAS_POSITIONS=not noise), 64
        yield f"sample mixed noise={noise}", K.tree_verify_sample_kernel, SAMPLE_PTRS, dict(
            inv_exp_noise_ptr=None if not noise else "keep",
            seeds_ptr=None if noise else "keep", positions_ptr="keep" if not noise else None,
            NUM_VBLOCKS=38, BLOCK_V=4096, BLOCK_N=1024, ALL_SAMPLED=False, HAS_NOISE=noise,
            HAS_POSITIONS=not noise), 1024
    yield "reduce", K.tree_verify_reduce_kernel, REDUCE_PTRS, dict(
        is_greedy_ptr=None, NUM_VBLOCKS=38, BLOCK_VB=64, ALL_SAMPLED=True), 0
    yield "reduce mixed", K.tree_verify_reduce_kernel, REDUCE_PTRS, dict(
        NUM_VBLOCKS=38, BLOCK_VB=64, ALL_SAMPLED=False), 0


# ---- tree-shaped target step (issue 13): kept apart from variants() so merges stay easy ----
TREE_ATTN_PTRS = dict(
    q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", lse_ptr="*fp32",
    ctx_out_ptr="*bf16", ctx_lse_ptr="*fp32", block_table_ptr="*i32", qsl_ptr="*i32",
    ctx_len_ptr="*i32", mask_ptr="*i32", req_mask_ptr="*i1", qk_scale="fp32",
    **{s: "i32" for s in ("s_qt", "s_qh", "s_qd", "s_kb", "s_ko", "s_kh", "s_kd", "s_vb", "s_vo",
                          "s_vh", "s_vd", "s_ot", "s_oh", "s_od", "s_lh", "s_lt", "s_cot",
                          "s_coh", "s_cod", "s_clh", "s_clt", "s_btr", "s_mr", "s_mn", "s_mw",
                          "block_size", "W")},
)
MOVE_PTRS = dict(
    ptr_table="*i64", slot_ptr="*i32", qsl_ptr="*i32", rows_ptr="*i32", nacc_ptr="*i32",
    pos_ptr="*i64", count_ptr="*i64", tree_ptr="*i1", s_rows="i32", s_blk="i64", s_off="i64",
    s_h="i64", s_x="i64", block_size="i32", W="i32", n_bins="i32",
)


def tree_step_variants():
    """What the integration and bench_tree_step.py launch on Hopper (Qwen3-8B shape: G = 4,
    D = 128; n = 16 / 64 -> BLOCK_T 32 / 64): the merge after FA3's context pass (bf16, with and
    without a request mask; fp16), the one-kernel mode, the tree-only mode; the compaction /
    gather kernel for bf16 and fp8 caches and hidden rows + positions. fp32 runs only in the CPU
    tests. Compiled for sm_90 only: the tree step needs FA3 (Hopper) and refuses other targets."""
    import triton.language as tl
    for dt, mode, lse, rmask, bt in (("*bf16", 2, False, False, 32), ("*bf16", 2, False, False, 64),
                                     ("*bf16", 2, False, True, 64), ("*bf16", 1, False, False, 64),
                                     ("*bf16", 0, True, False, 32), ("*fp16", 2, False, True, 64)):
        types = dict(TREE_ATTN_PTRS, q_ptr=dt, k_ptr=dt, v_ptr=dt, out_ptr=dt, ctx_out_ptr=dt)
        yield (f"tree_attention {dt[1:]} mode={mode} lse={lse} req_mask={rmask} BLOCK_T={bt}",
               TA._tree_attention_kernel, types, dict(
                   G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, BLOCK_T=bt,
                   CTX_MODE=mode, WRITE_LSE=lse, HAS_REQ_MASK=rmask, DOT_PREC="tf32",
                   DOT_UPCAST=False), 0)
    for dt, mode, lse, rmask, bm, bt in (("*bf16", 2, False, True, 64, 32), ("*bf16", 2, False, True, 32, 128),
                                         ("*bf16", 2, False, True, 64, 64), ("*bf16", 0, True, True, 64, 32),
                                         ("*fp16", 2, False, True, 32, 64)):
        types = dict(TREE_ATTN_PTRS, q_ptr=dt, k_ptr=dt, v_ptr=dt, out_ptr="*fp32" if mode == 0 else dt,
                     ctx_out_ptr=dt)
        yield (f"tree_tile {dt[1:]} mode={mode} lse={lse} req_mask={rmask} BLOCK_M={bm} BLOCK_T={bt}",
               TA._tree_tile_kernel, types, dict(
                   G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=bm, BLOCK_T=bt, CTX_MODE=mode, WRITE_LSE=lse,
                   HAS_REQ_MASK=rmask, DOT_PREC="tf32", DOT_UPCAST=False), 0)
    for elt, name, g, cnt, vec in ((tl.int16, "bf16", 2, True, 8), (tl.int8, "fp8", 2, False, 16),
                                   (tl.int16, "bf16", 1, False, 8), (tl.int16, "bf16", 16, False, 1)):
        yield f"move_rows kv {name} depths/tile={g} counts={cnt} vec={vec}", KC._move_rows_kernel, MOVE_PTRS, dict(
            pos_ptr=None, X=256, NE=2048, ELT=elt, BLOCK_W=32, CHUNK=256 if g > 2 else 2048, G=g, VEC=vec,
            HAS_SLOTS=True, HAS_POS=False, HAS_COUNTS=cnt, **({} if cnt else dict(count_ptr=None, tree_ptr=None))), 0
    yield "move_rows hidden+positions", KC._move_rows_kernel, MOVE_PTRS, dict(
        slot_ptr=None, count_ptr=None, tree_ptr=None, X=4096, NE=4096, ELT=tl.int16, BLOCK_W=64, CHUNK=1024,
        G=4, VEC=8, HAS_SLOTS=False, HAS_POS=True, HAS_COUNTS=False), 0
    for out_t, rmask in (("*bf16", True), ("*bf16", False)):  # the FULL-graph path's lse merge (two streams)
        yield f"merge_states out={out_t[1:]} req_mask={rmask}", TA._merge_states_kernel, dict(
            a_ptr="*bf16", a_lse_ptr="*fp32", b_ptr="*fp32", b_lse_ptr="*fp32", out_ptr=out_t, qsl_ptr="*i32",
            ctx_len_ptr="*i32", req_mask_ptr="*i1", **{s: "i32" for s in (
                "s_at", "s_ah", "s_ad", "s_lh", "s_lt", "s_bt", "s_bh", "s_bd", "s_blh", "s_blt", "s_ot", "s_oh",
                "s_od", "W")}), dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_W=16, HAS_REQ_MASK=rmask), 0
    for pt, W in (("*i64", 17), ("*i64", 65), ("*i32", 257)):
        nw = (W + 31) // 32
        yield f"ancestor_rows {pt[1:]} W={W}", TA._ancestor_rows_kernel, dict(
            par_ptr=pt, mask_ptr="*i32", depth_ptr="*i32", W="i32", s_pb="i32", s_mb="i32", s_mr="i32",
            s_db="i32"), dict(NW=nw, NWP=max(1, 1 << (nw - 1).bit_length()), BLOCK_W=1 << (W - 1).bit_length()), 0


def _compile_all(archs, gen):
    n = 0
    for arch in archs:
        for name, fn, types, consts, opts in gen():
            consts = {k: v for k, v in consts.items() if v != "keep"}
            opts = dict(opts) if isinstance(opts, dict) else {}
            div = opts.pop("div", ())
            attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                     if a not in consts and (types[a].startswith("*") or a in div)}
            src = ASTSource(fn=fn, signature=_sig(fn, types, consts), constexprs=consts,
                            attrs=attrs if div else None)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
            assert k.asm.get("cubin"), name
            print(f"sm_{arch} {name}: cubin {len(k.asm['cubin'])} B, shared {k.metadata.shared}")
            n += 1
    return n


def main(archs):
    print(f"AOT OK: {_compile_all(archs, variants)} variants")
    hopper = [a for a in archs if a == 90] or archs
    print(f"AOT OK (tree step): {_compile_all(hopper, tree_step_variants)} variants")


if __name__ == "__main__":
    main([int(a) for a in (sys.argv[1:] or ["90", "80"])])
