"""``engine.models.quant_gluon``'s options beside the engine's decode (issue #28): tiles staged in shared memory
(``STAGES``), programmatic dependent launch (``PDL``), a verify's rows as a power of two and a tail (``TAILS``), the
8-warp launches' register cap (``MAXNREG``), a verify's 256-row tiles (``WIDE_WARPS``) and its parts of K folded in
pairs (``FOLD_FROM``). On a GPU each keeps the
engine's bits; on the CPU, the rules that pick them and what a launch passes to the kernel. (The engine's decode
itself: ``test_quant_gluon.py``.)"""

from __future__ import annotations

import pytest
import torch

from engine.models import fused, quant_gluon
from engine.models.quant import FORMATS
from tests.engine.models.test_quant_gluon import N2, ROWS, K, _blocks, _q6_blocks, _reads_back

pytest.importorskip("gguf")


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("min_block_m", [8, 16])
def test_on_the_gpu_tiles_staged_in_shared_memory_give_the_register_paths_bits(monkeypatch, split, warps, stages,
                                                                                min_block_m):
    """``stages`` (the planes and x copied ahead into shared memory; the engine's for few-program AR launches only),
    Q4_K's pairs and Q6_K: one-hot rows read the weight back bit for bit (the stages past a part's last tile copy
    nothing) and every row count's product has the register path's bits (the same decode, the same matrix-unit
    order), a lone row's its bits among 33 and 100."""
    from engine.models.quant import hold

    monkeypatch.setattr(quant_gluon, "MIN_BLOCK_M", min_block_m)
    words, heads = quant_gluon.repack(_blocks(seed=8, n=N2).cuda(), K, True)
    planes = quant_gluon.repack_q6_k(hold(_q6_blocks(seed=9, n=N2), FORMATS["Q6_K"]).cuda(), K)
    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    for product, weight in [
            (lambda x, w, st: quant_gluon.linear(x, words, heads, N2, K, split, True, False, w, st),
             quant_gluon.reference(words, heads, N2, K, True).to(torch.bfloat16)),
            (lambda x, w, st: quant_gluon.linear_q6_k(x, planes, N2, K, split, False, w, st),
             quant_gluon.reference_q6_k(*planes, N2, K))]:
        _reads_back(lambda x, product=product: product(x, warps, stages), weight)
        for rows in (1, 5, 8, 16, 33, ROWS):
            staged = product(x[:rows], warps, stages)
            assert torch.equal(staged, product(x[:rows], warps, 0)), rows
            assert torch.equal(staged[:1], product(x[:1], 4, stages)), rows


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("stages", [0, 3])
def test_on_the_gpu_a_launch_started_before_the_last_one_ends_reads_its_output(monkeypatch, stages):
    """``PDL`` (programmatic dependent launch, the engine's since 2026-12-07): a chain of products each reading the
    output of the launch before it (two Q4_K of 2 parts: the tickets too; a Q6_K; a Q4_1), and reading the outputs of
    the kernels a step puts before its products, which let them launch as they start (an RMSNorm, SwiGLU's product:
    ``fused.lets_dependents_launch``), PyTorch ops between too; x copied in first, run on a stream and replayed from a
    CUDA graph: every time the bits of the same chain without PDL."""
    from engine.models.quant import hold
    from tests.engine.models.test_quant_gluon import _q41_blocks

    words, heads = quant_gluon.repack(_blocks(seed=10, n=K).cuda(), K, True)  # K x K: a chain of them
    planes = quant_gluon.repack_q6_k(hold(_q6_blocks(seed=11, n=K), FORMATS["Q6_K"]).cuda(), K)
    q41 = quant_gluon.repack_q4_1(_q41_blocks(seed=12, n=K, cols=K).cuda(), K)

    def chain(x):
        for _ in range(4):
            x = quant_gluon.linear(x, words, heads, K, K, 2, True, stages=stages)
            x = quant_gluon.linear(x, words, heads, K, K, 2, True, stages=stages)  # two launches taking tickets
            x = quant_gluon.linear_q6_k(x, planes, K, K, 1, stages=stages)
            x = fused.rms_norm(x, norm_w, 1e-6)  # (a kernel that lets the product after it launch early)
            x = quant_gluon.linear_q4_1(x, q41, K, K, 1, stages=stages)
            x = fused.silu_mul(x, x)  # (another)
            x = quant_gluon.linear_q4_1(x, q41, K, K, 1, stages=stages)
            x = x / x.abs().amax()  # (kept in range; two PyTorch kernels between the products)
        return x

    norm_w = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5
    xs = [torch.randn(rows, K, device="cuda", dtype=torch.bfloat16) for rows in (1, 1, 3, 1, 33, 1)]
    monkeypatch.setattr(quant_gluon, "PDL", False)
    want = [chain(x) for x in xs]
    monkeypatch.setattr(quant_gluon, "PDL", True)
    buf = torch.empty(1, K, device="cuda", dtype=torch.bfloat16)
    for x, w in zip(xs, want, strict=True):
        assert torch.equal(chain(x.clone()), w)
    chain(buf)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(buf)
    for x, w in zip(xs, want, strict=True):
        if x.shape[0] == 1:
            buf.copy_(x)
            graph.replay()
            assert torch.equal(out, w)
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("maxnreg", [None, 128])
@pytest.mark.parametrize("tail_from", [32, 64])
def test_on_the_gpu_a_verifys_rows_as_a_power_of_two_and_a_tail_round_as_in_one_product(monkeypatch, split, maxnreg,
                                                                                        tail_from):
    """``TAILS`` (33-48 rows as two products of one decoded tile, the engine's; 17-24 too at ``TAIL_FROM`` 32) and
    ``MAXNREG`` (a tail's 8-warp launch at 128 registers, the engine's, or ptxas' own): one-hot rows read each weight
    back (40 rows a launch: 32 + 8), and every row count's product has the bits of the launch without a tail, Q4_K's
    pairs and Q6_K."""
    from engine.models.quant import hold

    words, heads = quant_gluon.repack(_blocks(seed=12, n=N2).cuda(), K, True)
    planes = quant_gluon.repack_q6_k(hold(_q6_blocks(seed=13, n=N2), FORMATS["Q6_K"]).cuda(), K)
    products = [(lambda x: quant_gluon.linear(x, words, heads, N2, K, split, True),
                 quant_gluon.reference(words, heads, N2, K, True).to(torch.bfloat16)),
                (lambda x: quant_gluon.linear_q6_k(x, planes, N2, K, split),
                 quant_gluon.reference_q6_k(*planes, N2, K))]
    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    counts = (1, 17, 20, 24, 33, 40, 41, 48, 49, ROWS)
    monkeypatch.setattr(quant_gluon, "TAILS", False)
    monkeypatch.setattr(quant_gluon, "MAXNREG", None)
    want = [[product(x[:rows]) for rows in counts] for product, _ in products]  # (no tails, ptxas' registers)
    monkeypatch.setattr(quant_gluon, "TAILS", True)
    monkeypatch.setattr(quant_gluon, "MAXNREG", maxnreg)
    monkeypatch.setattr(quant_gluon, "TAIL_FROM", tail_from)
    for (product, weight), wanted in zip(products, want, strict=True):
        for c0 in range(0, K, 40):
            rows = min(40, K - c0)  # 40 one-hot rows a launch (32 + 8), the last 32
            eye = torch.zeros(rows, K, device="cuda", dtype=torch.bfloat16)
            eye[torch.arange(rows), c0 + torch.arange(rows)] = 1
            assert torch.equal(product(eye), weight[:, c0:c0 + rows].T), c0
        for rows, w in zip(counts, wanted, strict=True):
            assert torch.equal(product(x[:rows]), w), rows


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("n", [N2, 500])
def test_on_the_gpu_a_verifys_256_row_tiles_give_the_128_row_tiles_bits(split, n):
    """16 warps (``WIDE_WARPS``' launch: four warpgroups, one x tile; asked for here, since the rule keeps a weight
    this small on 8), Q4_K's pairs and Q6_K, one 256-row tile (``N2``) and two, the second partial (500 rows): one-hot
    rows read each weight back (40 rows a launch, 32 + 8), and every row count's product has the bits of the engine's
    8-warp launch (a column's sums do not depend on the rows beside it)."""
    from engine.models.quant import hold

    words, heads = quant_gluon.repack(_blocks(seed=16, n=n).cuda(), K, True)
    planes = quant_gluon.repack_q6_k(hold(_q6_blocks(seed=17, n=n), FORMATS["Q6_K"]).cuda(), K)
    products = [(lambda x, w: quant_gluon.linear(x, words, heads, n, K, split, True, False, w),
                 quant_gluon.reference(words, heads, n, K, True).to(torch.bfloat16)),
                (lambda x, w: quant_gluon.linear_q6_k(x, planes, n, K, split, False, w),
                 quant_gluon.reference_q6_k(*planes, n, K))]
    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    for product, weight in products:
        for c0 in range(0, K, 40):
            rows = min(40, K - c0)
            eye = torch.zeros(rows, K, device="cuda", dtype=torch.bfloat16)
            eye[torch.arange(rows), c0 + torch.arange(rows)] = 1
            assert torch.equal(product(eye, 16), weight[:, c0:c0 + rows].T), c0
        for rows in (17, 32, 33, 40, 41, 48):  # (the rows WIDE_WARPS takes: 32 a program, with a tail or not)
            assert torch.equal(product(x[:rows], 16), product(x[:rows], None)), rows


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("split", [2, 4])
def test_on_the_gpu_a_folded_launch_gives_the_unfolded_launchs_bits(split):
    """``fold`` (two of an even split's parts a program, the program adding the pair; for a verify's launches by
    ``folds``' rule where ``FOLD_FROM`` is set, an option), Q4_K's pairs, Q6_K and Q4_1 (K = 1536: 12 tiles, 6
    parts too): one-hot rows read each weight back folded, and at every row count a folded launch has the
    unfolded one's bits (whose last part adds the pairs first, ``PAIRED``), a lone row's bits its bits among the
    rest."""
    from engine.models.quant import hold
    from tests.engine.models.test_quant_gluon import _q41_blocks

    cols1 = 1536
    words, heads = quant_gluon.repack(_blocks(seed=18, n=N2).cuda(), K, True)
    planes = quant_gluon.repack_q6_k(hold(_q6_blocks(seed=19, n=N2), FORMATS["Q6_K"]).cuda(), K)
    q41 = quant_gluon.repack_q4_1(_q41_blocks(seed=20, n=N2, cols=cols1).cuda(), cols1)
    # (the register path: an AR step's few programs would take shared-memory stages, which do not fold)
    products = [(lambda x, f: quant_gluon.linear(x, words, heads, N2, K, split, True, stages=0, fold=f),
                 quant_gluon.reference(words, heads, N2, K, True).to(torch.bfloat16), K, split),
                (lambda x, f: quant_gluon.linear_q6_k(x, planes, N2, K, split, stages=0, fold=f),
                 quant_gluon.reference_q6_k(*planes, N2, K), K, split),
                *[(lambda x, f, s=s: quant_gluon.linear_q4_1(x, q41, N2, cols1, s, stages=0, fold=f),
                   quant_gluon.reference_q4_1(*q41, N2, cols1), cols1, s) for s in (split, 6)]]
    for product, weight, cols, s in products:
        _reads_back(lambda x, product=product: product(x, True), weight)
        x = torch.randn(ROWS, cols, device="cuda", dtype=torch.bfloat16)
        for rows in (1, 8, 16, 17, 33, 40, 41, 48, 64, ROWS):
            unfolded = product(x[:rows], False)
            assert torch.equal(product(x[:rows], True), unfolded), (s, rows)
            assert torch.equal(unfolded[:1], product(x[:1], False)), (s, rows)


