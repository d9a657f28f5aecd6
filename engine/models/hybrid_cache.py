"""Qwen3.5's decode state: the attention layers' K/V (``KVCache``) and the Gated DeltaNet layers'
recurrent and conv state, with the per-node records a tree forward leaves and the commit that
rebuilds the accepted path's state from them (``fast`` rollback), or the snapshot a ``replay``
restores. The model is ``engine.models.hybrid``."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.models.delta_rule import delta_rule_path
from engine.models.dense import KVCache
from engine.models.hybrid_config import FULL, HybridConfig


class HybridCache(KVCache):
    """K/V of the attention layers (``KVCache``) plus Gated DeltaNet state per linear layer.

    rec: [gdn_layers, v_heads, dk, dv] float32 and conv: [gdn_layers, kernel-1, conv_dim], the state
    after ``length`` tokens. From the last tree forward: tree_inputs (q, k, v, g, beta, each
    [gdn_layers, nodes, ...] float32) hold every node's delta-rule inputs and tree_conv[:, i] node i's
    conv input; no node's recurrent state is kept (the commit recomputes the accepted path's from
    tree_inputs).
    """

    def __init__(self, cfg: HybridConfig, max_len: int, device: torch.device, dtype: torch.dtype,
                 max_tree: int = 0) -> None:
        n_attn = cfg.layer_types.count(FULL)
        n_gdn = cfg.num_hidden_layers - n_attn
        super().__init__(n_attn, max_len, cfg.num_key_value_heads, cfg.head_dim, device, dtype)
        self.kernel = cfg.linear_conv_kernel_dim
        shape = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.rec = torch.zeros(n_gdn, *shape, device=device, dtype=torch.float32)
        self.conv = torch.zeros(n_gdn, self.kernel - 1, cfg.conv_dim, device=device, dtype=dtype)
        self.conv_prev = torch.zeros_like(self.conv)  # the window before the last commit
        self.tree_conv = self.conv.new_zeros(n_gdn, 0, cfg.conv_dim)
        self._input_shapes = [(cfg.linear_num_key_heads, cfg.linear_key_head_dim)] * 2 + [
            (cfg.linear_num_value_heads, cfg.linear_value_head_dim), (cfg.linear_num_value_heads,),
            (cfg.linear_num_value_heads,)]
        self.tree_inputs = tuple(self.rec.new_zeros(n_gdn, 0, *shp) for shp in self._input_shapes)
        # With ``keep_previous`` a commit first keeps the state it replaces (a grammar may cut the
        # step after it: ``recommit_recurrent``); allocated on the first such commit. Set for a whole
        # generation after its prefill (``reset`` clears it), so that every commit of it keeps the
        # state: a captured commit replays without this object knowing, so it cannot track them.
        self.keep_previous = False
        self.rec_prev: Tensor | None = None
        self._tree: tuple[int, int] | None = None  # (start, size) of the tree forward commit_path may use
        # True when a step launched ahead (engine.decoding.runtime) left the state past ``length``: the
        # K/V past ``length`` are ignored, but a recurrent state cannot be taken back
        self.ahead = False
        self.reserve_tree(max_tree)

    def reserve_tree(self, nodes: int) -> None:
        """Grow the per-node buffers (a fixed budget allocates once; memory is per node, per layer).
        Growing replaces the tensors: captured CUDA graphs that used the old ones are stale."""
        if nodes <= self.tree_conv.shape[1]:
            return
        n_gdn = self.rec.shape[0]
        self.tree_conv = self.conv.new_zeros(n_gdn, nodes, self.conv.shape[-1])
        # Rows for a multiple of 4 nodes: every layer's g and beta then start 16-byte aligned, as
        # the path commit's do (the tree kernel compiles to the variant the path commit runs).
        rows = -(-nodes // 4) * 4
        self.tree_inputs = tuple(self.rec.new_zeros(n_gdn, rows, *shp) for shp in self._input_shapes)

    def begin(self, start: int, tree_size: int | None) -> None:
        """Called by the model before a forward: checks the recurrent state matches ``start``."""
        if start == 0:
            self.reset()  # a new sequence starts from zero recurrent state
        elif self.ahead:
            raise RuntimeError(f"the recurrent state was advanced past the {self.length} committed tokens (a "
                               "step launched ahead past a generation's end): only a new sequence can start here")
        elif start != self.length:
            raise RuntimeError(f"recurrent state holds {self.length} tokens; cannot run a forward at {start}")
        if tree_size is None:
            self._tree = None
        else:
            self.reserve_tree(tree_size)
            self._tree = (start, tree_size)

    def reset(self) -> None:
        super().reset()
        self.rec.zero_()
        self.conv.zero_()
        self._tree = None
        self.ahead = False
        self.keep_previous = False

    def commit_path(self, start: int, path: Tensor, al: int) -> None:
        """Fast rollback: KV compaction, then the recurrent state of node path[al-1] and the conv
        inputs along path[:al] (after the old committed ones) become the committed state."""
        al = int(al)
        if self._tree is None or self._tree[0] != start:
            raise RuntimeError(f"commit_path at {start} needs a tree forward at {start} first")
        if not 1 <= al <= self._tree[1]:
            raise RuntimeError(f"accepted length {al} outside 1..{self._tree[1]} (the tree's size)")
        path = path.to(self.rec.device)
        super().commit_path(start, path[:al], al)
        self.commit_recurrent(path, torch.tensor([al], device=path.device))
        self._tree = None

    def commit_recurrent(self, path: Tensor, al: Tensor) -> None:
        """The recurrent half of a fast commit, on the device: ``path`` [>= al] the accepted nodes
        root first (entries past ``al`` ignored), ``al`` [1] how many. The state becomes node
        path[al-1]'s, recomputed along the path from the recorded inputs (the bits the tree forward
        computed); the conv window becomes the last kernel-1 inputs along the path, reaching back
        into the old window when the path is shorter than that (kept for ``recommit_recurrent``)."""
        self.conv_prev.copy_(self.conv)
        if self.keep_previous:
            if self.rec_prev is None:
                self.rec_prev = torch.empty_like(self.rec)
            self.rec_prev.copy_(self.rec)
        self._commit_recurrent(path, al)

    def recommit_recurrent(self, path: Tensor, al: Tensor) -> None:
        """Commit a shorter prefix of the same tree instead (a grammar cut after the commit): the
        per-node records are still those of the last tree forward; the state replaced by the commit
        was kept (``keep_previous``)."""
        if not self.keep_previous or self.rec_prev is None:
            raise RuntimeError("recommit_recurrent needs the state the last commit replaced: set keep_previous "
                               "before the generation's first commit")
        self.conv.copy_(self.conv_prev)
        self.rec.copy_(self.rec_prev)
        self._commit_recurrent(path, al)

    def _commit_recurrent(self, path: Tensor, al: Tensor) -> None:
        w = self.kernel - 1
        j = al - w + torch.arange(w, device=path.device)  # path positions of the new window's slots
        from_tree = self.tree_conv.index_select(1, path.index_select(0, j.clamp(min=0)))
        from_old = self.conv.index_select(1, (j + w).clamp(0, w - 1))
        self.conv.copy_(torch.where((j >= 0)[None, :, None], from_tree, from_old))
        delta_rule_path(*self.tree_inputs, path, al, self.rec)

    def snapshot(self) -> object:
        return self.length, self.rec.clone(), self.conv.clone()

    def restore(self, snap: object) -> None:
        length, rec, conv = snap  # type: ignore[misc]
        self.length = int(length)
        self.rec.copy_(rec)
        self.conv.copy_(conv)
        self._tree = None
        self.ahead = False


def conv_window_index(parents: Tensor, kernel: int) -> Tensor:
    """[T, kernel] rows of cat(conv_state [kernel-1], new inputs [T]) forming each token's causal
    conv window: its ancestors' inputs (parents[i] = -1: the committed state) then its own."""
    p = kernel - 1
    dev = parents.device
    committed = (torch.arange(p, device=dev) - 1).clamp(min=0)  # slot 0's predecessor is never read
    back = torch.cat([committed, torch.where(parents >= 0, parents + p, p - 1)])
    cols = [torch.arange(parents.numel(), device=dev) + p]
    for _ in range(p):
        cols.append(back[cols[-1]])
    return torch.stack(cols[::-1], dim=1)
