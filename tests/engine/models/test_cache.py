"""KV compaction: the accepted path's slots move to consecutive positions, the rest is dropped."""

import torch

import engine
from engine.decoding.tree import ancestor_mask
from engine.models.common import VerifyTree
from engine.models.dense import KVCache


def test_commit_path_moves_accepted_slots_and_sets_length():
    cache = KVCache(n_layers=2, max_len=16, kv_heads=1, head_dim=2, device="cpu", dtype=torch.float32)
    marks = torch.arange(16, dtype=torch.float32)
    cache.k[:] = marks[None, :, None, None]
    cache.v[:] = -marks[None, :, None, None]
    # verify wrote root + 5 nodes at slots 4..9; the accepted path is root(0) -> node 2 -> node 5
    cache.commit_path(start=4, path=torch.tensor([0, 2, 5, 1, 3, 4]), al=3)
    assert cache.length == 7
    assert cache.k[0, :7, 0, 0].tolist() == [0, 1, 2, 3, 4, 6, 9]
    assert cache.v[1, :7, 0, 0].tolist() == [-0, -1, -2, -3, -4, -6, -9]


def test_tree_verify_then_compaction_equals_sequential_decoding():
    pair = engine.load("tiny-dense", "none", device="cpu")
    model = pair.target
    prompt = torch.tensor(pair.encode("compaction check"))
    # a tree: root -> a -> b, root -> c (side branch); accept root, a, b
    tokens = torch.tensor([65, 66, 67, 68])
    parents = torch.tensor([-1, 0, 1, 0])
    depths = torch.tensor([0, 1, 2, 1])
    tree = VerifyTree(parents, depths, ancestor_mask(parents, 2))
    cache = model.new_cache(64)
    model(prompt, cache, 0)
    start = cache.length
    logits_tree, _ = model(tokens, cache, start, tree=tree)
    cache.commit_path(start, torch.tensor([0, 1, 2, 3]), 3)
    ref = model.new_cache(64)
    model(prompt, ref, 0)
    logits_seq, _ = model(tokens[:3], ref, start)
    torch.testing.assert_close(logits_tree[:3], logits_seq, rtol=1e-5, atol=1e-5)
    assert cache.length == ref.length == start + 3
    torch.testing.assert_close(cache.k[:, : cache.length], ref.k[:, : ref.length], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, : cache.length], ref.v[:, : ref.length], rtol=1e-5, atol=1e-5)
    # and the next token after the committed path agrees too
    nxt = torch.tensor([70])
    a, _ = model(nxt, cache, cache.length)
    b, _ = model(nxt, ref, ref.length)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