def test_a_verifys_launch_folds_an_even_split_where_its_folded_programs_fill_the_sms_in_one_wave(monkeypatch):
    """``folds``: from ``FOLD_FROM`` rows a program (32 here: a verify's 8-warp launches; None, the engine's until its
    GPU test has run: never), the register path, an even
    split, and the folded programs (tiles x split / 2) at least the SMs and at most a wave (two 8-warp programs an SM,
    four of 4 warps): the 27B's GDN in_proj at 33 rows (129 tiles of 128 rows in 4 parts), its o_proj (40 in 12), not
    its gate_up in 2 (272: a second wave), not 40 in 6 (120 programs), not at 1 or 16 rows. ``_launch`` grids the
    folded parts and passes ``FOLD``, and ``PAIRED`` where the last part adds an even split's pairs; a Q6_K launch
    folds only when asked; ``fold=True`` with an odd split or stages is refused, naming both."""
    folds = quant_gluon.folds
    assert quant_gluon.FOLD_FROM is None and not folds(32, 0, 129, 4, 132)
    monkeypatch.setattr(quant_gluon, "FOLD_FROM", 32)
    assert [folds(32, 0, 129, 4, 132), folds(32, 0, 40, 12, 132), folds(32, 0, 272, 2, 132, 4),
            folds(32, 0, 66, 4, 132, 16)] == [True] * 4
    assert not any([folds(32, 0, 272, 2, 132), folds(8, 0, 258, 4, 132, 4), folds(16, 0, 258, 4, 132, 4),
                    folds(32, 0, 40, 6, 132), folds(32, 0, 272, 3, 132), folds(32, 3, 129, 4, 132),
                    folds(32, 0, 66, 6, 132, 16), folds(64, 0, 40, 8, 132)])  # (64 a program: one an SM)
    kernel = _Launches()
    n_pad, cols = 128 * 132, 1536  # (K: 12 tiles)
    for m, split, fold in [(33, 2, None), (33, 3, None), (1, 2, None), (33, 4, False), (50, 4, True),
                           (33, 1, None)]:  # 132 tiles
        quant_gluon._launch(kernel, torch.zeros(m, cols, dtype=torch.bfloat16), (), n_pad, n_pad, cols, split, None,
                            fold, STAGES=0)
    assert [(grid, kw["FOLD"], kw["PAIRED"]) for grid, kw, _ in kernel.seen] == [
        ((132, 1, 1), True, False), ((132, 3, 1), False, False), ((264, 2, 1), False, True),
        ((132, 4, 1), False, True), ((132, 2, 1), True, False), ((132, 1, 1), False, False)]
    args = kernel.seen[-2][2]  # (k_tiles, split): a folded program's tiles, the launch's parts
    assert args[-3:-1] == (6, 2)
    planes = (torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(n_pad))  # (Q6_K's d: n_pad rows)
    monkeypatch.setattr(quant_gluon.kernels, "_q6_kernel", kernel)
    monkeypatch.setattr(quant_gluon.kernels, "_q4_1_kernel", kernel)
    x = torch.zeros(33, cols, dtype=torch.bfloat16)
    for fold in (None, True):
        quant_gluon.linear_q6_k(x, planes, n_pad, cols, 2, fold=fold)
        quant_gluon.linear_q4_1(x, planes[:1] + planes[3:], n_pad, cols, 2, fold=fold)
    assert [kw["FOLD"] for _, kw, _ in kernel.seen[-4:]] == [False, True, True, True]  # (Q6_K folds when asked)
    with pytest.raises(ValueError, match="split=5: a weight's K splits into whole 128-column tiles, a divisor of "
                                         "its 12"):
        quant_gluon._launch(kernel, x, (), n_pad, n_pad, cols, 5, None, STAGES=0)
    with pytest.raises(ValueError, match="fold=True takes the register path .stages 0 or 1., not stages=3"):
        quant_gluon.compile_for_hopper(32, "pairs", stages=3, fold=True)
    for split, stages in [(3, 0), (2, 3)]:
        with pytest.raises(ValueError, match=f"fold=True takes an even split.*split={split}, stages={stages}"):
            quant_gluon._launch(kernel, torch.zeros(33, cols, dtype=torch.bfloat16), (), n_pad, n_pad, cols, split,
                                None, True, STAGES=stages)


