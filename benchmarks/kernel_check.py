"""Compile every Triton kernel for Hopper (sm_90) at the shapes of the presets, without a GPU, and
report registers, shared memory and spills: what Triton's interpreter (the CPU tests) cannot tell.

    python benchmarks/kernel_check.py              # a table; exit 1 if a kernel spills or does not fit
    python benchmarks/kernel_check.py --shard 1/3  # every third kernel from the first (the CPU suite
                                                   # runs the shards side by side)

Triton's own compiler with the ptxas and cuobjdump its wheel carries; run it with
TRITON_INTERPRET unset (tests/engine/test_kernels_compile.py runs it in a process of its own).
The GPU image's Triton (3.6) can spill where a newer one does not: ``pip install --no-deps --target
DIR triton==3.6.0`` and ``PYTHONPATH=DIR python benchmarks/kernel_check.py`` checks with it here.
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.decoding import tree_kernel  # noqa: E402
from engine.models import attention as split_attention  # noqa: E402
from engine.models import delta_rule, fused, quant_embedding, quant_kernel, topk  # noqa: E402
from engine.models import linear as rows_linear  # noqa: E402
from engine.models.quant import FORMATS  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232_448  # bytes of shared memory one block may use on an H100/H200
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
DELTA_SHAPES = [(16, 8), (128, 128)]  # (dk, dv): tiny-hybrid, Qwen3.5-27B
HEAD_DIMS = [16, 64, 128, 256]  # tiny, SmolLM2 and the DFlash drafts, Qwen3-8B, Qwen3.5-27B
WIDTHS = [576, 4096, 5120, 8192, 16384]  # hidden sizes (SmolLM2 ... a 400B model's)
# Weights with no tuned plan that the checked default plans are made for: SmolLM2-135M (qkv, o, gate_up,
# down, lm_head) and a tiny model's.
DEFAULT_LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (128, 64)]
# Kernels allowed to spill, and why: not on a path whose speed is measured.
MAY_SPILL = {"step attention fp32 head_dim=256": "float32 on 256-wide heads (Qwen3.5) checks the algorithm, "
                                                 "not speed: 8 warps hold q, the partial sums and a gathered block",
             # float32 checks the algorithm, not speed: a verify's folded run's sums beside a span's
             **{f"step attention fp32 head_dim={d} folding": "float32 checks the algorithm, not speed: a folded "
                                                             "run's sums beside a span's" for d in (16, 64, 256)},
             # 4 warps spill 56 bytes a thread at head_dim 128 with Triton 3.6 (none with 3.9) and 24-136 at
             # 256, and are still the faster launch on the H200, spills included (`kernel_bench.py
             # attention`, 2026-12-04, us): the 8B shape's verify@32 36.9 -> 26.9, AR 9.8 -> 9.6; the 27B
             # shape's 37.3 -> 31.6 and 12.8 -> 12.3, against the spill-free 8 warps. Since the runs' fold
             # (2026-12-07), an AR step's variant spills 8 and 64 bytes, a folding verify's 416 and 632 (3.6)
             "step attention bf16 head_dim=128": "measured faster than 8 warps with its spills (8B shape)",
             "step attention bf16 head_dim=256": "measured faster than 8 warps with its spills (27B shape)",
             # a verify folding runs: measured faster with its spills where the engine folds (H100, 2026-12-07,
             # `kernel_bench.py attention`: the 27B's budget-32 verify 87.7 -> 83.5 us at 4k keys, 615 -> 550 at 32k)
             "step attention bf16 head_dim=128 folding": "a folded run's sums beside a span's: measured faster",
             "step attention bf16 head_dim=256 folding": "a folded run's sums beside a span's: measured faster"}
# Weights kept in GGUF blocks (quant_kernel), on their plans: a Q4_K_M 27B shape's (the MLP, head and fused
# groups in Q4_K; the head and down projections in Q6_K; a mixed attention group's parts on default
# plans), SmolLM2's Q4_1 file, every other format on one weight, and the 27B shape's draft held in blocks
# (``@q8_0``: fc, q/k/v, gate/up, down; ``@q4_k_m``: the widths the target has not)
QUANT_CASES = ([(n, k, "Q4_K") for n, k in ((16480, 5120), (14336, 5120), (34816, 5120), (5120, 17408),
                                            (5120, 6144), (4096, 12288), (12288, 5120), (5120, 25600), (8192, 5120),
                                            (6144, 5120), (1024, 5120))]
               + [(248320, 5120, "Q6_K"), (5120, 17408, "Q6_K"), (1024, 5120, "Q6_K")]
               + [(n, k, "Q8_0") for n, k in ((5120, 25600), (8192, 5120), (34816, 5120), (5120, 17408), (5120, 6144))]
               + [(n, k, "Q4_1") for n, k in DEFAULT_LINEAR_SHAPES[:5]]
               + [(576, 1536, name) for name in FORMATS if name != "Q4_1"]
               # the weights with a plan of their format's own (linear.TUNED_NATIVE), each case once
               + [(n, k, name) for (name, n, k) in rows_linear.TUNED_NATIVE[(9, 0)]])
QUANT_CASES = list(dict.fromkeys(QUANT_CASES))
# (L, top_k, budget) of the DDTree kernel: the default config, budget 48, a wide tree, the largest supported
TREE_SHAPES = [(15, 8, 22), (15, 8, 32), (15, 8, 48), (15, 16, 128),
               (tree_kernel.MAX_DEPTH, tree_kernel.MAX_TOP_K, tree_kernel.MAX_BUDGET)]


def compile_for_hopper(kernel, types: dict[str, str], constexprs: dict[str, object], num_warps: int = 4,
                       num_stages: int = 3, aligned: tuple[str, ...] = (), max_registers: int | None = None):
    """``aligned``: arguments a launch specialises as multiples of 16 (pointers from the caching
    allocator, widths of the presets): what lets Triton pipeline a loop's loads. ``max_registers``: the
    launch's register cap (ptxas ``maxnreg``), as ``quant_kernel.kernel_linear`` passes it."""
    backend = triton.compiler.make_backend(TARGET)
    signature = {n: "constexpr" if n in constexprs else types[n] for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=kernel, constexprs=constexprs, signature=signature, attrs=attrs)
    opts = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages,
                                  **({"maxnreg": max_registers} if max_registers else {})})
    return triton.compile(src, target=TARGET, options=opts.__dict__)


