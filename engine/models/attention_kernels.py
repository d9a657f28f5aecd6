"""The Triton kernels of ``engine.models.attention`` (that module documents the layout, the spans, the runs'
fold and the launches): the mask form's split kernel, the decode steps' kernel, and the merge of their spans'
partial softmaxes."""

from __future__ import annotations

from engine.models.fused import gdc_launch_dependents  # (None without it: TRIGGER never on)

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - installs without Triton use the PyTorch forms
    triton = None

if triton is not None:

    @triton.jit
    def _online_softmax(scores, m_i, l_i):
        # One key block's step of the online softmax, in the one order every attention kernel here
        # keeps: (weights p, the old sums' rescale alpha, the new running max, the new running sum).
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)

    @triton.jit
    def _store_partials(acc_ptr, ml_ptr, row, acc, m_i, l_i, mrow, rd, md, D: tl.constexpr):
        # A span's unnormalised output and its running max and sum, per row, for the merge launch.
        tl.store(acc_ptr + row[:, None] * D + rd[None, :], acc, mask=mrow[:, None] & md[None, :])
        tl.store(ml_ptr + row * 2, m_i, mask=mrow)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=mrow)

    # Not specialised on T, S or the spans: an AR step (T == 1) and a verify, or two key spans, run one variant.
    @triton.jit(do_not_specialize=["T", "S", "n_split", "row_blocks"])
    def _small_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, ml_ptr, T, S, n_split, row_blocks, skb, skt,
                                skh, svb, svt, svh, smb, smt, scale, HQ: tl.constexpr, GROUP: tl.constexpr,
                                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr):
        # Rows of one program: (query token, query head) pairs of one K/V head of one sequence,
        # token-major, so every K/V block is read once for all GROUP heads sharing it; keys: one span
        # of SPLIT. A row's result does not depend on the other rows of its block (exactness across
        # AR steps and tree verifies). Writes the span's unnormalised output, running max and sum.
        kv_head = tl.program_id(1)
        seq = tl.program_id(2).to(tl.int64)
        span = tl.program_id(0) // row_blocks
        q_ptr += seq * T * HQ * D
        k_ptr += seq * skb
        v_ptr += seq * svb
        mask_ptr += seq * smb
        part = (seq * n_split + span) * T * HQ  # this span's first row in the partials
        rm = (tl.program_id(0) % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rm // GROUP
        head = kv_head * GROUP + rm % GROUP
        mrow = tok < T
        rd = tl.arange(0, BLOCK_D)
        md = rd < D
        q = tl.load(q_ptr + (tok[:, None] * HQ + head[:, None]) * D + rd[None, :], mask=mrow[:, None] & md[None, :],
                    other=0.0)
        m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = tl.minimum(S, (span + 1) * SPLIT)
        for n0 in range(span * SPLIT, end, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            mn = rn < end
            kb = tl.load(k_ptr + rn[:, None] * skt + kv_head * skh + rd[None, :], mask=mn[:, None] & md[None, :],
                         other=0.0)
            # bf16/fp16 values are exact in tf32, so a tf32 product of the upcast operands is the
            # half-precision product with float32 accumulation; float32 inputs stay in full precision.
            if IEEE:
                scores = tl.dot(q, tl.trans(kb), input_precision="ieee")
            else:
                scores = tl.dot(q.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision="tf32")
            allowed = tl.load(mask_ptr + tok[:, None] * smt + rn[None, :], mask=mrow[:, None] & mn[None, :],
                              other=0) != 0
            scores = tl.where(allowed, scores * scale, float("-inf"))
            p, alpha, m_new, l_i = _online_softmax(scores, m_i, l_i)
            vb = tl.load(v_ptr + rn[:, None] * svt + kv_head * svh + rd[None, :], mask=mn[:, None] & md[None, :],
                         other=0.0)
            if IEEE:
                pv = tl.dot(p, vb, input_precision="ieee")
            else:
                pv = tl.dot(p, vb.to(tl.float32), input_precision="tf32")
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        _store_partials(acc_ptr, ml_ptr, part + tok * HQ + head, acc, m_i, l_i, mrow, rd, md, D)

    @triton.jit
    def _tree_slots(start, rn, depth, anc_row_ptr, end):
        # Where the keys at logical positions rn sit for a token at ``depth``: a committed slot below
        # start, else its ancestor at that depth (visible up to its own depth), at that one's slot.
        off = rn - start
        in_tree = (off >= 0) & (off <= depth)
        anc = tl.load(anc_row_ptr + off, mask=in_tree, other=0)
        return tl.where(off < 0, rn, start + anc), ((off < 0) | in_tree) & (rn < end)

    @triton.jit
    def _step_scores(q, kb, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # q [M, D] against a key block [N, D]: float32 scores, each row's sum in one order
        if INTERPRET:  # a row's own order (see _INTERPRET)
            s = tl.sum(q.to(tl.float32)[:, None, :] * kb.to(tl.float32)[None, :, :], axis=2)
        elif IEEE:
            s = tl.dot(q, tl.trans(kb), input_precision="ieee")
        else:  # bf16/fp16 values are exact in tf32: the half-precision product, float32 sums
            s = tl.dot(q.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision="tf32")
        return s

    @triton.jit
    def _step_values(p, vb, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # weights p [M, N] (float32) times a value block [N, D]
        if INTERPRET:
            pv = tl.sum(p[:, :, None] * vb.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            pv = tl.dot(p, vb, input_precision="ieee")
        else:
            pv = tl.dot(p, vb.to(tl.float32), input_precision="tf32")
        return pv

    @triton.jit
    def _fold_weights(m, m_s):
        # Folding a span's (or a run's) partial softmax, max m_s, into a running one of max m: the new
        # max and the two rescales. A side with nothing visible (max -inf) gets weight 0 (exp(-inf)).
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, tl.exp(m - m_safe), tl.exp(m_s - m_safe)

    @triton.jit
    def _committed_blocks(q, k_ptr, v_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, lo, hi, end, scale, m_i, l_i,
                          acc, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # The key blocks lo..hi of committed keys (shared by every row of the program), folded into the
        # running softmax (m_i, l_i, acc) in order.
        for n0 in range(lo, hi, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            visible = rn < end
            kb = tl.load(k_ptr + rn[:, None] * skt + kv_head * skh + rd[None, :], mask=visible[:, None] & md[None, :],
                         other=0.0)
            scores = _step_scores(q, kb, IEEE, INTERPRET)
            scores = tl.where(visible[None, :] & mrow[:, None], scores * scale, float("-inf"))
            p, alpha, m_new, l_i = _online_softmax(scores, m_i, l_i)
            vb = tl.load(v_ptr + rn[:, None] * svt + kv_head * svh + rd[None, :], mask=visible[:, None] & md[None, :],
                         other=0.0)
            acc = acc * alpha[:, None] + _step_values(p, vb, IEEE, INTERPRET)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _span_partial(q, k_ptr, v_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, span, live, S, scale,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
                      IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # A span of committed keys alone: its partial softmax from nothing (not live: no block read)
        lo = span * SPLIT
        end = tl.minimum(S, lo + SPLIT)
        m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        return _committed_blocks(q, k_ptr, v_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, lo,
                                 tl.where(live, end, lo), end, scale, m_i, l_i, acc, BLOCK_N, IEEE, INTERPRET)

    @triton.jit
    def _plain_run(q, k_ptr, v_ptr, acc_ptr, ml_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, tok, head, s_lo, s_hi,
                   T, S, scale, HQ: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # committed spans s_lo..s_hi - 1, each partial written at its own place
        for span in range(s_lo, s_hi):
            m_i, l_i, acc = _span_partial(q, k_ptr, v_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, span, True, S,
                                          scale, BLOCK_M, BLOCK_N, BLOCK_D, SPLIT, IEEE, INTERPRET)
            _store_partials(acc_ptr, ml_ptr, span * T * HQ + tok * HQ + head, acc, m_i, l_i, mrow, rd, md, D)

    # Not specialised on T, S, the spans, the runs or the table's stride: an AR step (T == 1), a chain
    # and a tree run one variant (two with FOLDING: a verify that folds runs, the same code for the rest).
    @triton.jit(do_not_specialize=["T", "S", "n_split", "n_tail", "row_blocks", "tok_blocks", "s_anc", "span_run"])
    def _step_attention_kernel(q_ptr, k_ptr, v_ptr, start_ptr, depth_ptr, anc_ptr, acc_ptr, ml_ptr, T, S, n_split,
                               n_tail, row_blocks, tok_blocks, s_anc, span_run, skt, skh, svt, svh, scale,
                               HQ: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               IEEE: tl.constexpr, SPLIT: tl.constexpr, FOLD: tl.constexpr,
                               FOLDING: tl.constexpr, INTERPRET: tl.constexpr):
        # Rows: (token, head) pairs of one K/V head. Keys: spans of SPLIT logical positions in blocks of
        # BLOCK_N, each span's partial softmax computed alone, then folded in order: a run of FOLD spans
        # into one partial, the runs into the row's result (``_attention_merge_kernel``). Two kinds of
        # program, so that a span's rows are written by at most one:
        # - the first row_blocks * cdiv(n_split, span_run) take BLOCK_M rows of several tokens (token-
        #   major, as _small_attention_kernel) in span_run spans (1, or FOLD: a verify's many rows) of
        #   those wholly before start, the committed keys, where every block is shared by every row.
        #   With span_run == FOLD, a run of FOLD spans all before start is folded here and its partial
        #   written at its first span's place (the merge reads it whole): its rows write one partial
        #   instead of FOLD (the partials' traffic grows with rows x spans: a verify's many rows, long
        #   contexts). Each span's partial is the same computation either way, and the fold the merge's,
        #   so a row's bits do not depend on span_run.
        # - the other tok_blocks * n_tail take one token's heads (SUB blocks of them) in the n_tail spans
        #   from start's on, where the new tokens sit: a block reaching past start holds the token's
        #   ancestors at their depths, gathered by position, so each row's scores and sums see exactly
        #   an AR step's block at that position.
        # The spans past every new token hold no key any row sees: nothing is written there, and the
        # merge stops before them (the partials they would hold add exactly zero). Only the spans'
        # programs launch whose kind depends on start (known on the GPU only): a captured verify over
        # many spans schedules no idle program per token and span. A row's arithmetic is the same
        # whichever program has it.
        kv_head = tl.program_id(1)
        pid = tl.program_id(0)
        start = tl.load(start_ptr)
        first_tail = start // SPLIT
        n_multi = row_blocks * tl.cdiv(n_split, span_run)
        multi = pid < n_multi
        p1 = tl.maximum(pid - n_multi, 0)
        rb = pid % row_blocks
        one_tok = (p1 % tok_blocks) // SUB
        r = tl.arange(0, BLOCK_M)
        tok = tl.where(multi, (rb * BLOCK_M + r) // GROUP, one_tok)
        hrow = tl.where(multi, (rb * BLOCK_M + r) % GROUP, ((p1 % tok_blocks) % SUB) * BLOCK_M + r)
        head = kv_head * GROUP + hrow
        rd = tl.arange(0, BLOCK_D)
        md = rd < D
        if multi:
            # committed spans s_lo..s_hi - 1 (none when the run starts at or past start's span)
            s_lo = (pid // row_blocks) * span_run
            s_hi = tl.minimum(tl.minimum(s_lo + span_run, first_tail), n_split)
            folded = (span_run == FOLD) & (s_lo + FOLD <= first_tail)
            tok = tl.where(s_lo < s_hi, tok, T)
            mrow = (tok < T) & (hrow < GROUP)
            q = tl.load(q_ptr + (tok[:, None] * HQ + head[:, None]) * D + rd[None, :],
                        mask=mrow[:, None] & md[None, :], other=0.0)
            # FOLDING (a launch that folds) compiles the fold's loop beside the plain one: a launch that
            # does not (an AR step's) holds no run's sums in its registers. Both variants run the same
            # code for a span (_span_partial, _committed_blocks) and the merge's fold (_fold_weights,
            # then a product and a fused multiply-add, which nothing can contract further).
            if not FOLDING:  # (span_run 1: one span, no loop over spans)
                m_i, l_i, acc = _span_partial(q, k_ptr, v_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, s_lo,
                                              s_lo < s_hi, S, scale, BLOCK_M, BLOCK_N, BLOCK_D, SPLIT, IEEE,
                                              INTERPRET)
                _store_partials(acc_ptr, ml_ptr, s_lo * T * HQ + tok * HQ + head, acc, m_i, l_i, mrow, rd, md, D)
            elif not folded:
                _plain_run(q, k_ptr, v_ptr, acc_ptr, ml_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, tok, head,
                           s_lo, s_hi, T, S, scale, HQ, D, BLOCK_M, BLOCK_N, BLOCK_D, SPLIT, IEEE, INTERPRET)
            else:
                f_m = tl.zeros([BLOCK_M], tl.float32) - float("inf")
                f_l = tl.zeros([BLOCK_M], tl.float32)
                f_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for span in range(s_lo, s_hi):
                    m_i, l_i, acc = _span_partial(q, k_ptr, v_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, span,
                                                  True, S, scale, BLOCK_M, BLOCK_N, BLOCK_D, SPLIT, IEEE, INTERPRET)
                    f_m, alpha, beta = _fold_weights(f_m, m_i)
                    f_acc = tl.fma(f_acc, alpha[:, None], acc * beta[:, None])
                    f_l = tl.fma(f_l, alpha, l_i * beta)
                _store_partials(acc_ptr, ml_ptr, s_lo * T * HQ + tok * HQ + head, f_acc, f_m, f_l, mrow, rd, md, D)
        else:
            span = first_tail + p1 // tok_blocks
            lo = span * SPLIT
            tok = tl.where(span < tl.minimum(n_split, first_tail + n_tail), tok, T)  # past the spans: no rows
            mrow = (tok < T) & (hrow < GROUP)
            q = tl.load(q_ptr + (tok[:, None] * HQ + head[:, None]) * D + rd[None, :],
                        mask=mrow[:, None] & md[None, :], other=0.0)
            deepest = tl.max(tl.where(mrow, tl.load(depth_ptr + tok, mask=mrow, other=0), 0), axis=0)
            m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            end = tl.minimum(S, lo + SPLIT)
            # Blocks past every row's position are skipped: for a row they would add exactly nothing
            # (a program with no rows skips them all and stores nothing).
            hi = tl.where(span < tl.minimum(n_split, first_tail + n_tail), tl.minimum(end, start + deepest + 1), lo)
            # The blocks wholly before start (committed keys, the same for every row), then the blocks
            # reaching past it, gathered per token. Both run the same arithmetic on a block (the
            # gathered block holds what the AR step's plain one holds), so a row's bits do not depend on
            # which loop saw a block: an AR step's start is the node's start + depth.
            shared_hi = tl.minimum(hi, lo + (tl.maximum(start - lo, 0) // BLOCK_N) * BLOCK_N)
            m_i, l_i, acc = _committed_blocks(q, k_ptr, v_ptr, kv_head, skt, skh, svt, svh, rd, md, mrow, lo,
                                              shared_hi, end, scale, m_i, l_i, acc, BLOCK_N, IEEE, INTERPRET)
            depth = tl.load(depth_ptr + one_tok)  # (one_tok < T in every program)
            anc_row = anc_ptr + one_tok * s_anc
            for n0 in range(shared_hi, hi, BLOCK_N):
                rn = n0 + tl.arange(0, BLOCK_N)
                slot, visible = _tree_slots(start, rn, depth, anc_row, end)
                kv_mask = visible[:, None] & md[None, :]
                kb = tl.load(k_ptr + slot[:, None] * skt + kv_head * skh + rd[None, :], mask=kv_mask, other=0.0)
                vb = tl.load(v_ptr + slot[:, None] * svt + kv_head * svh + rd[None, :], mask=kv_mask, other=0.0)
                scores = _step_scores(q, kb, IEEE, INTERPRET)
                scores = tl.where(visible[None, :] & mrow[:, None], scores * scale, float("-inf"))
                p, alpha, m_new, l_i = _online_softmax(scores, m_i, l_i)
                acc = acc * alpha[:, None] + _step_values(p, vb, IEEE, INTERPRET)
                m_i = m_new
            _store_partials(acc_ptr, ml_ptr, span * T * HQ + tok * HQ + head, acc, m_i, l_i, mrow, rd, md, D)

    @triton.jit
    def _round_rne(x, ty: tl.constexpr):
        # x (float32) rounded to the nearest value of dtype ty (ties to even), as PyTorch rounds, and
        # returned in float32. bf16 by its bits: Triton's interpreter truncates in x.to(bf16), the GPU
        # rounds to nearest even as this does. A NaN stays NaN (adding to its bits could reach the sign).
        if ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = tl.where(x == x, ((bits >> 16) << 16).to(tl.float32, bitcast=True), x)
        else:
            y = x.to(ty).to(tl.float32)
        return y

    # Not specialised on the rows, the spans or the gate's strides (a batched gate's first stride
    # grows with T): an AR step and a verify, or two key spans, run one variant.
    @triton.jit(do_not_specialize=["ROWS", "n_split", "n_tail", "sgb", "sgt", "sgh", "runs_folded"])
    def _attention_merge_kernel(acc_ptr, ml_ptr, out_ptr, gate_ptr, start_ptr, ROWS, n_split, n_tail, sgb, sgt, sgh,
                                runs_folded, HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                GATED: tl.constexpr, LIBDEVICE: tl.constexpr, STEP: tl.constexpr,
                                SPLIT: tl.constexpr, FOLD: tl.constexpr, TRIGGER: tl.constexpr):
        # One query row of one sequence: the spans' partial softmaxes folded in span order, in runs of
        # FOLD spans (each run folded from nothing, then the runs into the row's result, all by
        # _fold_weights): runs_folded != 0 (a flag; STEP only) when the step kernel has folded every
        # run wholly before start's span itself, one partial at its first span's place, by the same
        # arithmetic; the other runs are folded here. A span that saw no visible key (max -inf, sum
        # 0, output 0) adds exactly zero (its weight is exp(-inf) = 0: fma(a, 1, +-0) is a, but for the
        # sign of a zero a, which both paths share), so it may as well not be read:
        # STEP (a decode step's, ``step_attention``) folds only the spans up to the last one a new
        # token reaches, start // SPLIT + n_tail, which the step kernel writes; past them it writes
        # nothing. Row r is query token r // HQ, head r % HQ. GATED: times sigmoid(gate), rounded as
        # the eager ops round. TRIGGER: the output projection after it may start
        # (fused.lets_dependents_launch).
        if TRIGGER:
            gdc_launch_dependents()
        r = tl.program_id(0)
        seq = tl.program_id(1).to(tl.int64)
        rd = tl.arange(0, BLOCK_D)
        md = rd < D
        live = n_split
        first_tail = 0
        if STEP:
            first_tail = tl.load(start_ptr) // SPLIT
            live = tl.minimum(n_split, first_tail + n_tail)
        m_all = -float("inf")
        total = 0.0
        acc = tl.zeros([BLOCK_D], tl.float32)
        for run in range(0, live, FOLD):
            at = (seq * n_split + run) * ROWS + r
            if (runs_folded != 0) & (run + FOLD <= first_tail):  # folded by the step kernel
                m_run = tl.load(ml_ptr + at * 2)
                l_run = tl.load(ml_ptr + at * 2 + 1)
                a_run = tl.load(acc_ptr + at * D + rd, mask=md, other=0.0)
            else:
                m_run = -float("inf")
                l_run = 0.0
                a_run = tl.zeros([BLOCK_D], tl.float32)
                for sp in range(run, tl.minimum(run + FOLD, live)):
                    at = (seq * n_split + sp) * ROWS + r
                    m_run, alpha, beta = _fold_weights(m_run, tl.load(ml_ptr + at * 2))
                    a_run = tl.fma(a_run, alpha, tl.load(acc_ptr + at * D + rd, mask=md, other=0.0) * beta)
                    l_run = tl.fma(l_run, alpha, tl.load(ml_ptr + at * 2 + 1) * beta)
            m_all, alpha, beta = _fold_weights(m_all, m_run)
            acc = tl.fma(acc, alpha, a_run * beta)
            total = tl.fma(total, alpha, l_run * beta)
        out = acc / tl.where(total > 0, total, 1.0)  # a row with nothing visible gets zeros
        ty = out_ptr.dtype.element_ty
        if GATED:
            tok = (r // HQ).to(tl.int64)
            g = tl.load(gate_ptr + seq * sgb + tok * sgt + (r % HQ) * sgh + rd, mask=md, other=0.0).to(tl.float32)
            # PyTorch's CUDA sigmoid is 1 / (1 + expf(-x)) in float32, CUDA's accurate expf and a
            # rounded division: libdevice's exp is that expf and div_rn that division (on an H200 with
            # Triton 3.6 the same bits for every bf16 and fp16 input and 16.8M float32 ones, where
            # tl.sigmoid, ex2.approx and an approximate division, rounds 2 of the 65,536 fp16 inputs
            # and about a third of float32 ones otherwise). The interpreter has no libdevice: there
            # NumPy's exp, a few float32 ulps from PyTorch's CPU sigmoid.
            if LIBDEVICE:
                e = libdevice.exp(-g)
            else:
                e = tl.exp(-g)
            s = _round_rne(tl.math.div_rn(1.0, 1.0 + e), ty)
            # the attention output rounded as the ungated store rounds it, then the product of two
            # values of the dtype (exact in float32 for bf16 and fp16) rounded as PyTorch's mul
            out = _round_rne(out.to(ty).to(tl.float32) * s, ty)
        tl.store(out_ptr + (seq * ROWS + r) * D + rd, out.to(ty), mask=md)