@pytest.mark.skipif(not torch.cuda.is_available() or quant_gluon.gluon is None, reason="needs CUDA and Gluon")
@pytest.mark.parametrize("stages", [None, 0])
def test_on_the_gpu_a_weight_split_for_the_verify_keeps_a_rows_bits_folded_and_unfolded(monkeypatch, stages):
    """A weight whose split ``VERIFY_SLIVER`` doubled (``OperandWeight.fold_pairs``): its AR step's and prefill's
    launches fold the pairs, its verify's do not (and a small weight's staged AR launch does not), and a row's bits
    are the same in each (a lone row's, the first of 8, of a verify's 33, of 40 and of 100); Q4_K's pairs and Q4_1,
    one-hot rows reading each weight back at 1 row. ``STAGES`` 0: every launch on the register path, the AR step's
    folded too."""
    from tests.engine.models.test_quant_gluon import _q41_blocks

    monkeypatch.setattr(quant_gluon, "STAGES", stages)

    cols1 = 1536
    q4k = quant_gluon.repack(_blocks(seed=21, n=N2).cuda(), K, True)
    q41 = quant_gluon.repack_q4_1(_q41_blocks(seed=22, n=N2, cols=cols1).cuda(), cols1)
    weights = [(quant_gluon.OperandWeight("Q4_K", N2, K, 4, (), True), q4k,
                quant_gluon.reference(*q4k, N2, K, True).to(torch.bfloat16)),
               (quant_gluon.OperandWeight("Q4_1", N2, cols1, 6, (), True), q41,
                quant_gluon.reference_q4_1(*q41, N2, cols1))]
    for operand, planes, weight in weights:
        assert [operand.fold(m, 34816) for m in (1, 8, 33, 40, 100)] == [True, True, False, False, True]
        # (228 rows, 4 tiles of 64: fewer programs than SMs, so its 1-row launch takes shared-memory stages, unfolded)
        assert [operand.fold(m, N2) for m in (1, 33, 100)] == [None if stages is None else True, False, True]
        x = torch.randn(ROWS, operand.cols, device="cuda", dtype=torch.bfloat16)
        lone = operand.product(x[:1], planes)
        for rows in (8, 33, 40, ROWS):
            assert torch.equal(operand.product(x[:rows], planes)[:1], lone), (operand.fmt, rows)
        eye = torch.eye(operand.cols, device="cuda", dtype=torch.bfloat16)
        for c in range(0, operand.cols, 97):  # (1 row a launch: the folded AR launch reads the weight back)
            assert torch.equal(operand.product(eye[c:c + 1], planes)[0], weight[:, c]), (operand.fmt, c)