def loop(compiled, containing: str = "") -> list[str]:
    """The SASS instructions of the kernel's longest loop (a backward branch's body); with ``containing``, of its
    shortest loop holding an instruction that starts with it (the innermost: a K loop, not the loop around it)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    lines = [(int(a, 16), ins.strip()) for a, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    at = {a: i for i, (a, _) in enumerate(lines)}
    best: list[str] = []
    for i, (a, ins) in enumerate(lines):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = [x for _, x in lines[at[int(m.group(1), 16)]: i + 1]]
            if not containing:
                best = body if len(body) > len(best) else best
            elif (not best or len(body) < len(best)) and any(
                    re.sub(r"^@!?U?P\w+\s+", "", x).startswith(containing) for x in body):
                best = body
    return best


def resources(compiled) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    res = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    res["SHARED"] = compiled.metadata.shared
    return res


def _attention_cases(dtype: str):
    """The attention kernels' cases for ``dtype`` (bf16 or fp32) at every head_dim: the mask kernel, the
    decode steps' kernel on its own launch, and the merge, plain and gated."""
    p = "*" + dtype
    for d in HEAD_DIMS:
        launch = split_attention.attention_launch(d, dtype == "fp32")
        warps, stages = launch.pop("num_warps"), launch.pop("num_stages")
        types = dict(q_ptr=p, k_ptr=p, v_ptr=p, mask_ptr="*i1", acc_ptr="*fp32", ml_ptr="*fp32", T="i32",
                     S="i32", n_split="i32", row_blocks="i32", skb="i32", skt="i32", skh="i32", svb="i32",
                     svt="i32", svh="i32", smb="i32", smt="i32", scale="fp32")
        yield (f"attention {dtype} head_dim={d}", split_attention._small_attention_kernel, types,
               dict(HQ=24, GROUP=6, D=d, IEEE=dtype == "fp32", SPLIT=split_attention.SPLIT_KEYS, **launch),
               warps, stages)
        step_launch = split_attention.step_attention_launch(d, dtype == "fp32")
        step_warps, step_stages = step_launch.pop("num_warps"), step_launch.pop("num_stages")
        step = dict(q_ptr=p, k_ptr=p, v_ptr=p, start_ptr="*i64", depth_ptr="*i32", anc_ptr="*i32",
                    acc_ptr="*fp32", ml_ptr="*fp32", T="i32", S="i32", n_split="i32", n_tail="i32",
                    row_blocks="i32", tok_blocks="i32", s_anc="i32", span_run="i32", skt="i32", skh="i32",
                    svt="i32", svh="i32", scale="fp32")
        for folding in (False, True):  # an AR step's variant, a verify's that folds runs
            yield (f"step attention {dtype} head_dim={d}{' folding' if folding else ''}",
                   split_attention._step_attention_kernel, step,
                   dict(HQ=24, GROUP=6, SUB=1, D=d, IEEE=dtype == "fp32", FOLDING=folding, INTERPRET=False,
                        **step_launch),
                   step_warps, step_stages)
        merge = dict(acc_ptr="*fp32", ml_ptr="*fp32", out_ptr=p, gate_ptr=p, start_ptr="*fp32", ROWS="i32",
                     n_split="i32", n_tail="i32", sgb="i32", sgt="i32", sgh="i32", runs_folded="i32")
        # dense models' merge; Qwen3.5's, with its output gate; the mask form's (start_ptr: acc, not read) and a
        # decode step's (its live spans from start)
        for gated, step_form in itertools.product((False, True), (False, True)):
            yield (f"attention merge{' gated' if gated else ''}{' step' if step_form else ''} {dtype} head_dim={d}",
                   split_attention._attention_merge_kernel, merge | ({"start_ptr": "*i64"} if step_form else {}),
                   dict(HQ=24, D=d, BLOCK_D=launch["BLOCK_D"], GATED=gated, LIBDEVICE=split_attention._LIBDEVICE,
                        STEP=step_form, SPLIT=step_launch["SPLIT"] if step_form else split_attention.SPLIT_KEYS,
                        FOLD=step_launch["FOLD"], TRIGGER=True),
                   4, 3)


