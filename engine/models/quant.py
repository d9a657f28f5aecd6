"""GGUF weights kept in their quantized blocks: the block formats, their dequantization in PyTorch,
and the linear layers (and the untied token embedding, ``QuantEmbedding``) that hold them.

A quantized weight [N, K] is held as its GGUF bytes: a uint8 tensor [N, row_bytes] whose row n is
output n's K / ``values`` blocks in order (GGUF stores a matrix row by row, each block over
consecutive inputs of one row). Rows are contiguous and start on a block boundary, so a GPU kernel
can later read a tile of rows x blocks in place and dequantize in registers; and the rows of two
weights of one format and width stack along dim 0 (a fused q/k/v or gate/up is one block tensor).
Four formats are held with each row's bytes regrouped (``BlockFormat.planes``, ``hold``): Q4_0, Q5_0, Q8_0
and Q6_K, whose 18-, 22-, 34- and 210-byte blocks would leave their values unaligned for the kernel's word
loads; same bytes, same shape.

On CUDA with the kernels on, a decode step's rows (up to ``linear.MAX_ROWS``) take the few-row kernel of
``engine.models.quant_kernel``, which reads the blocks and dequantizes in registers; elsewhere (the CPU,
float32, forwards past ``MAX_ROWS``, ``kernels: eager``) a layer dequantizes its whole weight per call, in float32,
then casts to the activation dtype. Both give the values a dequantized load copies into its parameters
(gguf's reference, bit for bit: ``tests/engine/models/test_quant.py``), multiplied as the dense kernel
multiplies them, so a model decodes the same tokens whichever way its weights are kept (tested on the
CPU in float32). On CUDA in bf16 a group of mixed formats runs as separate products where the
dequantized twin fuses them, with other launch plans, so the two can round apart at near-ties; each is
still exact against its own AR. On an sm_90 GPU in bf16, Q4_K, Q6_K and Q4_1 weights are held instead as the
planes of ``engine.models.quant_gluon`` (at load, ``hold_operands_``), whose decode into the matrix unit's
registers takes every product and multiplies by values of its own (bf16 steps and offsets: not
``dequantize``'s), so a native model there is exact against its own AR, not bit-equal to its dequantized twin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models import fused, quant_embedding, quant_kernel
from engine.models import linear as rows_linear

QK_K = 256  # values per block of the K formats (super-blocks of 8 or 16 sub-blocks)
# How a target's GGUF weights are held (``engine.load(..., weights=)``): every tensor dequantized
# into the model's dtype, or the projections of a format below kept in their blocks. (Defined with the
# configs, which name it too: EngineConfig.weights.)
from engine.config import WEIGHTS  # noqa: E402, F401  (re-exported: engine.models.quant.WEIGHTS)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: ``values`` weights in ``nbytes`` bytes; ``scales``: the byte offsets of
    its fp16 scales (the only fields that can hold NaN or inf: the loader checks them);
    ``decode``: uint8 blocks [n, nbytes] -> float32 values [n, values]."""

    name: str
    values: int
    nbytes: int
    scales: tuple[int, ...]
    decode: Callable[[Tensor], Tensor]
    # How a ``QuantLinear`` holds a row (``hold``): its blocks as the file stores them (empty), or in planes,
    # each a field's bytes (a block's byte range [lo, hi)) of every block of the row in order, planes in
    # this order. The same bytes, so the same row length; a format whose blocks leave its values' bytes
    # unaligned takes planes, so the kernel reads them as aligned words (``quant_kernel``).
    planes: tuple[tuple[int, int], ...] = ()

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` values (a multiple of ``values``: checked by the caller)."""
        return cols // self.values * self.nbytes


def _f16(blocks: Tensor, offset: int) -> Tensor:
    """The fp16 at byte ``offset`` of each block, as float32 [n, 1] (exact: fp16 fits float32)."""
    return blocks[:, offset : offset + 2].view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """[n, c, w] bytes -> [n, c, 2, w]: each chunk's low nibbles, then its high ones (GGUF's order)."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _bits(packed: Tensor, every: int) -> Tensor:
    """[n, b] bytes -> [n, b, 8 // every, ...]: fields ``every`` bits wide, lowest first."""
    shifts = torch.arange(0, 8, every, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(-1) >> shifts) & ((1 << every) - 1)


def _q4_0(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 2:18].unsqueeze(1)).reshape(-1, 32).to(torch.int16) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 4:20].unsqueeze(1)).reshape(-1, 32).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _high_bit_32(b: Tensor, offset: int) -> Tensor:
    """Q5_0/Q5_1's fifth bits: a little-endian uint32 at ``offset``, bit j for value j -> [n, 32] (0 or 16)."""
    return _bits(b[:, offset : offset + 4], 1).reshape(-1, 32) << 4


def _q5_0(b: Tensor) -> Tensor:
    q = (_nibbles(b[:, 6:22].unsqueeze(1)).reshape(-1, 32) | _high_bit_32(b, 2)).to(torch.int16) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: Tensor) -> Tensor:
    q = (_nibbles(b[:, 8:24].unsqueeze(1)).reshape(-1, 32) | _high_bit_32(b, 4)).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q8_0(b: Tensor) -> Tensor:
    return b[:, 2:34].view(torch.int8).float() * _f16(b, 0)


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins, [n, 8] each. Bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the mins;
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    lo_s, lo_m, rest = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo_s & 0x3F, (rest & 0x0F) | ((lo_s >> 2) & 0x30)], dim=-1)
    mins = torch.cat([lo_m & 0x3F, (rest >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _k_affine(b: Tensor, q: Tensor) -> Tensor:
    """Q4_K/Q5_K: sub-block j's values q [n, 8, 32] times d * scale_j, less dmin * min_j (products
    rounded in this order, as the reference's)."""
    scales, mins = _k_scales(b[:, 4:16])
    step = (_f16(b, 0) * scales.float()).unsqueeze(-1)
    shift = (_f16(b, 2) * mins.float()).unsqueeze(-1)
    return (step * q.float() - shift).reshape(-1, QK_K)


def _q4_k(b: Tensor) -> Tensor:
    # 128 bytes of nibbles: chunk c of 32 bytes holds sub-block 2c (low) and 2c + 1 (high).
    return _k_affine(b, _nibbles(b[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 8, 32))


def _q5_k(b: Tensor) -> Tensor:
    low = _nibbles(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = _bits(b[:, 16:48], 1).transpose(1, 2)  # [n, 8, 32]: bit j of byte i is sub-block j's value i
    return _k_affine(b, low | (high << 4))


def _q6_k(b: Tensor) -> Tensor:
    # Two halves of 128 values: low nibbles from 64 bytes each (low, then high nibble), the top 2 bits
    # from 32 bytes each (bits 0-1, 2-3, 4-5, 6-7 for the half's four 32-value groups).
    low = _nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    high = _bits(b[:, 128:192].reshape(-1, 2, 32), 2).permute(0, 1, 3, 2).reshape(-1, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(-1, 16, 16)
    step = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return (step * q.float()).reshape(-1, QK_K)


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    # Q4_0's and Q5_0's 18- and 22-byte blocks, as Q8_0's: held as a row's nibble runs, (Q5_0: its fifth-bit
    # runs,) then its d's
    BlockFormat("Q4_0", 32, 18, (0,), _q4_0, planes=((2, 18), (0, 2))),
    BlockFormat("Q4_1", 32, 20, (0, 2), _q4_1),
    BlockFormat("Q5_0", 32, 22, (0,), _q5_0, planes=((6, 22), (2, 6), (0, 2))),
    BlockFormat("Q5_1", 32, 24, (0, 2), _q5_1),
    # Q8_0's 34-byte blocks leave its int8 values 2-byte aligned in every other block: a word of them
    # straddled two, and its word decode ran 3.7x slower than the half-word one (H200, 2026-12-05). Held as
    # a row's 32-value int8 runs, then its fp16 scales: the runs start at the row's start.
    BlockFormat("Q8_0", 32, 34, (0,), _q8_0, planes=((2, 34), (0, 2))),
    BlockFormat("Q4_K", QK_K, 144, (0, 2), _q4_k),
    BlockFormat("Q5_K", QK_K, 176, (0, 2), _q5_k),
    # Q6_K's 210-byte blocks: every other block's words straddled two (H200: 0.35 TB/s where Q4_K streamed
    # 0.8). Held as a row's 128-byte nibble runs, then its 64-byte top-bit runs, 16-byte scales and d's.
    BlockFormat("Q6_K", QK_K, 210, (208,), _q6_k, planes=((0, 128), (128, 192), (192, 208), (208, 210))),
)}


def hold(blocks: Tensor, fmt: BlockFormat) -> Tensor:
    """Rows of blocks as a file stores them, uint8 [N, row_bytes], -> the rows a ``QuantLinear`` holds
    (``BlockFormat.planes``: the same tensor where the format keeps its blocks whole). Row by row, so rows
    of held weights still stack and split along dim 0."""
    if not fmt.planes:
        return blocks
    n, per_row = blocks.shape[0], blocks.shape[1] // fmt.nbytes
    b = blocks.reshape(n, per_row, fmt.nbytes)
    return torch.cat([b[:, :, lo:hi].reshape(n, per_row * (hi - lo)) for lo, hi in fmt.planes], dim=1)


def unhold(held: Tensor, fmt: BlockFormat) -> Tensor:
    """``hold``'s inverse: held rows [N, row_bytes] -> the file's blocks, byte for byte."""
    if not fmt.planes:
        return held
    n, per_row = held.shape[0], held.shape[1] // fmt.nbytes
    out = held.new_empty(n, per_row, fmt.nbytes)
    at = 0
    for lo, hi in fmt.planes:
        out[:, :, lo:hi] = held[:, at : at + per_row * (hi - lo)].reshape(n, per_row, hi - lo)
        at += per_row * (hi - lo)
    return out.reshape(n, held.shape[1])


def held_values(held: Tensor, fmt: BlockFormat, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Held rows (``hold``'s: a ``QuantLinear``'s or ``QuantEmbedding``'s blocks, or some of their rows) -> their
    values [N, cols] in ``dtype``: ``dequantize`` of the file's layout."""
    return dequantize(unhold(held, fmt), fmt, cols, dtype)


def dequantize(blocks: Tensor, fmt: BlockFormat, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Rows of blocks [N, row_bytes] (uint8, in the file's layout: ``unhold`` a ``QuantLinear``'s first) -> the
    weight [N, cols] in ``dtype`` (computed in float32 and rounded once, as a dequantized load copies float32
    values into a ``dtype`` parameter)."""
    rows = blocks.shape[0]
    assert blocks.dtype == torch.uint8 and blocks.shape[1] == fmt.row_bytes(cols) and cols % fmt.values == 0, (
        f"{fmt.name} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold rows of {cols} values")
    out = fmt.decode(blocks.contiguous().view(-1, fmt.nbytes)).reshape(rows, cols)
    return out if dtype == torch.float32 else out.to(dtype)


def bad_scales(blocks: Tensor, fmt: BlockFormat) -> int:
    """How many of the blocks' fp16 scales are NaN or inf (a corrupt file: every value of such a block
    would be); the quantized values are small integers and cannot be."""
    b = blocks.reshape(-1, fmt.nbytes)
    return sum(int((~torch.isfinite(b[:, o : o + 2].contiguous().view(torch.float16))).sum()) for o in fmt.scales)


def _row_blocks(fmt: BlockFormat, rows: int, cols: int, name: str, device: torch.device | str | None,
                blocks: Tensor | None) -> Tensor:
    """A held weight's blocks [rows, row_bytes]: ``blocks`` as given (checked), or empty ones on ``device``;
    ``cols`` (the constructor's argument ``name``) must be whole blocks."""
    if cols % fmt.values:
        raise ValueError(f"{fmt.name} holds rows of whole {fmt.values}-value blocks, but {name} is {cols}")
    shape = (rows, fmt.row_bytes(cols))
    if blocks is None:
        blocks = torch.empty(shape, dtype=torch.uint8, device=device)
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == shape, (tuple(blocks.shape), shape)
    return blocks


class QuantLinear(nn.Module):
    """A projection whose weight [out, in] stays in its GGUF blocks (``blocks``: a uint8 buffer
    [out, row_bytes], moved by ``.to(device)`` and never cast by ``.to(dtype)``), with an optional
    float bias. The stand-in for ``nn.Linear`` / ``common.Linear`` wherever a model calls a projection:
    same ``in_features``, ``out_features``, ``bias`` and call. There is no ``weight``: code that would
    read one fails loudly instead of reading bytes as numbers (``dequantized`` gives the values).

    A decode step's half-precision rows on CUDA take ``quant_kernel`` (the blocks read in place and
    dequantized in registers: a verify's rows round as AR steps do); any other call dequantizes the
    weight in the activation dtype and multiplies as ``common.Linear`` does. On an sm_90 GPU in bf16 a
    Q4_K, Q6_K or Q4_1 weight is held as planes instead (``quant_gluon.hold_operands_``, at load: ``operand``
    says how, the buffers ``planes_0``... hold them, ``blocks`` is empty): every product of bf16 rows on
    that GPU, any count, takes ``quant_gluon``'s decode into the matrix unit's registers."""

    row_invariant = True

    def __init__(self, fmt: BlockFormat, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None, blocks: Tensor | None = None) -> None:
        """Empty blocks (filled by a load) on ``device``, or ``blocks`` [out_features, row_bytes] as given:
        held rows (``hold``; a file's or ``quantize``'s blocks go through it first)."""
        super().__init__()
        blocks = _row_blocks(fmt, out_features, in_features, "in_features", device, blocks)
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.register_buffer("blocks", blocks)
        self.bias = nn.Parameter(torch.empty(out_features, device=blocks.device)) if bias else None
        self.operand = None  # quant_gluon.OperandWeight when held as planes

    def hold_planes(self, operand, planes: Sequence[Tensor]) -> None:
        """Hold the weight as ``operand``'s planes (``quant_gluon.operand_planes`` of these blocks) and free the
        blocks."""
        self.operand = operand
        for i, plane in enumerate(planes):  # a float plane (Q6_K's d) as its bits: ``.to(dtype)`` casts floats
            bits = {2: torch.int16, 4: torch.int32}.get(plane.element_size()) if plane.is_floating_point() else None
            self.register_buffer(f"planes_{i}", plane.view(bits) if bits else plane)
        self.blocks = self.blocks.new_empty(0, self.blocks.shape[1])

    def planes(self) -> tuple[Tensor, ...]:
        """The planes, each in its own dtype (``operand.dtypes``)."""
        return tuple(getattr(self, f"planes_{i}").view(dtype) for i, dtype in enumerate(self.operand.dtypes))

    @property
    def nbytes(self) -> int:
        if self.operand is not None:
            return sum(p.numel() * p.element_size() for p in self.planes())
        return self.blocks.numel()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight [out, in] in ``dtype``: the values a dequantized load holds (held as planes: the values the
        planes' decode multiplies by)."""
        if self.operand is not None:
            return self.operand.values(self.planes(), dtype)
        return held_values(self.blocks, self.fmt, self.in_features, dtype)

    def takes_planes(self, x: Tensor) -> bool:
        """Whether ``x`` goes through the planes' kernel: held as planes, bf16 rows on the planes' GPU, the kernels
        on (``fused.use_kernels``; off, the planes' values multiply as a dequantized weight)."""
        return (self.operand is not None and x.is_cuda and x.dtype == torch.bfloat16
                and x.device == self.planes_0.device and fused.use_kernels(x))

    def forward(self, x: Tensor) -> Tensor:
        if self.takes_planes(x):  # (a bias added to the bf16 product: the same for every row count)
            out = self.operand.product(x, self.planes())
            return out if self.bias is None else out + self.bias
        # the kernel for a draft's projections too (``free_rows_``): it reads the blocks, not a dequantized copy
        if self.operand is None and quant_kernel.use_kernel(x, self.blocks, self.fmt, self.bias):
            return quant_kernel.linear(x, self.blocks, self.fmt, self.in_features, self.bias)
        w = self.dequantized(x.dtype)
        if not self.row_invariant:
            return F.linear(x, w, self.bias)
        return rows_linear.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    """An untied token embedding [vocab, hidden] kept in its GGUF blocks (``blocks``: uint8 [vocab,
    row_bytes], held rows as a ``QuantLinear``'s): the stand-in for ``nn.Embedding`` where a model looks
    tokens up. A lookup reads only its tokens' rows and dequantizes them into the model's dtype, the values a
    dequantized load holds (``dequantize``, bit for bit): one launch where ``quant_embedding.use_embedding_kernel``
    allows (CUDA, the kernels on, a half-precision model, rows of whole 32-bit words), elsewhere in PyTorch.
    A 27B's 248k x 5120 embedding is 2.4 GiB in bf16 and 0.7 in Q4_K (what llama.cpp's Q4_K_M gives it): the
    difference decides whether a 27B target and its draft fit a 24 GB card. A tied embedding (the head
    multiplies by it) stays float.

    The model's dtype rides on an empty float buffer (``like``), cast by ``.to(dtype)`` as the floats are;
    there is no ``weight``, as there is none on a ``QuantLinear``."""

    def __init__(self, fmt: BlockFormat, num_embeddings: int, embedding_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 blocks: Tensor | None = None) -> None:
        super().__init__()
        blocks = _row_blocks(fmt, num_embeddings, embedding_dim, "embedding_dim", device, blocks)
        self.fmt, self.num_embeddings, self.embedding_dim = fmt, num_embeddings, embedding_dim
        self.register_buffer("blocks", blocks)
        self.register_buffer("like", torch.empty(0, dtype=dtype or torch.get_default_dtype(), device=blocks.device),
                             persistent=False)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def dtype(self) -> torch.dtype:
        return self.like.dtype

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The embedding [vocab, hidden] in ``dtype``: the values a dequantized load holds."""
        return held_values(self.blocks, self.fmt, self.embedding_dim, dtype)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        if quant_embedding.use_embedding_kernel(flat, self.blocks, self.fmt, self.dtype):
            rows = quant_embedding.embedding(flat, self.blocks, self.fmt, self.embedding_dim, self.dtype)
        else:  # (index_select, not indexing: an id out of range is refused as nn.Embedding refuses it)
            rows = held_values(self.blocks.index_select(0, flat), self.fmt, self.embedding_dim, self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, {self.num_embeddings}, {self.embedding_dim}"


def shared_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters more than one of ``model``'s modules holds (a head tied to the embedding): an
    embedding among them stays float (the head multiplies by it), one not among them may be kept in blocks
    (``QuantEmbedding``: the loader, the quantization recipe and ``would_keep`` ask this alike)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def keeps_embedding(module: nn.Module, fmt: BlockFormat, tied: set[int]) -> bool:
    """Whether ``module`` is an embedding a native load (and the quantization recipe) holds in ``fmt``'s blocks
    (``QuantEmbedding``): a float ``nn.Embedding`` no other module shares (``tied``: ``shared_parameters``),
    of a width of whole blocks."""
    return (isinstance(module, nn.Embedding) and id(module.weight) not in tied
            and module.embedding_dim % fmt.values == 0)


def embed_rows(embedding: nn.Module, ids: Tensor) -> Tensor:
    """The rows ``ids`` of a target's embedding: a float one's by indexing (for a draft block's 16 rows on
    CUDA, ``index_select``'s small-index kernel, which ``nn.Embedding`` takes, loops over them: 8-9 us on an
    H200 against ~3), a ``QuantEmbedding``'s by its lookup."""
    return embedding.weight[ids] if isinstance(embedding, nn.Embedding) else embedding(ids)


class QuantFusedLinear(QuantLinear):
    """``common.FusedLinear`` for quantized parts of one format and width: their block rows stacked
    (one contiguous block tensor, one GEMM), each part's output a view of the one product."""

    def __init__(self, parts: Sequence[QuantLinear]) -> None:
        assert fusable(parts), "fuse only quantized parts of one format and width (fusable says which)"
        first = parts[0]
        self.sizes = [p.out_features for p in parts]
        self.biased = [p.bias is not None for p in parts]  # a missing bias is stored as zeros
        super().__init__(first.fmt, first.in_features, sum(self.sizes), any(self.biased),
                         blocks=torch.cat([p.blocks for p in parts]))
        if self.bias is not None:
            like = next(p.bias for p in parts if p.bias is not None)
            bias = [p.bias.detach() if p.bias is not None else like.new_zeros(p.out_features) for p in parts]
            self.bias = nn.Parameter(torch.cat(bias), requires_grad=False)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return super().forward(x).split(self.sizes, dim=-1)

    def part(self, x: Tensor, i: int) -> Tensor:
        """Projection ``i`` alone (a draft's context K/V: ``project_part``): its rows of blocks, through the
        kernel where it takes them (read in place), else dequantized; held as planes, its rows of the planes where
        it starts a 64-row tile (``OperandWeight.rows``), else the whole product's columns."""
        lo = sum(self.sizes[:i])
        hi = lo + self.sizes[i]
        bias = None if self.bias is None else self.bias[lo:hi]
        if self.operand is not None:  # its rows of the planes where it starts a tile, else the whole's columns
            if self.takes_planes(x):
                part = self.operand.rows(self.planes(), lo, hi)
                out = part[0].product(x, part[1]) if part else self.operand.product(x, self.planes())[..., lo:hi]
                return out if bias is None else out + bias
            part = self.operand.rows(self.planes(), lo, hi)
            w = part[0].values(part[1], x.dtype) if part else self.dequantized(x.dtype)[lo:hi]
            return F.linear(x, w, bias)
        blocks = self.blocks[lo:hi]
        if quant_kernel.use_kernel(x, blocks, self.fmt, bias):
            return quant_kernel.linear(x, blocks, self.fmt, self.in_features, bias)
        return F.linear(x, held_values(blocks, self.fmt, self.in_features, x.dtype), bias)


def fusable(parts: Sequence[nn.Module]) -> bool:
    """Whether quantized ``parts`` stack into one ``QuantFusedLinear``: all ``QuantLinear`` of one
    format and width. A mixed group (a Q4_K_M file's Q4_K q/k beside its Q6_K v, or a quantized part
    beside a float one) is left as its parts: each keeps its blocks and takes its own GEMM, where
    stacking would need the group dequantized (its bytes grown 4-8x) or two formats in one launch."""
    first = parts[0]
    return all(isinstance(p, QuantLinear) and not isinstance(p, QuantFusedLinear) and p.fmt == first.fmt
               and p.in_features == first.in_features for p in parts)


FLOAT_TYPES = ("F32", "F16", "BF16")  # a GGUF's unquantized types: loaded as floats either way


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s stored weights: every parameter and persistent buffer once (a tied weight
    once; quantized blocks at their size in bytes)."""
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def weights_summary(model: nn.Module, mode: str) -> dict:
    """How ``model`` holds its weights, as plain data for reports: ``mode`` (as loaded: ``native`` or
    ``dequantized``); ``native``: checkpoint name -> block format of each weight kept in its blocks
    (a fused group's parts by their own names); ``formats``: how many of each; ``dequantized``:
    checkpoint name -> its type in the file, of each tensor held as floats (names and types from the
    loader's ``weight_types``: GGUF targets only); ``fallback``: those of them that were quantized in
    the file and are not a tied embedding, i.e. what ``native`` asked for and could not keep (a type
    with no native form here); ``native_projections``: how many weights (projections, an untied
    embedding) a native load of the file holds in their blocks (loaded native: ``native``'s; loaded
    dequantized: those it would, by :func:`would_keep`), where 0 means the two forms hold the same float
    weights; ``operand``: those of ``native`` held as the planes of ``quant_gluon``'s decode into the matrix
    unit's registers (an sm_90 GPU in bf16: ``hold_operands_``); ``native_bytes`` and ``weight_bytes`` (all
    stored weights)."""
    native: dict[str, str] = {}
    operand: dict[str, str] = {}
    native_bytes = 0
    for owner, module in model.named_modules():
        prefix = f"{owner}." if owner else ""
        for child_name, child in module.named_children():
            if isinstance(child, QuantEmbedding):
                native_bytes += child.nbytes
                native[f"{prefix}{child_name}.weight"] = child.fmt.name
            if not isinstance(child, QuantLinear):
                continue
            native_bytes += child.nbytes
            parts = module.FUSED[child_name] if isinstance(child, QuantFusedLinear) else (child_name,)
            for part in parts:
                native[f"{prefix}{part}.weight"] = child.fmt.name
                if child.operand is not None:
                    operand[f"{prefix}{part}.weight"] = child.fmt.name
    types: dict[str, str] = getattr(model, "weight_types", {})
    dequantized = {name: kind for name, kind in types.items() if name not in native}
    tied = shared_parameters(model)
    fallback = {name: kind for name, kind in dequantized.items()
                if mode == "native" and kind not in FLOAT_TYPES and not _tied_embedding(model, name, tied)}
    formats: dict[str, int] = {}
    for kind in native.values():
        formats[kind] = formats.get(kind, 0) + 1
    kept = len(native) if mode == "native" else len(would_keep(model, types))
    return {"mode": mode, "native": native, "formats": formats, "dequantized": dequantized, "fallback": fallback,
            "native_projections": kept, "operand": operand, "native_bytes": native_bytes,
            "weight_bytes": weight_bytes(model)}


def would_keep(model: nn.Module, types: dict[str, str]) -> dict[str, str]:
    """Of ``model``'s weights loaded as floats (``types``: checkpoint name -> its type in the file), those
    a native load would keep in their blocks (name -> format), as ``gguf_loading`` chooses them: a
    projection's weight (a linear layer's, or a part of a fused group) of a type with a native form
    here (``FORMATS``), and an untied embedding of such a type. A tied embedding, norms, conv and float or
    fallback types stay floats either way."""
    out = {}
    tied = shared_parameters(model)
    for name, kind in types.items():
        path = name.removesuffix(".weight")
        if kind in FORMATS and name.endswith(".weight") and (
                _is_projection(model, path) or keeps_embedding(_module_at(model, path), FORMATS[kind], tied)):
            out[name] = kind
    return out


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _tied_embedding(model: nn.Module, name: str, tied: set[int]) -> bool:
    """Whether checkpoint name ``name`` is the weight of an embedding another module shares (``tied``): a float
    by design, never a fallback."""
    embed = _module_at(model, name.removesuffix(".weight"))
    return isinstance(embed, nn.Embedding) and id(embed.weight) in tied


def _is_projection(model: nn.Module, path: str) -> bool:
    """Whether ``path`` names a linear projection of ``model``: an ``nn.Linear`` there, or a part of a
    fused group its owner has stacked (``FUSED``: after ``fuse_projections_`` the part has no module)."""
    owner, _, attr = path.rpartition(".")
    try:
        parent = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    if attr in parent._modules:
        return isinstance(parent._modules[attr], nn.Linear)
    return any(attr in parts and group in parent._modules for group, parts in getattr(parent, "FUSED", {}).items())