def test_a_weight_whose_verify_launch_spills_a_sliver_past_its_waves_takes_twice_the_parts(monkeypatch):
    """``VERIFY_SLIVER`` (None, the engine's: never; 8 here): ``split_and_fold`` doubles the aim's split of a Q4_K or
    Q4_1 weight whose verify launch (128-row tiles, two programs an SM) is more than a wave with at most an eighth
    of a wave past whole waves: the 27B's gate_up (272 tiles in 1 part on 264 places: 8 past) takes 2, folded;
    its GDN in_proj (129 tiles in 2: one wave), o_proj (40 in 6: 240 programs) and every Q6_K keep theirs, as do
    the down (136 K tiles: 16 parts are not whole runs) and a weight whose doubled parts would be shorter than two
    tiles; at 1/64 of a wave gate_up's 8 past is too many. ``OperandWeight.product`` folds
    the pairs in every launch but a verify's (17-48 rows) and passes the kernel the weight's split; a shared-memory
    stage (``STAGES``) leaves ``folds``' rule."""
    shapes = [(34816, 5120), (16480, 5120), (5120, 17408), (5120, 6144), (34816, 256)]
    assert quant_gluon.VERIFY_SLIVER is None
    assert [quant_gluon.split_and_fold(*shape) for shape in shapes] == [(1, False), (2, False), (8, False),
                                                                        (6, False), (1, False)]
    monkeypatch.setattr(quant_gluon, "VERIFY_SLIVER", 8)
    assert [quant_gluon.split_and_fold(*shape) for shape in shapes] == [(2, True), (2, False), (8, False),
                                                                        (6, False), (1, False)]
    assert quant_gluon.split_for(34816, 5120) == 2 and quant_gluon.split_and_fold(34816, 5120, fmt="Q6_K") == (1, False)
    assert quant_gluon.split_and_fold(34816, 5120, fmt="Q4_1") == (2, True)
    assert quant_gluon.verify_doubles(34816, 5120, 1, 132) and not quant_gluon.verify_doubles(34816, 5120, 1, 136)
    monkeypatch.setattr(quant_gluon, "VERIFY_SLIVER", 64)  # (8 past 264 is more than a 64th)
    assert quant_gluon.split_and_fold(34816, 5120) == (1, False)

    kernel = _Launches()
    monkeypatch.setattr(quant_gluon.kernels, "_gluon_kernel", kernel)
    monkeypatch.setattr(quant_gluon.fused, "quant_decode", lambda: "gluon")
    n, cols = 34816, 1536  # (K: 12 tiles; 544 64-row tiles, 272 of 128 rows)
    operand = quant_gluon.OperandWeight("Q4_K", n, cols, 4, (), True)
    planes = (torch.zeros(1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32))
    for m in (1, 33, 100):
        operand.product(torch.zeros(m, cols, dtype=torch.bfloat16), planes)
    assert [(grid, kw["FOLD"], kw["PAIRED"]) for grid, kw, _ in kernel.seen] == [
        ((544, 2, 1), True, False), ((272, 4, 1), False, True), ((272, 2, 2), True, False)]
    # (k_tiles, split): a folded program's 6 tiles, two parts of 3; the verify's 4 parts of 3
    assert [args[-3:-1] for _, _, args in kernel.seen] == [(6, 2), (3, 4), (6, 2)]
    assert quant_gluon.OperandWeight("Q4_K", n, cols, 4, ()).fold(1, n) is None
    assert operand.fold(1, 128) is None  # (2 tiles x 4 parts: fewer programs than SMs, staged)
    monkeypatch.setattr(quant_gluon, "STAGES", 3)
    assert operand.fold(1, n) is None


