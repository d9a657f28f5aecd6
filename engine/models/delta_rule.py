"""The gated delta rule over a token tree: every node starts from its parent's state.

A chain (prefill, an AR step, a chain verify, a replay) is the tree whose node i has parent i-1.
Per value head, with S [dk, dv] in float32:

    S = S_parent * exp(g);  delta = beta * (v - S^T k);  S = S + k delta^T;  o = S^T q

Two backends compute the same function:

- ``torch``: a loop over the nodes with the parent picked on the device (no host read, so CUDA
  graphs can capture it); the CPU path, and the reference the kernel is tested against.
- ``triton``: one launch. Each program owns one value head and a block of value columns (the rule
  is independent per column of S) and walks a chain of nodes with its state block in registers,
  each node's inputs loaded a node ahead (a gathered walk's node indices two), so only the arithmetic
  is a chain from node to node.

A tree forward (``tree=True``) leaves the committed state alone and runs one program per leaf
(``LeafPaths``): each walks its root-to-leaf path from the committed state and writes the outputs
of the nodes on it. A node shared by several paths is computed by each of them, with the same
inputs and the same arithmetic, so every copy writes the same bits. The chain of dependent updates
is then as long as the tree is deep (16 nodes for a block of 16) instead of as long as it is big
(33 at budget 32), and no node's state is stored: walking the nodes in one program, a branch had to
reload a stored state (3 MB a layer at the 27B shape) behind a barrier, and the walk cost about
0.85 us a node. ``fast`` rollback then recomputes the accepted path's states from the committed state
and the nodes' inputs (``delta_rule_path``: every layer in one launch), with the kernel the tree
forward ran, so the committed state has the tree forward's bits. Committing forwards (``tree=False``)
advance ``state`` in place to the last node's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.models import fused
from engine.models.attention import ancestor_table

try:  # the CUDA kernel; CPU-only installs run the torch loop
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on installs without Triton
    triton = None

BACKENDS = ("auto", "torch", "triton")


def _backend(backend: str, x: Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, but got {backend!r}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and fused.kernels_enabled() else "torch"
    if backend == "triton" and triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    return backend


def kernel_runs(x: Tensor) -> bool:
    """Whether ``backend="auto"`` takes the Triton kernel for tensors like ``x`` (the only backend
    that reads ``LeafPaths``: a caller makes them once a forward only then)."""
    return _backend("auto", x) == "triton"


@dataclass(frozen=True)
class LeafPaths:
    """A tree's root-to-leaf paths, as the kernel's tree forward walks them; made once a forward
    (``leaf_paths``) and read by every layer.

    index: [T, W] int32, row i the nodes on node i's path by depth, root first (``StepKeys.ancestors``:
        ``index[i, depth(i)] == i``); counts: [T] int32, depth + 1 for a leaf (a node no other node
        starts from), 0 for the others (their program does nothing)."""

    index: Tensor
    counts: Tensor


def leaf_paths(parents: Tensor, ancestors: Tensor | None = None, depths: Tensor | None = None) -> LeafPaths:
    """The ``LeafPaths`` of the tree ``parents`` [T] (-1: a node that continues the committed state),
    on the device and without a host read (CUDA graphs capture it). ``ancestors`` [T, W] and ``depths``
    [T] (a decode step's ``StepKeys`` has them) are used as given; otherwise they are made from the
    parents (``ancestor_rows``)."""
    t = parents.numel()
    if ancestors is None or depths is None:
        ancestors, depths = ancestor_rows(parents)
    # A node is a leaf when no node names it as its parent (slot 0 takes the -1s).
    has_child = torch.zeros(t + 1, dtype=torch.int32, device=parents.device)
    has_child.index_fill_(0, parents.long() + 1, 1)
    counts = torch.where(has_child[1:] == 0, depths.to(torch.int32) + 1, 0).to(torch.int32)
    return LeafPaths(ancestors.to(torch.int32).contiguous(), counts)


def ancestor_rows(parents: Tensor) -> tuple[Tensor, Tensor]:
    """([T, T] int32 ancestors by depth as ``StepKeys.ancestors`` holds them, [T] int32 depths) of
    the tree ``parents``: the ancestor-or-self relation by repeated squaring (log2 T products of a
    [T, T] matrix: tensor ops, no host read). For forwards that bring no step layout (the generic
    loop's tree verify); a decode step's layout has both tables already."""
    t, dev = parents.numel(), parents.device
    nodes = torch.arange(t, device=dev)
    reach = torch.zeros(t, t, dtype=torch.float32, device=dev)
    reach[nodes, nodes] = 1.0
    reach.index_put_((nodes, parents.long().clamp(min=0)), (parents >= 0).float(), accumulate=True)
    for _ in range(max(1, (t - 1).bit_length())):  # paths of up to 2**i edges after i squarings
        reach = (reach @ reach).clamp_(max=1.0)
    mask = reach > 0
    depths = (mask.sum(1) - 1).to(torch.int32)
    return ancestor_table(mask, depths, t), depths


def tree_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor, state: Tensor,
                    tree: bool = False, paths: LeafPaths | None = None, backend: str = "auto") -> Tensor:
    """The gated delta rule over T nodes in topological order (parents[i] < i).

    q, k: [T, HK, DK] float32 (q scaled by 1/sqrt(DK), both L2-normalised), shared by the
    HV / HK value heads of their group; v: [T, HV, DV] float32; g (log decay), beta: [T, HV]
    float32; parents: [T] long or int32, -1 for a node that continues the committed ``state``
    [HV, DK, DV] float32. ``tree=True`` (a tree forward): ``state`` is only read (``paths``: the
    tree's ``leaf_paths``, made here when not given); otherwise the nodes must form a chain and
    ``state`` ends as the last node's state. Returns o: [T, HV, DV] float32.

    ``backend``: ``auto`` is Triton for CUDA tensors (when installed and not turned off with
    ``fused.set_kernels(False)``) and torch otherwise.
    """
    backend = _backend(backend, q)
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if (hv % hk or state.shape != (hv, dk, dv) or k.shape != q.shape or v.shape[0] != t
            or g.shape != (t, hv) or beta.shape != (t, hv) or parents.shape != (t,)):
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, parents {tuple(parents.shape)}, "
                         f"state {tuple(state.shape)}")
    if paths is not None and (paths.counts.shape != (t,) or paths.index.dim() != 2 or paths.index.shape[0] != t):
        raise ValueError(f"paths must hold [{t}, W] rows and [{t}] counts, but got {tuple(paths.index.shape)} "
                         f"and {tuple(paths.counts.shape)}")
    if backend == "triton":
        return _triton_tree_delta_rule(q, k, v, g, beta, parents, state, tree, paths)
    return _torch_tree_delta_rule(q, k, v, g, beta, parents, state, tree)


def delta_rule_path(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, path: Tensor, length: Tensor,
                    state: Tensor, backend: str = "auto") -> None:
    """Advance the committed ``state`` [L, HV, DK, DV] float32 of L layers in place along the nodes
    ``path[:length]`` (root first) of their last tree forward, all layers in one launch on CUDA.

    q, k: [L, T, HK, DK], v: [L, T, HV, DV], g, beta: [L, T, HV]: each layer's per-node inputs of that
    forward (as ``tree_delta_rule`` takes them); path: [P] long node indices (entries past
    ``length`` ignored); length: [1] long, 1 <= length <= P, read on the device. The result is, bit
    for bit, the state the tree forward computed at node ``path[length - 1]``: the same kernel (or the
    same torch step) runs the same arithmetic node by node."""
    backend = _backend(backend, q)
    n_layers, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if (k.shape != q.shape or v.shape[:2] != (n_layers, t) or g.shape != (n_layers, t, hv)
            or beta.shape != g.shape or state.shape != (n_layers, hv, dk, dv) or hv % hk):
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)}")
    if backend == "triton":
        _triton_delta_rule_path(q, k, v, g, beta, path, length, state)
        return
    rep = hv // hk
    # On the host the length is known: only its nodes. On a device, every entry of the path with the
    # state kept past ``length`` (no host read: CUDA graphs capture this too).
    steps = int(length.reshape(-1)[0]) if not length.is_cuda else path.numel()
    for layer in range(n_layers):
        qs, ks = q[layer].repeat_interleave(rep, 1), k[layer].repeat_interleave(rep, 1)
        s = state[layer]
        for i in range(steps):
            n = path[i : i + 1]
            nxt, _ = delta_step(s, qs.index_select(0, n)[0], ks.index_select(0, n)[0], v[layer].index_select(0, n)[0],
                                g[layer].index_select(0, n)[0], beta[layer].index_select(0, n)[0])
            s = nxt if not length.is_cuda else torch.where(i < length, nxt, s)
        state[layer].copy_(s)


def delta_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """One node, all heads: state [H, dk, dv]; q, k [H, dk]; v [H, dv]; g, beta [H].
    Returns (the node's state, its output [H, dv])."""
    state = state * g.exp()[:, None, None]
    delta = (v - (state * k[:, :, None]).sum(1)) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, (state * q[:, :, None]).sum(1)


def _torch_tree_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor,
                           state: Tensor, tree: bool) -> Tensor:
    t, hk = q.shape[0], q.shape[1]
    rep = v.shape[1] // hk
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    out = v.new_empty(v.shape)
    if not tree:  # a chain: the running state is the parent's
        s = state
        for i in range(t):
            s, out[i] = delta_step(s, q[i], k[i], v[i], g[i], beta[i])
        state.copy_(s)
        return out
    # Row 0 is the committed state, row i + 1 node i's: the parent's row is parents[i] + 1, picked
    # on the device so that no step reads the tree's shape back to the host.
    rows = torch.cat([state[None], state.new_empty(t, *state.shape)], dim=0)
    for i in range(t):
        prev = rows.index_select(0, parents[i : i + 1].long() + 1)[0]
        rows[i + 1], out[i] = delta_step(prev, q[i], k[i], v[i], g[i], beta[i])
    return out


def _triton_tree_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor,
                            state: Tensor, tree: bool, paths: LeafPaths | None) -> Tensor:
    t = q.shape[0]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if not state.is_contiguous():
        raise ValueError("state must be contiguous (it is updated in place)")
    out = torch.empty_like(v)
    if t == 0:  # no node: nothing to compute, the state stays (the kernel assumes a node 0)
        return out
    if tree:
        paths = leaf_paths(parents) if paths is None else paths
        index, counts = paths.index.to(torch.int32).contiguous(), paths.counts.to(torch.int32).contiguous()
        _launch(q, k, v, g, beta, index, counts, state, out, t, gather=True, commit=False, programs=t,
                layer_nodes=0, index_stride=index.shape[1])
    else:  # (the index is not read: any int32 tensor)
        index = parents.to(torch.int32)
        _launch(q, k, v, g, beta, index, index, state, out, t, gather=False, commit=True, programs=1,
                layer_nodes=0, index_stride=0)
    return out


def _triton_delta_rule_path(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, path: Tensor,
                            length: Tensor, state: Tensor) -> None:
    if not all(x.is_contiguous() for x in (q, k, v, g, beta, state)):
        raise ValueError("delta_rule_path needs contiguous inputs and state (views of the cache's buffers)")
    n_layers, t = q.shape[:2]
    # The path's entries are node indices into each layer's inputs; the kernel reads ``length`` of
    # them. Every integer pointer int32, as a tree forward passes them: a pointer's element type is
    # part of a compiled variant, and the path must run the tree forward's.
    path, length = path.to(torch.int32).contiguous(), length.to(torch.int32).reshape(1)
    _launch(q, k, v, g, beta, path, length, state, q, t, gather=True, commit=True, programs=n_layers,
            layer_nodes=t, index_stride=0)


def _launch(q, k, v, g, beta, index, counts, state, out, t: int, gather: bool, commit: bool, programs: int,
            layer_nodes: int, index_stride: int) -> None:
    hk, dk = q.shape[-2], q.shape[-1]
    hv, dv = v.shape[-2], v.shape[-1]
    block_k, block_v, num_warps = kernel_config(dk, dv)
    grid = (triton.cdiv(dv, block_v), hv, programs)
    _tree_delta_kernel[grid](
        q, k, v, g, beta, index, counts, state, out, t, int(gather), int(commit), layer_nodes, index_stride,
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
    )


def kernel_config(dk: int, dv: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps) of the kernel: a [BLOCK_K, BLOCK_V] float32 block of S per
    program stays in registers (2048 values: 32 a thread with 2 warps). Measured on an H200 at the
    27B shape's heads (dk = dv = 128, ``benchmarks/kernel_bench.py delta``, 2026-12-02, one program
    walking a whole budget-32 tree): 16 columns on 2 warps took 32 us; one warp 31 us, but that spills
    1,120 bytes a thread (``benchmarks/kernel_check.py``); 8 or 32 columns on 2 warps 49 and 34 us (the
    per-node chain is latency, not bandwidth)."""
    block_k = triton.next_power_of_2(dk)
    return block_k, min(triton.next_power_of_2(dv), max(16, 2048 // block_k)), 2


if triton is not None:

    # Not specialised on T, the flags, the strides: Triton would compile T == 1 (an AR step), a tree
    # forward or a path commit as variants of their own, whose arithmetic need not round alike.
    @triton.jit(do_not_specialize=["T", "gather", "commit", "layer_nodes", "index_stride"])
    def _tree_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, index_ptr, count_ptr, state_ptr, out_ptr,
                           T, gather, commit, layer_nodes, index_stride,
                           HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        # gather, commit are runtime flags, not constexprs: chain, tree and path forwards run one
        # compiled kernel, so a node's arithmetic is bit-identical whichever kind of forward computes
        # it (speculative decoding must commit exactly the AR tokens). Every program walks a chain
        # of nodes from ``state_ptr``'s state:
        #   chain (commit): nodes 0..T-1; outputs written; state_ptr ends as the last node's state.
        #   tree (gather, not commit): program_id(2) is a node; a leaf's program walks the nodes
        #     index_ptr[node * index_stride : + count_ptr[node]] (its path, root first) and writes
        #     their outputs at their node rows; a node that is not a leaf has count 0 (nothing).
        #   path (gather, commit): program_id(2) is a layer (layer_nodes node rows of inputs a layer);
        #     the chain over index_ptr[0 .. count_ptr[0] - 1]; outputs not written; state_ptr ends as
        #     the path's last node's state.
        # Layer offsets in whole rows (constexpr multiples): the compiler keeps the pointers' alignment,
        # and the loads their width.
        col_block = tl.program_id(0)
        head = tl.program_id(1)
        z = tl.program_id(2).to(tl.int64)
        q_ptr += z * layer_nodes * (HK * DK)
        k_ptr += z * layer_nodes * (HK * DK)
        v_ptr += z * layer_nodes * (HV * DV)
        g_ptr += z * layer_nodes * HV
        beta_ptr += z * layer_nodes * HV
        if commit != 0:  # a path commit's layer (z = 0 in a chain)
            state_ptr += z * (HV * DK * DV)
        else:  # a tree's node: its path's row and length
            index_ptr += z * index_stride
            count_ptr += z
        if gather != 0:
            T = tl.load(count_ptr)
        if T > 0:
            key_head = head // (HV // HK)
            rk = tl.arange(0, BLOCK_K)
            rv = col_block * BLOCK_V + tl.arange(0, BLOCK_V)
            mk, mv = rk < DK, rv < DV
            m2 = mk[:, None] & mv[None, :]
            head_offs = head * DK * DV + rk[:, None] * DV + rv[None, :]  # this block of S in a [HV, DK, DV] tensor
            s = tl.load(state_ptr + head_offs, mask=m2, other=0.0)
            # Software pipelining: node i + 1's inputs are loaded before node i's update, so that
            # their latency hides behind it (the updates are a chain from node to node, the loads
            # are not). The arithmetic is the same whatever the order of the loads. A gathered walk reads
            # its node indices two nodes ahead, so node i + 1's inputs are asked for from an index already
            # in a register (read one ahead, the loop first waited for the index's load, every node).
            src = 0  # the first node's inputs
            src_ahead = 1 % T  # the second node's index
            if gather != 0:
                src = tl.load(index_ptr)
                src_ahead = tl.load(index_ptr + 1 % T)
            kk = tl.load(k_ptr + (src * HK + key_head) * DK + rk, mask=mk, other=0.0)
            qq = tl.load(q_ptr + (src * HK + key_head) * DK + rk, mask=mk, other=0.0)
            vv = tl.load(v_ptr + (src * HV + head) * DV + rv, mask=mv, other=0.0)
            g = tl.load(g_ptr + src * HV + head)
            b = tl.load(beta_ptr + src * HV + head)
            for i in range(0, T):
                src_next = src_ahead  # after the last node: the first again, loaded and never used
                src_ahead = tl.where(i + 2 < T, i + 2, 0)  # past the last node: the first (no division)
                if gather != 0:
                    src_ahead = tl.load(index_ptr + src_ahead)
                kk_next = tl.load(k_ptr + (src_next * HK + key_head) * DK + rk, mask=mk, other=0.0)
                qq_next = tl.load(q_ptr + (src_next * HK + key_head) * DK + rk, mask=mk, other=0.0)
                vv_next = tl.load(v_ptr + (src_next * HV + head) * DV + rv, mask=mv, other=0.0)
                g_next = tl.load(g_ptr + src_next * HV + head)
                b_next = tl.load(beta_ptr + src_next * HV + head)
                s = s * tl.exp(g)
                delta = (vv - tl.sum(s * kk[:, None], axis=0)) * b
                s = s + kk[:, None] * delta[None, :]
                if gather == 0 or commit == 0:
                    tl.store(out_ptr + (src * HV + head) * DV + rv, tl.sum(s * qq[:, None], axis=0), mask=mv)
                kk, qq, vv, g, b, src = kk_next, qq_next, vv_next, g_next, b_next, src_next
            if commit != 0:
                tl.store(state_ptr + head_offs, s, mask=m2)