def cases():
    """(name, kernel, argument types, constexprs, num_warps, num_stages[, aligned arguments]) as the
    wrappers launch them."""
    for dk, dv in DELTA_SHAPES:
        block_k, block_v, warps = delta_rule.kernel_config(dk, dv)
        types = dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32", g_ptr="*fp32", beta_ptr="*fp32",
                     index_ptr="*i32", count_ptr="*i32", state_ptr="*fp32", out_ptr="*fp32", T="i32", gather="i32",
                     commit="i32", layer_nodes="i32", index_stride="i32")
        yield (f"tree delta rule dk={dk} dv={dv}", delta_rule._tree_delta_kernel, types,
               dict(HK=16, HV=48, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v), warps, 3)
    lin = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", ticket_ptr="*i32",
               M="i32", N="i32", K="i32", sxm="i32", swn="i32", k_iters="i32", split="i32", tiles="i32")
    lin_aligned = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "part_ptr", "ticket_ptr", "N", "K", "sxm", "swn")
    plans = [(f"sm_{arch[0]}{arch[1]}", shape, plan) for arch, shapes in rows_linear.TUNED.items()
             for shape, plan in shapes.items()]
    plans += [("default", shape, rows_linear.default_plan(*shape)) for shape in DEFAULT_LINEAR_SHAPES]
    for where, (n, k), plan in plans:
        for cls, cfg, block_m in (("step", plan.step, rows_linear.STEP_ROWS),
                                  ("verify", plan.verify, plan.verify.row_block)):
            stages = rows_linear.stages_for(cfg, block_m, 2)
            for pdl in (False, True):  # (linear.PDL: its weight's first blocks prefetched before the wait)
                yield (f"linear {where} {n}x{k} {cls} M<={block_m}{' pdl' if pdl else ''}", rows_linear._linear_kernel,
                       lin, dict(HAS_BIAS=False, EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n,
                                 BLOCK_K=cfg.block_k, BLOCK_M=block_m, INTERPRET=False, PDL=pdl), cfg.num_warps,
                       stages, lin_aligned)
    yield from _quant_cases()
    yield from _embedding_cases()
    yield from _tree_cases()
    for dtype in ("bf16", "fp32"):
        p = "*" + dtype
        move = dict(k_ptr=p, v_ptr=p, slot_ptr="*i64", path_ptr="*i64", al_ptr="*i64", s_layer="i32",
                    s_slot="i32", s_head="i32", D="i32")
        for d in HEAD_DIMS:
            yield (f"move accepted rows {dtype} d={d}", tree_kernel._move_rows_kernel, move,
                   dict(A_PAD=32, D_PAD=d), 4, 3)
        for k in (1, 8, 16):
            kp = max(2, triton.next_power_of_2(k))
            yield (f"topk {dtype} k={k}", topk._topk_chunk_kernel,
                   dict(x_ptr=p, V="i32", stride="i32", temp="fp32", val_ptr="*fp32", idx_ptr="*i32", m_ptr="*fp32",
                        s_ptr="*fp32", NCHUNK="i32"), dict(K=k, KP=kp, BLOCK=topk.TOPK_CHUNK, LSE=True), 4, 3)
            cand = triton.next_power_of_2(triton.cdiv(248320, topk.TOPK_CHUNK) * kp)  # Qwen3.5's vocabulary
            yield (f"topk merge k={k}", topk._topk_merge_kernel,
                   dict(val_ptr="*fp32", idx_ptr="*i32", m_ptr="*fp32", s_ptr="*fp32", top_v_ptr="*fp32",
                        top_i_ptr="*i64", NCHUNK="i32"), dict(K=k, KP=kp, CAND=cand, CH=128, LSE=True), 4, 3)
        rope_write = dict(q_ptr=p, k_ptr=p, v_ptr=p, cos_ptr=p, sin_ptr=p, slot_ptr="*i64", qo_ptr=p, kc_ptr=p,
                          vc_ptr=p, sq_t="i32", sq_h="i32", sk_t="i32", sk_h="i32", sv_t="i32", sv_h="i32",
                          skc_t="i32", skc_h="i32", svc_t="i32", svc_h="i32", HQ="i32", D="i32", RD="i32",
                          qw_ptr=p, kw_ptr=p, eps="fp32")
        for d, rd in ((64, 64), (128, 128), (256, 64)):
            for norm, zc in ((False, False), (True, False), (True, True)):  # none, Qwen3's, Qwen3.5's
                label = " + zero-centred head norms" if zc else " + head norms" if norm else ""
                yield (f"rope + KV write{label} {dtype} d={d} rd={rd}", fused._rope_write_kernel, rope_write,
                       dict(NORM=norm, ZERO_CENTRED=zc, HALF=rd // 2, BLOCK=d), 4, 3)
        yield from _attention_cases(dtype)
        for d in WIDTHS + HEAD_DIMS:
            types = dict(x_ptr=p, w_ptr=p, other_ptr=p, total_ptr=p, out_ptr=p, D="i32", eps="fp32",
                         other_heads="i32", other_tok="i32", other_head="i32", tee_ptr=p, tee_stride="i32")
            launch = fused.row_launch(d)
            warps = launch.pop("num_warps")
            for label, zc, gated, residual, tee in (("rms_norm", False, False, False, False),
                                                    ("rms_norm zero-centred", True, False, False, False),
                                                    ("add + rms_norm zero-centred", True, False, True, False),
                                                    ("add + rms_norm, features teed", False, False, True, True),
                                                    ("gated rms_norm", False, True, False, False)):
                yield (f"{label} {dtype} d={d}", fused._rms_norm_kernel,
                       dict(types, x_ptr="*fp32") if gated else types,  # the delta rule's float32 output
                       dict(ZERO_CENTRED=zc, GATED=gated, RESIDUAL=residual, TEE=tee, TRIGGER=True, **launch), warps,
                       3)
        yield (f"silu_mul {dtype}", fused._silu_mul_kernel,
               dict(g_ptr=p, u_ptr=p, out_ptr=p, D="i32", g_stride="i32", u_stride="i32"),
               dict(BLOCK=2048, TRIGGER=True), 4, 3)
        rope = dict(x_ptr=p, cos_ptr=p, sin_ptr=p, out_ptr=p, HEADS="i32", D="i32", RD="i32")
        for d, rd in ((64, 64), (128, 128), (256, 64)):  # full RoPE, and Qwen3.5's partial quarter
            yield f"rope {dtype} d={d} rd={rd}", fused._rope_kernel, rope, dict(HALF=rd // 2, BLOCK=d), 4, 3
        gdn = dict(conv_ptr=p, mix_ptr=p, mix_stride="i32", rec_ptr=p, rec_stride="i32", idx_ptr="*i64", w_ptr=p,
                   q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32", a_ptr=p, b_ptr=p, a_stride="i32", b_stride="i32",
                   alog_ptr="*fp32", dt_ptr="*fp32", g_ptr="*fp32", beta_ptr="*fp32", C="i32")
        for commit, record in ((True, False), (False, True)):  # a chain's step, a tree's verify
            yield (f"gdn inputs {dtype} {'commit' if commit else 'record'}", fused._gdn_inputs_kernel, gdn,
                   dict(HK=16, DK=128, HV=48, DV=128, KERNEL=4, BLOCK=128, BLOCK_H=64, COMMIT=commit,
                        RECORD=record), 4, 3)


def _tree_cases():
    """The DDTree kernels: the tree and its mask, the walk, the adaptive policy's path probabilities."""
    tree = dict(lp_ptr="*fp32", ids_ptr="*i64", root_ptr="*i64", tok_ptr="*i64", par_ptr="*i64",
                     dep_ptr="*i64", rank_ptr="*i64", mask_ptr="*i1", epar_ptr="*i32", erank_ptr="*i32",
                     edep_ptr="*i32", efinal_ptr="*i32", escore_ptr="*fp64", prob_ptr="*i64", log_scale="fp32",
                     root_prob="i32", L="i32", K="i32", B="i32", N="i32", CHAIN="i32")
    for depth, k, budget in TREE_SHAPES:
        for probs in (False, True):  # (True: the adaptive policy's proposal, its estimate from the same launch)
            yield (f"ddtree L={depth} k={k} budget={budget}{' + path probabilities' if probs else ''}",
                   tree_kernel._tree_kernel, tree,
                   dict(FORCED_KEY=tree_kernel._FORCED_KEY, DEPTH_TIE=tree_kernel._DEPTH_TIE, PROBS=probs,
                        **tree_kernel.kernel_launch(depth, k, budget)), tree_kernel.kernel_warps(budget), 3)
    walk = dict(tok_ptr="*i64", par_ptr="*i64", rank_ptr="*i64", post_ptr="*i64", start_ptr="*i64", seq_ptr="*i64",
                path_ptr="*i64", packed_ptr="*i64", tail_ptr="*i64", T="i32", MAXD="i32", N="i32", ENTRIES="i32")
    for _, _, budget in TREE_SHAPES:
        for tail in (False, True):  # (True: the adaptive policy's step, its readback packed by the walk)
            t_pad = max(16, triton.next_power_of_2(budget + 1))
            yield (f"walk budget={budget}{' + policy tail' if tail else ''}", tree_kernel._walk_kernel, walk,
                   dict(T_PAD=t_pad, N_PAD=t_pad, HAS_TAIL=tail), 4, 3)
    paths = dict(lp_ptr="*fp32", par_ptr="*i64", dep_ptr="*i64", rank_ptr="*i64", out_ptr="*i64", T="i32", K="i32",
                 L="i32", log_scale="fp32")
    for _, _, budget in TREE_SHAPES:  # the adaptive policy's estimate (policy.path_probabilities)
        yield (f"path probabilities budget={budget}", tree_kernel._path_probs_kernel, paths,
               dict(T_PAD=max(16, triton.next_power_of_2(budget + 1))), 4, 3)


def _quant_cases():
    """The in-register kernel's step and verify launches of ``QUANT_CASES`` in bf16, as
    ``quant_kernel.kernel_linear`` launches them: a verify at a budget-32 tree's 33 rows and at the most rows,
    where their row tiles differ (64 and 128 rows: other stages, other registers)."""
    for n, k, name in QUANT_CASES:
        fmt = FORMATS[name]
        plan = rows_linear.tuned_plan(n, k, (9, 0), name)
        launches = [("step", plan.step, rows_linear.STEP_ROWS), ("verify", plan.verify, rows_linear.MAX_ROWS)]
        if quant_kernel.launch_shape(fmt, plan.verify, 33) != quant_kernel.launch_shape(fmt, plan.verify,
                                                                                         rows_linear.MAX_ROWS):
            launches.insert(1, ("verify", plan.verify, 33))
        for cls, cfg, rows in launches:
            # the blocks read as words where the launch allows (quant_kernel.words_fit), else as half-words;
            # rows start 16 units aligned where a row's bytes are a multiple of 16 units: what the launch
            # specialises
            words = quant_kernel.words_fit(fmt, cfg.block_k, fmt.row_bytes(k))
            unit = 4 if words else 2
            types = dict(x_ptr="*bf16", blocks_ptr="*i32" if words else "*fp16", b_ptr="*bf16", out_ptr="*bf16",
                         part_ptr="*fp32", ticket_ptr="*i32", M="i32", N="i32", K="i32", sxm="i32", row_stride="i32",
                         k_iters="i32", split="i32", tiles="i32", nibble="i32")
            aligned = ("x_ptr", "blocks_ptr", "b_ptr", "out_ptr", "part_ptr", "ticket_ptr", "N", "K", "sxm") + (
                ("row_stride",) if fmt.row_bytes(k) % (16 * unit) == 0 else ())
            block_m, warps = quant_kernel.launch_shape(fmt, cfg, rows)
            cap = quant_kernel.register_cap(fmt, words, block_m, warps)
            yield (f"quant {name}{' words' if words else ''} {n}x{k} {cls} M<={block_m}", quant_kernel._quant_kernel,
                   types, dict(FMT=quant_kernel.KERNEL_FORMATS[name], VALUES=fmt.values, NBYTES=fmt.nbytes,
                               GROUP=quant_kernel.group_size(fmt, cfg.block_k), HAS_BIAS=False,
                               EVEN_K=k % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                               BLOCK_M=block_m, INTERPRET=False, **quant_kernel.word_constants(fmt, words)),
                   warps, quant_kernel.launch_stages(cfg, block_m, 2), aligned, cap)


# Embeddings kept in blocks (``quant_embedding.embedding``): the Q4_K_M 27B's and 8B's (Q4_K), and every format at
# SmolLM2's width where its rows are whole words (a tied SmolLM2 keeps a float one; the kernel is the same)
EMBED_CASES = [(5120, "Q4_K"), (4096, "Q4_K"), (4096, "Q6_K")] + [
    (576, name) for name, fmt in FORMATS.items() if 576 % fmt.values == 0 and fmt.row_bytes(576) % 4 == 0]


def _embedding_cases():
    """``quant_embedding.embedding``'s launches in bf16 (rows start 4-byte aligned: every held row of whole words;
    a row of 16 words' multiple specialised as the launch specialises it)."""
    for k, name in EMBED_CASES:
        fmt = FORMATS[name]
        block_k = quant_embedding.embed_block_k(k)
        assert quant_kernel.words_fit(fmt, block_k, fmt.row_bytes(k)), (k, name)
        types = dict(ids_ptr="*i64", w_ptr="*i32", out_ptr="*bf16", M="i32", N="i32", K="i32", row_stride="i32",
                     nibble="i32")
        yield (f"embedding {name} x{k}", quant_embedding._embedding_kernel, types,
               dict(FMT=quant_kernel.KERNEL_FORMATS[name], VALUES=fmt.values, NBYTES=fmt.nbytes,
                    **quant_kernel.word_constants(fmt, True), EVEN_K=k % block_k == 0,
                    BLOCK_N=quant_embedding.EMBED_ROWS, BLOCK_K=block_k, INTERPRET=False),
               4, 1, ("ids_ptr", "w_ptr", "out_ptr", "K") + (("row_stride",) if fmt.row_bytes(k) % 64 == 0 else ()))


def _shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"must be I/N with 1 <= I <= N, but got {text!r}")
    return int(m.group(1)), int(m.group(2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", type=_shard, default=(1, 1), metavar="I/N",
                        help="check kernels I, I+N, I+2N, ... of the list (1-based; default 1/1: all)")
    first, every = parser.parse_args(argv).shard
    every_case = list(cases())
    mine = every_case[first - 1::every]
    bad = 0
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}, shared memory limit {SHARED_LIMIT} B")
    print(f"{'kernel':40s} {'warps':>5s} {'regs':>5s} {'shared':>7s} {'spill':>6s}  verdict")
    for name, kernel, types, constexprs, warps, stages, *rest in mine:
        compiled = compile_for_hopper(kernel, types, constexprs, warps, stages, *rest)
        res = resources(compiled)
        spill = res.get("STACK", 0) + res.get("LOCAL", 0)
        # a register cap's few bytes of stack: allowed where no load or store of the stack is in the K loop
        capped = len(rest) > 1 and rest[1] and not any(
            re.sub(r"^@!?U?P\w+\s+", "", ins).startswith(("LDL", "STL")) for ins in loop(compiled))
        ok = (spill == 0 or name in MAY_SPILL or capped) and res["SHARED"] <= SHARED_LIMIT
        bad += not ok
        print(f"{name:40s} {warps:5d} {res.get('REG', 0):5d} {res['SHARED']:7d} {spill:6d}  {'ok' if ok else 'BAD'}")
    print(f"kernels: {len(mine)} of {len(every_case)} (shard {first}/{every})  bad: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