def test_a_verifys_launch_takes_wide_warps_where_its_rows_are_whole_tiles_of_theirs(monkeypatch):
    """``wide_warps``: ``WIDE_WARPS`` (8, the engine's; 16: 256-row tiles) for 32 rows a program (17-48 rows) on the
    register path whose wide tiles, times the split, fill the SMs; ``_warps`` then takes it where the padded rows are
    whole tiles of theirs, else 8 where they are whole 128-row tiles, else 4 (warps asked for: ``test_quant_gluon.py``).
    ``_launch`` grids the tiles of its warps, and refuses 16 warps with shared-memory stages."""
    assert [quant_gluon._warps(b, 256, None) for b in (8, 16, 32, 64)] == [4, 4, 8, 8]
    monkeypatch.setattr(quant_gluon, "WIDE_WARPS", 16)
    wide = quant_gluon.wide_warps
    assert [wide(32, 0, 34816, 1, 132), wide(32, 0, 5120, 8, 132), wide(32, 0, 5120, 6, 132)] == [True, True, False]
    assert not wide(64, 0, 34816, 1, 132) and not wide(16, 0, 34816, 1, 132) and not wide(32, 3, 34816, 1, 132)
    assert [quant_gluon._warps(32, n, None) for n in (256, 384, 192)] == [16, 8, 4]
    assert quant_gluon._warps(32, 256, None, wide=False) == 8
    kernel = _Launches()
    n_pad = 256 * 66  # 66 wide tiles x 2 parts: 132 programs
    for m in (1, 20, 33, 50):
        quant_gluon._launch(kernel, torch.zeros(m, K, dtype=torch.bfloat16), (), n_pad, n_pad, K, 2, None, STAGES=0)
    quant_gluon._launch(kernel, torch.zeros(33, K, dtype=torch.bfloat16), (), n_pad, n_pad, K, 2, None, STAGES=3)
    assert [(grid, kw["num_warps"], kw.get("maxnreg")) for grid, kw, _ in kernel.seen] == [
        ((264, 2, 1), 4, None), ((66, 2, 1), 16, None), ((66, 2, 1), 16, None), ((132, 2, 1), 8, None),
        ((132, 2, 1), 8, None)]
    with pytest.raises(ValueError, match="warps=16 takes the register path .stages 0 or 1., not stages=3"):
        quant_gluon._launch(kernel, torch.zeros(33, K, dtype=torch.bfloat16), (), 256, 256, K, 2, 16, STAGES=3)


