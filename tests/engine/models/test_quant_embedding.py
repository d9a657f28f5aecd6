"""A token embedding kept in its GGUF blocks (``engine.models.quant_embedding``, ``quant.QuantEmbedding``): in
Triton's interpreter on the CPU (on a GPU, the same tests run the kernel), a lookup gives the rows of the weight
``quant.dequantize`` gives, bit for bit, whichever ids it is asked for."""

from __future__ import annotations

import pytest
import torch

from engine.models import fused
from engine.models import quant_embedding as qe
from engine.models import quant_kernel as qk
from engine.models.quant import FORMATS, QuantEmbedding, dequantize, unhold
from tests.engine.models.test_quant_kernel import DEVICE, _bits, _blocks

pytest.importorskip("triton")
pytest.importorskip("gguf")


# A row's width in 32-value blocks: 9 and 18 end past a 256-value tile, 3 inside one 128-value tile; the K
# formats' 256-value blocks: 1, 3, 1 and 2 (Q6_K's rows are whole words at an even count only)
EMBED_WIDTHS = [9, 18, 3, 12]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("blocks_wide", EMBED_WIDTHS)
def test_the_embedding_kernel_gathers_the_dequantized_rows_bit_for_bit(name, blocks_wide):
    """``embedding``: any ids (repeated, unordered, more than a program's rows) give the rows of the weight
    ``dequantize`` gives, rounded once into bf16 or fp16, at every width whose rows are whole words (the
    others, Q4_0 / Q5_0 / Q8_0 / Q6_K rows of an odd count of blocks, are left to PyTorch: ``use``)."""
    fmt = FORMATS[name]
    k = fmt.values * (blocks_wide if fmt.values == 32 else max(1, blocks_wide // 6))
    blocks = _blocks(name, 50, k, seed=k + len(name))
    ids = torch.tensor([3, 0, 49, 7, 7, 21, *range(1, 14), 40], device=DEVICE)
    if not qk.reads_words(fmt, qe.embed_block_k(k), blocks):
        assert fmt.planes and fmt.row_bytes(k) % 4
        return
    for dtype in (torch.bfloat16, torch.float16):
        got = qe.embedding(ids, blocks, fmt, k, dtype)
        want = dequantize(unhold(blocks, fmt), fmt, k, dtype)[ids]
        assert got.dtype == dtype and torch.equal(_bits(got), _bits(want)), dtype
    # ids that are not one run in memory (a batch's last column): read as the values they hold
    grid = torch.arange(40, device=DEVICE).view(4, 10)
    got = qe.embedding(grid[:, -1:].reshape(-1), blocks, fmt, k, torch.bfloat16)
    assert torch.equal(_bits(got), _bits(dequantize(unhold(blocks, fmt), fmt, k, torch.bfloat16)[[9, 19, 29, 39]]))


def test_an_embedding_lookup_takes_the_kernel_where_the_kernels_are_on(monkeypatch):
    """``QuantEmbedding`` in half precision takes ``embedding`` where the kernels are on (here forced on the
    CPU: Triton's interpreter), and dequantizes its rows in PyTorch in float32 or with rows it cannot read
    as words; the rows are the same either way."""
    fmt = FORMATS["Q4_K"]
    embed = QuantEmbedding(fmt, 30, 512, blocks=_blocks("Q4_K", 30, 512, seed=5)).to(torch.bfloat16)
    ids = torch.tensor([[4, 29], [0, 4]], device=DEVICE)
    want = embed.dequantized(torch.bfloat16)[ids]
    assert torch.equal(embed(ids), want)
    monkeypatch.setattr(fused, "use_kernels", lambda *tensors: True)
    calls = []
    kernel = qe.embedding
    monkeypatch.setattr(qe, "embedding", lambda *a: calls.append(a[1:]) or kernel(*a))
    assert torch.equal(embed(ids), want) and len(calls) == 1
    assert torch.equal(embed.float()(ids), embed.dequantized()[ids]) and len(calls) == 1  # float32: PyTorch's
    odd = QuantEmbedding(FORMATS["Q8_0"], 30, 96, blocks=_blocks("Q8_0", 30, 96, seed=6)).to(torch.bfloat16)
    assert torch.equal(odd(ids), odd.dequantized(torch.bfloat16)[ids]) and len(calls) == 1  # 102-byte rows
    # an id outside the table: refused by the PyTorch form, as nn.Embedding refuses it; the kernel reads
    # nothing outside the blocks (its row is zeros) and the ids beside it are unaffected
    with pytest.raises(IndexError):
        embed.float()(torch.tensor([30], device=DEVICE))
    got = qe.embedding(torch.tensor([4, 30, -1, 0], device=DEVICE), embed.blocks, fmt, 512, torch.bfloat16)
    assert torch.equal(got[[0, 3]], embed.dequantized(torch.bfloat16)[[4, 0]])
    assert not got[1:3].float().abs().any()
