"""The gated delta rule over a token tree: one pass over the nodes, each starting from its parent.

A chain (prefill, an AR step, a chain verify, a replay) is the tree whose node i has parent i-1.
Per value head, with S [dk, dv] in float32:

    S = S_parent * exp(g);  delta = beta * (v - S^T k);  S = S + k delta^T;  o = S^T q

Two backends compute the same function:

- ``torch``: a loop over the nodes with the parent picked on the device (no host read, so CUDA
  graphs can capture it); the CPU path, and the reference the kernel is tested against.
- ``triton``: one launch for all nodes. Each program owns one value head and a block of value
  columns (the rule is independent per column of S), keeps its state block in registers while the
  next node is its child, and otherwise reloads the parent's captured state. Every load (the next
  node's inputs, and the state it starts from when that is not the current node's) is issued a
  node ahead, so only the arithmetic is a chain from node to node.

Tree forwards (``node_states`` given) leave the committed state alone and write every node's
state, which ``fast`` rollback takes the accepted node's state from. Committing forwards
(``node_states=None``) advance ``state`` in place to the last node's state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.models import fused

try:  # the CUDA kernel; CPU-only installs run the torch loop
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on installs without Triton
    triton = None

BACKENDS = ("auto", "torch", "triton")


def tree_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor, state: Tensor,
                    node_states: Tensor | None = None, backend: str = "auto") -> Tensor:
    """The gated delta rule over T nodes in topological order (parents[i] < i).

    q, k: [T, HK, DK] float32 (q scaled by 1/sqrt(DK), both L2-normalised), shared by the
    HV / HK value heads of their group; v: [T, HV, DV] float32; g (log decay), beta: [T, HV]
    float32; parents: [T] long, -1 for a node that continues the committed ``state`` [HV, DK, DV]
    float32. ``node_states`` [T, HV, DK, DV] float32 receives each node's state (a tree
    forward; ``state`` is only read); without it the nodes must form a chain and ``state``
    ends as the last node's state. Returns o: [T, HV, DV] float32.

    ``backend``: ``auto`` is Triton for CUDA tensors (when installed and not turned off with
    ``fused.set_kernels(False)``) and torch otherwise.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, but got {backend!r}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if (hv % hk or state.shape != (hv, dk, dv) or k.shape != q.shape or v.shape[0] != t
            or g.shape != (t, hv) or beta.shape != (t, hv)):
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)}")
    if node_states is not None and node_states.shape != (t, hv, dk, dv):
        raise ValueError(f"node_states must be {(t, hv, dk, dv)}, but got {tuple(node_states.shape)}")
    if backend == "auto":
        backend = "triton" if q.is_cuda and fused.kernels_enabled() else "torch"
    if backend == "triton":
        if triton is None:
            raise RuntimeError("backend='triton' needs the triton package")
        return _triton_tree_delta_rule(q, k, v, g, beta, parents, state, node_states)
    return _torch_tree_delta_rule(q, k, v, g, beta, parents, state, node_states)


def delta_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """One node, all heads: state [H, dk, dv]; q, k [H, dk]; v [H, dv]; g, beta [H].
    Returns (the node's state, its output [H, dv])."""
    state = state * g.exp()[:, None, None]
    delta = (v - (state * k[:, :, None]).sum(1)) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, (state * q[:, :, None]).sum(1)


def _torch_tree_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor,
                           state: Tensor, node_states: Tensor | None) -> Tensor:
    t, hk = q.shape[0], q.shape[1]
    rep = v.shape[1] // hk
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    out = v.new_empty(v.shape)
    if node_states is None:  # a chain: the running state is the parent's
        s = state
        for i in range(t):
            s, out[i] = delta_step(s, q[i], k[i], v[i], g[i], beta[i])
        state.copy_(s)
        return out
    # Row 0 is the committed state, row i + 1 node i's: the parent's row is parents[i] + 1, picked
    # on the device so that no step reads the tree's shape back to the host.
    rows = torch.cat([state[None], node_states], dim=0) if t else state[None]
    for i in range(t):
        prev = rows.index_select(0, parents[i : i + 1] + 1)[0]
        rows[i + 1], out[i] = delta_step(prev, q[i], k[i], v[i], g[i], beta[i])
    node_states.copy_(rows[1:])
    return out


def _triton_tree_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor,
                            state: Tensor, node_states: Tensor | None) -> Tensor:
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    parents = parents.to(torch.int32).contiguous()
    if not state.is_contiguous():
        raise ValueError("state must be contiguous (it is updated in place)")
    out = torch.empty_like(v)
    if t == 0:  # no node: nothing to compute, the state stays (the kernel assumes a node 0)
        return out
    block_k, block_v, num_warps = kernel_config(dk, dv)
    store = node_states is not None
    if store and not node_states.is_contiguous():
        raise ValueError("node_states must be contiguous")
    grid = (triton.cdiv(dv, block_v), hv)
    _tree_delta_kernel[grid](
        q, k, v, g, beta, parents, state, node_states if store else state, out, t, int(store),
        HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
    )
    return out