def test_a_verifys_rows_take_a_tail_only_where_it_fits_in_a_quarter_of_their_power_of_two(monkeypatch):
    """``_rows_a_program``: with ``TAILS`` (the engine's) 33-40 rows as 32 + 8, 41-48 as 32 + 16, and at ``TAIL_FROM``
    32 17-24 as 16 + 8 too; 25-32, 49-64, fewer than 17 and more than 64 (row blocks) the power of two; staged
    launches never; without ``TAILS`` never."""
    counts = (1, 8, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 64, 65)
    powers = [(quant_gluon._block_m(m), 0) for m in counts]
    assert [quant_gluon._rows_a_program(m) for m in counts] == [
        *powers[:7], (32, 8), (32, 8), (32, 16), (32, 16), (64, 0), (64, 0), (64, 0)]
    monkeypatch.setattr(quant_gluon, "TAIL_FROM", 32)
    assert [quant_gluon._rows_a_program(m) for m in counts] == [
        (8, 0), (8, 0), (16, 0), (16, 8), (16, 8), (32, 0), (32, 0), (32, 8), (32, 8), (32, 16), (32, 16), (64, 0),
        (64, 0), (64, 0)]
    assert quant_gluon._rows_a_program(33, stages=3) == (64, 0)
    monkeypatch.setattr(quant_gluon, "TAILS", False)
    assert [quant_gluon._rows_a_program(m) for m in counts] == powers


