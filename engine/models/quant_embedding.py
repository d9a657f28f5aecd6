"""A token embedding kept in its GGUF blocks, looked up on the GPU (``quant.QuantEmbedding``): the rows of the
ids asked for, dequantized in registers by the block product's word decodes (``quant_kernel``: the same float32
values, rounded once into the model's dtype, so ``dequantize``'s bits) and written out, one launch. A lookup in
a captured step is one kernel, where PyTorch's dequantization of the rows is a dozen."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.models import fused
from engine.models import linear as rows_linear
from engine.models import quant_kernel as qk

if TYPE_CHECKING:  # quant.py calls this module: the format's type only, no import cycle
    from engine.models.quant import BlockFormat

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - installs without Triton dequantize the rows in PyTorch
    triton = None

EMBED_ROWS = 16  # tokens a program of ``embedding`` looks up (its tile: these rows x ``embed_block_k`` values)


def embed_block_k(cols: int) -> int:
    """The K tile of an ``embedding`` launch: 256 values, or the row's width rounded up to a power of two
    where that is less (every ``quant_kernel.WORD_FORMATS`` chunk, 32 to 128 values, divides either)."""
    return min(256, triton.next_power_of_2(cols))


def use_embedding_kernel(ids: Tensor, blocks: Tensor, fmt: BlockFormat, dtype: torch.dtype) -> bool:
    """Whether a ``QuantEmbedding`` lookup of ``ids`` takes ``embedding``: the kernels on (CUDA, ``kernels:
    fused``), a half-precision model, a format read as words with rows of whole words (every held format
    at a width of whole 32-bit words: a 27B's 5,120, SmolLM2's 576)."""
    if triton is None or fmt.name not in qk.WORD_FORMATS or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not fused.use_kernels(blocks) or ids.device != blocks.device or ids.numel() == 0:
        return False
    cols = blocks.shape[1] // fmt.nbytes * fmt.values
    return qk.reads_words(fmt, embed_block_k(cols), blocks)


def embedding(ids: Tensor, blocks: Tensor, fmt: BlockFormat, cols: int, dtype: torch.dtype) -> Tensor:
    """The rows ``ids`` [M] of a weight held in ``blocks`` (``QuantEmbedding``'s), dequantized into ``dtype``
    [M, cols] by the word decodes of ``quant_kernel._quant_kernel`` (the same float32 values, rounded once:
    ``dequantize``'s bits), one launch.
    An id outside the rows reads nothing (its row is left as the decodes leave masked values, zeros); the
    engine's ids are its tokenizer's, and the PyTorch form refuses such an id as ``nn.Embedding`` does.
    On CPU tensors it runs only in Triton's interpreter (the CPU tests)."""
    assert blocks.dtype == torch.uint8 and blocks.shape[1] == fmt.row_bytes(cols) and blocks.stride(1) == 1, (
        f"{fmt.name} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold rows of {cols} values")
    ids = ids.reshape(-1).contiguous()  # (the kernel reads the ids as one run)
    block_k = embed_block_k(cols)
    assert qk.reads_words(fmt, block_k, blocks), f"{fmt.name} rows of {cols} values are not whole aligned words"
    m = ids.numel()
    out = torch.empty(m, cols, device=blocks.device, dtype=dtype)
    view = blocks.view(torch.int32)
    _embedding_kernel[(triton.cdiv(m, EMBED_ROWS), triton.cdiv(cols, block_k))](
        ids, view, out, m, blocks.shape[0], cols, view.stride(0), qk.NIBBLE, FMT=qk.KERNEL_FORMATS[fmt.name],
        VALUES=fmt.values, NBYTES=fmt.nbytes, **qk.word_constants(fmt, True), EVEN_K=cols % block_k == 0,
        BLOCK_N=EMBED_ROWS, BLOCK_K=block_k, INTERPRET=rows_linear._INTERPRET, num_warps=4, num_stages=1)
    return out


if triton is not None:
    from engine.models.quant_kernel import _decode_q6_k_words, _decode_q8_0_words, _decode_words, _round

    # ``embedding``: rows ``ids`` of a held weight, each tile [BLOCK_N rows, BLOCK_K values] decoded by the
    # product's word decodes (each row's first word: its id's) and rounded once, as the product rounds its tile
    @triton.jit(do_not_specialize=["M", "N", "nibble"])  # (N, the table's rows, only bounds the ids)
    def _embedding_kernel(ids_ptr, w_ptr, out_ptr, M, N, K, row_stride, nibble, FMT: tl.constexpr,
                          VALUES: tl.constexpr, NBYTES: tl.constexpr, WORDS: tl.constexpr, CHUNK: tl.constexpr,
                          CHUNK_WORDS: tl.constexpr, FIRST_BYTE: tl.constexpr, EVEN_K: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + rm, mask=rm < M, other=0).to(tl.int64)
        mm = (rm < M) & (ids >= 0) & (ids < N)  # (an id outside the rows reads nothing)
        row_word = tl.where(mm, ids, 0) * row_stride
        k0 = tl.program_id(1) * BLOCK_K
        if FMT == 7:
            w = _decode_q6_k_words(w_ptr, row_word, k0, K, K, mm, nibble, EVEN_K, BLOCK_N, BLOCK_K)
        elif FMT == 4:
            w = _decode_q8_0_words(w_ptr, row_word, k0, K, K, mm, BLOCK_N, BLOCK_K)
        else:
            w = _decode_words(w_ptr, row_word, k0, K, K, mm, nibble, FMT, VALUES, NBYTES, CHUNK, CHUNK_WORDS,
                              FIRST_BYTE, EVEN_K, BLOCK_N, BLOCK_K)
        rk = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], _round(w, out_ptr.dtype.element_ty, INTERPRET),
                 mask=(rm < M)[:, None] & (rk < K)[None, :])
