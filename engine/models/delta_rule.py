"""The gated delta rule over a token tree: one pass over the nodes, each starting from its parent.

A chain (prefill, an AR step, a chain verify, a replay) is the tree whose node i has parent i-1.
Per value head, with S [dk, dv] in float32:

    S = S_parent * exp(g);  delta = beta * (v - S^T k);  S = S + k delta^T;  o = S^T q

Two backends compute the same function:

- ``torch``: a loop over the nodes with the parent picked on the device (no host read, so CUDA
  graphs can capture it); the CPU path, and the reference the kernel is tested against.
- ``triton``: one launch for all nodes. Each program owns one value head and a block of value
  columns (the rule is independent per column of S), keeps its state block in registers while the
  next node is its child, and otherwise reloads the parent's stored state. Every load (the next
  node's inputs, and the state it starts from when that is not the current node's) is issued a
  node ahead, so only the arithmetic is a chain from node to node.

Tree forwards (``node_states`` given) leave the committed state alone. They store a node's state
only where a later node other than the next one restarts from it (``restart_flags``): at the 27B
shape a state is 3 MB a layer, and storing all 33 nodes of a budget-32 tree wrote 5 GB a verify.
``fast`` rollback then recomputes the accepted path's states from the committed state and the
nodes' inputs (``delta_rule_path``: every layer in one launch), with the kernel the tree forward
ran, so the committed state has the tree forward's bits. Committing forwards (``node_states=None``)
advance ``state`` in place to the last node's state.
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


def _backend(backend: str, x: Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, but got {backend!r}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and fused.kernels_enabled() else "torch"
    if backend == "triton" and triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    return backend


def restart_flags(parents: Tensor) -> Tensor:
    """[T] int32: 1 for a node that a later node other than the next one starts from (its state must
    be stored for that node to reload), else 0. Made once per forward and read by every layer."""
    t = parents.numel()
    nodes = torch.arange(t, device=parents.device)
    jumps = (parents >= 0) & (parents != nodes - 1)
    flags = torch.zeros(t, dtype=torch.int32, device=parents.device)
    return flags.index_put_((parents.clamp(min=0),), jumps.to(torch.int32), accumulate=True).clamp_(max=1)


def tree_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor, state: Tensor,
                    node_states: Tensor | None = None, backend: str = "auto", restarts: Tensor | None = None
                    ) -> Tensor:
    """The gated delta rule over T nodes in topological order (parents[i] < i).

    q, k: [T, HK, DK] float32 (q scaled by 1/sqrt(DK), both L2-normalised), shared by the
    HV / HK value heads of their group; v: [T, HV, DV] float32; g (log decay), beta: [T, HV]
    float32; parents: [T] long, -1 for a node that continues the committed ``state`` [HV, DK, DV]
    float32. With ``node_states`` [T, HV, DK, DV] float32 (a tree forward) ``state`` is only read and
    the states later nodes restart from are stored there (``restarts``: ``restart_flags(parents)``,
    made here when not given; the rows of other nodes are scratch, the torch backend fills every
    row); without it the nodes must form a chain and ``state`` ends as the last node's state.
    Returns o: [T, HV, DV] float32.

    ``backend``: ``auto`` is Triton for CUDA tensors (when installed and not turned off with
    ``fused.set_kernels(False)``) and torch otherwise.
    """
    backend = _backend(backend, q)
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if (hv % hk or state.shape != (hv, dk, dv) or k.shape != q.shape or v.shape[0] != t
            or g.shape != (t, hv) or beta.shape != (t, hv)):
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)}")
    if node_states is not None and node_states.shape != (t, hv, dk, dv):
        raise ValueError(f"node_states must be {(t, hv, dk, dv)}, but got {tuple(node_states.shape)}")
    if restarts is not None and restarts.shape != (t,):
        raise ValueError(f"restarts must be [{t}], but got {tuple(restarts.shape)}")
    if backend == "triton":
        return _triton_tree_delta_rule(q, k, v, g, beta, parents, state, node_states, restarts)
    return _torch_tree_delta_rule(q, k, v, g, beta, parents, state, node_states)


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
                            state: Tensor, node_states: Tensor | None, restarts: Tensor | None) -> Tensor:
    t = q.shape[0]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    parents = parents.to(torch.int32).contiguous()
    if not state.is_contiguous():
        raise ValueError("state must be contiguous (it is updated in place)")
    out = torch.empty_like(v)
    if t == 0:  # no node: nothing to compute, the state stays (the kernel assumes a node 0)
        return out
    store = node_states is not None
    if store:
        if not node_states.is_contiguous():
            raise ValueError("node_states must be contiguous")
        restarts = restart_flags(parents) if restarts is None else restarts.to(torch.int32).contiguous()
    else:
        restarts = parents  # not read
    _launch(q, k, v, g, beta, parents, parents, parents, state, node_states if store else state, restarts, out,
            t, gather=False, store=store, layers=1, layer_nodes=0)
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
    _launch(q, k, v, g, beta, path, path, length, state, state, path, q, t, gather=True, store=False,
            layers=n_layers, layer_nodes=t)


def _launch(q, k, v, g, beta, parents, index, count, state, nodes, restarts, out, t: int, gather: bool,
            store: bool, layers: int, layer_nodes: int) -> None:
    hk, dk = q.shape[-2], q.shape[-1]
    hv, dv = v.shape[-2], v.shape[-1]
    block_k, block_v, num_warps = kernel_config(dk, dv)
    grid = (triton.cdiv(dv, block_v), hv, layers)
    _tree_delta_kernel[grid](
        q, k, v, g, beta, parents, index, count, state, nodes, restarts, out, t, int(gather), int(store),
        layer_nodes, HK=hk, HV=hv, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
    )


def kernel_config(dk: int, dv: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps) of the kernel: a [BLOCK_K, BLOCK_V] float32 block of S per
    program stays in registers (2048 values: 32 a thread with 2 warps). Measured on an H200 at the
    27B shape's heads (dk = dv = 128, ``benchmarks/kernel_bench.py delta``, 2026-12-02): 16 columns on
    2 warps walk a budget-32 tree in 32 us; on one warp in 31 us, but that spills 1,120 bytes a thread
    (``benchmarks/kernel_check.py``); 8 or 32 columns on 2 warps take 49 and 34 us (the per-node chain
    is latency, not bandwidth)."""
    block_k = triton.next_power_of_2(dk)
    return block_k, min(triton.next_power_of_2(dv), max(16, 2048 // block_k)), 2


if triton is not None:

    # Not specialised on T, the flags or the layer strides: Triton would compile T == 1 (an AR step),
    # a tree (store_nodes) or a path commit (gather) as variants of their own, whose arithmetic need
    # not round alike.
    @triton.jit(do_not_specialize=["T", "gather", "store_nodes", "layer_nodes"])
    def _tree_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, parents_ptr, index_ptr, count_ptr, state_ptr,
                           nodes_ptr, restart_ptr, out_ptr, T, gather, store_nodes, layer_nodes,
                           HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        # gather, store_nodes are runtime flags, not constexprs: tree, chain and path forwards run one
        # compiled kernel, so a node's arithmetic is bit-identical whichever kind of forward computes
        # it (speculative decoding must commit exactly the AR tokens).
        #   tree (store_nodes): node i starts from node parents[i]'s state; the states later nodes
        #     restart from (restart_ptr) are stored in nodes_ptr; state_ptr is only read.
        #   chain: node i starts from node i - 1's; state_ptr ends as the last node's state.
        #   path (gather): a chain over the nodes index_ptr[0..count-1] of one tree forward's inputs
        #     (count read from count_ptr), one layer a program_id(2) (layer_nodes node rows of inputs
        #     a layer), outputs not written.
        # Layer offsets in whole rows (constexpr multiples): the compiler keeps the pointers' alignment,
        # and the loads their width.
        col_block = tl.program_id(0)
        head = tl.program_id(1)
        layer = tl.program_id(2).to(tl.int64)
        q_ptr += layer * layer_nodes * (HK * DK)
        k_ptr += layer * layer_nodes * (HK * DK)
        v_ptr += layer * layer_nodes * (HV * DV)
        g_ptr += layer * layer_nodes * HV
        beta_ptr += layer * layer_nodes * HV
        state_ptr += layer * (HV * DK * DV)
        if gather != 0:
            T = tl.load(count_ptr)
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
        # (The wrappers launch no kernel for T == 0, and a path has at least its root: node 0 exists.)
        src = 0  # node 0's inputs
        if gather != 0:
            src = tl.load(index_ptr)
        kk = tl.load(k_ptr + (src * HK + key_head) * DK + rk, mask=mk, other=0.0)
        qq = tl.load(q_ptr + (src * HK + key_head) * DK + rk, mask=mk, other=0.0)
        vv = tl.load(v_ptr + (src * HV + head) * DV + rv, mask=mv, other=0.0)
        g = tl.load(g_ptr + src * HV + head)
        b = tl.load(beta_ptr + src * HV + head)
        parent = tl.load(parents_ptr)  # -1: node 0 starts from the committed state, s
        restart = 0
        if store_nodes != 0:
            restart = tl.load(restart_ptr)
        s_ahead = s
        for i in range(0, T):
            n = (i + 1) % T  # after the last node: node 0 again, loaded and never used
            src = n
            if gather != 0:
                src = tl.load(index_ptr + n)
            kk_next = tl.load(k_ptr + (src * HK + key_head) * DK + rk, mask=mk, other=0.0)
            qq_next = tl.load(q_ptr + (src * HK + key_head) * DK + rk, mask=mk, other=0.0)
            vv_next = tl.load(v_ptr + (src * HV + head) * DV + rv, mask=mv, other=0.0)
            g_next = tl.load(g_ptr + src * HV + head)
            b_next = tl.load(beta_ptr + src * HV + head)
            parent_next = tl.load(parents_ptr + n)
            restart_next = 0
            if store_nodes != 0:
                restart_next = tl.load(restart_ptr + n)
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
            if gather == 0:
                tl.store(out_ptr + (i * HV + head) * DV + rv, tl.sum(s * qq[:, None], axis=0), mask=mv)
            if store_nodes != 0:
                if restart != 0:
                    tl.store(nodes_ptr + i * HV * DK * DV + head_offs, s, mask=m2)
                tl.debug_barrier()  # a later node reloads this state
            kk, qq, vv, g, b, parent, restart = kk_next, qq_next, vv_next, g_next, b_next, parent_next, restart_next
        if store_nodes == 0:
            tl.store(state_ptr + head_offs, s, mask=m2)