class _Launches:
    """A kernel stand-in recording each launch's grid and keywords."""

    def __init__(self):
        self.seen = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.seen.append((grid, kwargs, args))


@pytest.mark.parametrize("pdl", [False, True])
def test_a_launch_passes_its_tail_pdl_and_register_cap_to_the_kernel(monkeypatch, pdl):
    """``_launch``: the grid (tiles of the warps of the rows' power of two, the split, row blocks of BLOCK_M + TAIL),
    ``TAIL``, ``PDL`` as a constexpr and as ``launch_pdl``, and ``MAXNREG`` only on 8 warps with a tail (the engine's
    settings: tails from 64 rows' power of two, 128 registers)."""
    monkeypatch.setattr(quant_gluon, "PDL", pdl)
    kernel = _Launches()
    for m in (1, 20, 33, 50, 100):
        quant_gluon._launch(kernel, torch.zeros(m, K, dtype=torch.bfloat16), (), 256, 200, K, 2, None, STAGES=0)
    grids = [grid for grid, _, _ in kernel.seen]
    assert grids == [(4, 2, 1), (2, 2, 1), (2, 2, 1), (2, 2, 1), (2, 2, 2)]  # 256 padded rows: 64- or 128-row tiles
    options = [(kw["BLOCK_M"], kw["TAIL"], kw["num_warps"], kw.get("maxnreg")) for _, kw, _ in kernel.seen]
    assert options == [(8, 0, 4, None), (32, 0, 8, None), (32, 8, 8, 128), (64, 0, 8, None), (64, 0, 8, None)]
    assert all(kw["PDL"] is pdl and kw["launch_pdl"] is pdl for _, kw, _ in kernel.seen)