def kernel_config(dk: int, dv: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps) of the kernel: a [BLOCK_K, BLOCK_V] float32 block of S per
    program stays in registers (2048 values: 32 a thread with 2 warps). Measured on an H200 at the
    27B shape's heads (dk = dv = 128, ``benchmarks/kernel_bench.py delta``): 16 columns and 2 warps
    walk a budget-32 tree in 42 us against 59-62 us with 32 columns and 4 warps, and 8 warps or
    wider blocks are slower still (the per-node chain is latency, not bandwidth)."""
    block_k = triton.next_power_of_2(dk)
    return block_k, min(triton.next_power_of_2(dv), max(16, 2048 // block_k)), 2


if triton is not None:

    # Not specialised on T or store_nodes: Triton would compile T == 1 (an AR step) and
    # store_nodes == 1 (a tree) as variants of their own, whose arithmetic need not round alike.
    @triton.jit(do_not_specialize=["T", "store_nodes"])
    def _tree_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, parents_ptr, state_ptr, nodes_ptr, out_ptr,
                           T, store_nodes, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        # store_nodes is a runtime flag, not a constexpr: tree and chain forwards run one compiled
        # kernel, so a node's arithmetic is bit-identical whichever kind of forward computes it
        # (speculative decoding must commit exactly the AR tokens).
        col_block = tl.program_id(0)
        head = tl.program_id(1)
        key_head = head // (HV // HK)
        rk = tl.arange(0, BLOCK_K)
        rv = col_block * BLOCK_V + tl.arange(0, BLOCK_V)
        mk, mv = rk < DK, rv < DV
        m2 = mk[:, None] & mv[None, :]
        head_offs = head * DK * DV + rk[:, None] * DV + rv[None, :]  # this block of S in a [HV, DK, DV] tensor
        s = tl.load(state_ptr + head_offs, mask=m2, other=0.0)
        # Software pipelining: node i + 1's inputs are loaded before node i's update, so that their
        # latency hides behind it (the updates are a chain from node to node, the loads are not).
        # The arithmetic is the same whatever the order of the loads.
        # (The wrapper launches no kernel for T == 0, so node 0 exists.)
        kk = tl.load(k_ptr + key_head * DK + rk, mask=mk, other=0.0)
        qq = tl.load(q_ptr + key_head * DK + rk, mask=mk, other=0.0)
        vv = tl.load(v_ptr + head * DV + rv, mask=mv, other=0.0)
        g = tl.load(g_ptr + head)
        b = tl.load(beta_ptr + head)
        parent = tl.load(parents_ptr)  # -1: node 0 starts from the committed state, s
        s_ahead = s
        for i in range(0, T):
            n = (i + 1) % T  # after the last node: node 0 again, loaded and never used
            kk_next = tl.load(k_ptr + (n * HK + key_head) * DK + rk, mask=mk, other=0.0)
            qq_next = tl.load(q_ptr + (n * HK + key_head) * DK + rk, mask=mk, other=0.0)
            vv_next = tl.load(v_ptr + (n * HV + head) * DV + rv, mask=mv, other=0.0)
            g_next = tl.load(g_ptr + n * HV + head)
            b_next = tl.load(beta_ptr + n * HV + head)
            parent_next = tl.load(parents_ptr + n)
            if store_nodes != 0:
                if parent != i - 1:  # not the node just computed: the state loaded a node ahead
                    s = s_ahead
                if parent_next != i:
                    # Node i + 1 starts from a state already in memory (the committed one, or an
                    # earlier node's, stored before a barrier): load it now, used a node later.
                    if parent_next < 0:
                        s_ahead = tl.load(state_ptr + head_offs, mask=m2, other=0.0)
                    else:
                        s_ahead = tl.load(nodes_ptr + parent_next * HV * DK * DV + head_offs, mask=m2, other=0.0)
            s = s * tl.exp(g)
            delta = (vv - tl.sum(s * kk[:, None], axis=0)) * b
            s = s + kk[:, None] * delta[None, :]
            tl.store(out_ptr + (i * HV + head) * DV + rv, tl.sum(s * qq[:, None], axis=0), mask=mv)
            if store_nodes != 0:
                tl.store(nodes_ptr + i * HV * DK * DV + head_offs, s, mask=m2)
                tl.debug_barrier()  # a later child reloads this state
            kk, qq, vv, g, b, parent = kk_next, qq_next, vv_next, g_next, b_next, parent_next
        if store_nodes == 0:
            tl.store(state_ptr + head_offs, s, mask=m2)