def test_shared_memory_stages_take_the_pair_decode_with_x_staged():
    """``stages`` 2 or more with the float decode or x read ahead into registers: refused, naming both."""
    for pairs, ahead in [(False, False), (True, True)]:
        with pytest.raises(ValueError, match=f"stages=3.*pairs={pairs}, x_ahead={ahead}"):
            quant_gluon._stages(3, pairs, ahead)
    assert quant_gluon._stages(3, True, False) == 3 and quant_gluon._stages(1, False, True) == 1


def test_an_ar_steps_launch_of_fewer_programs_than_sms_takes_its_tiles_through_shared_memory(monkeypatch):
    """``few_rows_stages`` (``FEW_ROWS_STAGES``): 1-8 rows whose launch has fewer programs (64-row tiles times parts)
    than SMs take their part's tiles and one more, at most ``FEW_ROWS_STAGES``; more rows, as many programs as SMs
    or the setting off: the register path (0). SmolLM2's weights on 132 SMs, then the 27B's gate_up."""
    monkeypatch.setattr(quant_gluon, "FEW_ROWS_STAGES", 6)
    sms = 132
    assert quant_gluon.few_rows_stages(1, 960, 576, 1, sms) == 6  # qkv: 15 programs, 5 tiles
    assert quant_gluon.few_rows_stages(8, 3072, 576, 1, sms) == 6  # gate_up: 48
    assert quant_gluon.few_rows_stages(1, 576, 1536, 6, sms) == 3  # down: 54 programs of 2 tiles
    assert quant_gluon.few_rows_stages(9, 960, 576, 1, sms) == 0  # a verify's rows
    assert quant_gluon.few_rows_stages(1, 34816, 5120, 1, sms) == 0  # 544 programs
    assert quant_gluon.few_rows_stages(1, 8448, 576, 1, sms) == 0  # 132 programs: one an SM already
    monkeypatch.setattr(quant_gluon, "FEW_ROWS_STAGES", 3)
    assert quant_gluon.few_rows_stages(1, 960, 576, 1, sms) == 3
    monkeypatch.setattr(quant_gluon, "MIN_BLOCK_M", 16)
    assert quant_gluon.few_rows_stages(16, 960, 576, 1, sms) == 3
    monkeypatch.setattr(quant_gluon, "STAGED_ROWS", 64)  # a verify's few-program launches too
    assert quant_gluon.few_rows_stages(49, 960, 576, 1, sms) == 3
    assert quant_gluon.few_rows_stages(65, 960, 576, 1, sms) == 0
    assert quant_gluon._rows_a_program(41, stages=3) == (64, 0)  # (staged: no tail)
    monkeypatch.setattr(quant_gluon, "FEW_ROWS_STAGES", 0)
    assert quant_gluon.few_rows_stages(1, 960, 576, 1, sms) == 0
    assert quant_gluon.STAGES is None  # (the engine's: the rule; 0 the register path for every launch)
    assert quant_gluon._stages(None, True, False, torch.zeros(1, 576)) == 0  # the CPU: no rule
    monkeypatch.setattr(quant_gluon, "STAGES", 3)
    assert quant_gluon._stages(None, True, False, torch.zeros(1, 576)) == 3
