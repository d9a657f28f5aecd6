"""The adaptive step policy on the dedicated runtime's step functions (engine/decoding/runtime.py,
engine/decoding/policy.py), run eagerly on the CPU: the same functions the CUDA graphs capture.
Output must equal AR token for token whatever budget each step takes."""

import itertools
import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import EngineConfig
from engine.decoding import runtime
from engine.decoding.decode import generate_ar, generate_speculative
from engine.decoding.runtime import RuntimeDecoder
from tests.engine.decoding.runtime_helpers import NoHostRead, peeking_draft
from tests.engine.engine_pairs import pair_for


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_adaptive_runtime_steps_equal_ar_with_ar_steps_for_a_weak_draft_and_trees_for_a_strong_one(monkeypatch,
                                                                                                  target):
    """The adaptive policy on the runtime's steps: the random draft's proposals are weak and the
    policy runs plain AR steps (the root alone, no proposal); proposing the target's own tokens (side
    branches every third position) it verifies trees; every other position, at a cost table where a
    tree step of 4 tokens loses to 5 AR steps, it runs AR steps after learning so, keeping the draft's
    context current. All equal AR; each budget is its own captured step, none of which reads a
    device value back."""
    from engine.decoding.policy import StepCosts

    pair = pair_for(target, "random")
    ids = pair.encode("The adaptive policy chooses on the device's estimates.")
    ar = generate_ar(pair, ids, EngineConfig(verify="ar"), 40).tokens
    cfg = EngineConfig(verify="ddtree", budget=16, top_k=3, chain_seed=0, policy="adaptive", policy_levels=3,
                       probe_every=4, draft_path="runtime", kernels="eager")
    costs = StepCosts({0: 1.0, 4: 1.8, 8: 2.5, 16: 3.0})  # a tree must accept more than one node in two
    original, keys = runtime.Graphs.run, []

    def checked(graphs, key, fn, *args):
        def guarded(*a):
            with NoHostRead():
                return fn(*a)
        keys.append(key)
        return original(graphs, key, guarded, *args)

    monkeypatch.setattr(runtime.Graphs, "run", checked)
    weak = generate_speculative(pair, ids, cfg, 40, step_costs=costs, use_runtime=True)
    real, peeking = peeking_draft(pair, len(ids), ar)
    monkeypatch.setattr(pair.drafter, "propose_static", peeking)
    strong = generate_speculative(pair, ids, cfg, 40, step_costs=costs, use_runtime=True)
    # Tree steps of several tokens, then more AR steps than a proposal recomputes the context of,
    # then a probe, which catches the draft's context up on all of them (its own captured proposal)
    _, halfway = peeking_draft(pair, len(ids), ar, side_every=2)
    monkeypatch.setattr(pair.drafter, "propose_static", halfway)
    first, keys[:] = list(keys), []
    mixed = generate_speculative(pair, ids, cfg.replace(probe_every=20, probe_max=20), 40, use_runtime=True,
                                 step_costs=StepCosts({0: 1.0, 4: 3.0, 8: 4.0, 16: 5.0}))
    monkeypatch.setattr(pair.drafter, "propose_static", real)
    assert weak.tokens == strong.tokens == mixed.tokens == ar and weak.stats.loop == "runtime"
    assert max(mixed.stats.accept_lengths[:2]) > 2 and mixed.stats.step_budgets[2:21] == [0] * 19
    block = pair.drafter.block_size
    assert {k[-2] for k in keys if k[0] == "propose"} == {block, block + 19}  # (rows, kernels last)
    hist_weak, hist_strong = weak.stats.to_dict()["budget_histogram"], strong.stats.to_dict()["budget_histogram"]
    assert hist_weak[0] > 0.6 * weak.stats.steps and len(hist_weak) > 1  # AR steps, and probes
    assert 0 not in hist_strong and strong.stats.side_branch_steps > 0
    assert strong.stats.to_dict()["policy_observed_al"] > 3
    budgets = {k[2] for k in first if k[0] == "verify"}
    assert 0 in budgets and 16 in budgets


# --- the adaptive policy's steps: plain AR's step at budget 0, the draft's context caught up later ---

class _Kernels(TorchDispatchMode):
    """Counts the ops a step function runs that compute something, by name (one kernel each on a
    GPU with the PyTorch forms): views, and a ``to`` that converts nothing, are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        outs = out if isinstance(out, (tuple, list)) else [out]
        if not schema.is_mutable and any(r.alias_info is not None for r in schema.returns):
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            if all(o.untyped_storage().data_ptr() in inputs for o in outs if isinstance(o, torch.Tensor)):
                return out
        self.ops[func.overloadpacket.__name__] += 1
        return out


def _step_kernels(monkeypatch, pair, cfg: EngineConfig, costs=None) -> dict[tuple, Counter]:
    """The kernels of each function the runtime captures, at its last call (its constants made by then),
    by key: ("ar",); ("propose", the context rows it recomputes); ("verify", budget) under the adaptive
    policy, ("verify",) under the fixed one."""
    original, seen = runtime.Graphs.run, {}

    def counted(graphs, key, fn, *args):
        count = _Kernels()
        with count:
            out = original(graphs, key, fn, *args)
        label = {"ar": (), "propose": (key[-2],), "verify": (key[2],) if cfg.policy == "adaptive" else ()}[key[0]]
        seen[(key[0], *label)] = count.ops
        return out

    monkeypatch.setattr(runtime.Graphs, "run", counted)
    ids = pair.encode("Each captured step, kernel by kernel.")
    run = generate_ar if cfg.verify == "ar" else generate_speculative
    run(pair, ids, cfg, 24, use_runtime=True, **({} if costs is None else {"step_costs": costs}))
    monkeypatch.setattr(runtime.Graphs, "run", original)
    return seen


ADAPTIVE = dict(verify="ddtree", budget=16, top_k=3, block_size=8, draft_path="runtime", kernels="eager",
                policy="adaptive", policy_levels=3)  # budgets 0, 4, 8, 16


def _only(budget: int):
    """A cost table under which the policy chooses ``budget`` at every step."""
    from engine.decoding.policy import StepCosts

    return StepCosts({b: 1.0 if b == budget else math.inf for b in (0, 4, 8, 16)})


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_the_adaptive_steps_run_the_fixed_policys_kernels_and_only_what_the_policy_needs(monkeypatch, target):
    """What each captured step of the adaptive policy adds to the step it stands for (CPU, the PyTorch
    forms: each op one launch on a GPU): an AR step is plain AR's step plus the root's target features
    (one buffer, and per feature layer a copy of the sum the next layer's add computes: on a GPU the
    add's kernel stores it there too, no launch; ``common._stack``) and their copy into the features
    buffer (no walk, no K/V move, no draft context written); a tree step is the fixed
    policy's step, its readback going on with the path probabilities and the path in the walk's own
    packing (one concatenation in the PyTorch form, as the fixed step's; on a GPU the walk's launch
    writes them: ``tree_kernel.walk_and_advance``'s ``tail``); a proposal the fixed one's plus at most six
    launches of the estimate; a proposal after AR steps (its wider context window) runs the same kernels
    as any other."""
    from engine.decoding.policy import StepCosts

    pair = pair_for(target, "random")
    plain = _step_kernels(monkeypatch, pair, EngineConfig(verify="ar", draft_path="runtime"))[("ar",)]
    ar_step = _step_kernels(monkeypatch, pair, EngineConfig(**ADAPTIVE), _only(0))[("verify", 0)]
    feature_copy = Counter(new_empty=1, copy_=len(pair.drafter.feature_layers), index_copy_=1)
    assert ar_step - plain == feature_copy and not plain - ar_step, ar_step - plain

    fixed = _step_kernels(monkeypatch, pair, EngineConfig(**{**ADAPTIVE, "policy": "fixed"}))
    trees = _step_kernels(monkeypatch, pair, EngineConfig(**ADAPTIVE), _only(16))
    # the random draft is never accepted: AR steps, and every third step a probe at budget 16
    probes = _step_kernels(monkeypatch, pair, EngineConfig(**ADAPTIVE, probe_every=3, probe_max=3),
                           StepCosts({0: 1.0, 4: 9.0, 8: 9.0, 16: 1.5}))
    tree_step, proposal = trees[("verify", 16)], trees[("propose", 8)]
    assert tree_step == fixed[("verify",)], (tree_step - fixed[("verify",)], fixed[("verify",)] - tree_step)
    estimate = proposal - fixed[("propose", 8)]
    assert sum(estimate.values()) <= 6 and not fixed[("propose", 8)] - proposal, estimate
    assert set(probes) == {("propose", 8), ("propose", 8 + 2), ("verify", 0), ("verify", 16)}
    assert probes[("propose", 8 + 2)] == probes[("propose", 8)] == trees[("propose", 8)]


def _switching(pair, prompt_len: int, truth: list[int], strong: tuple[int, int]):
    """A propose_static whose proposals are the random draft's own (weak) except while the root's
    new-token index lies in ``strong``, where the target's own tokens come first (a draft the target
    accepts whole). No host read: it runs inside the checked steps."""
    real = pair.drafter.propose_static
    truth_t = torch.tensor(truth, dtype=torch.long)

    def propose(seq, start, block_size, window, features, *context):
        logits = real(seq, start, block_size, window, features, *context)
        pos = start - prompt_len + torch.arange(1, block_size)
        fake = torch.zeros_like(logits).scatter(1, truth_t[pos.clamp(0, truth_t.numel() - 1)][:, None], 10.0)
        on = (start - prompt_len >= strong[0]) & (start - prompt_len < strong[1])
        return torch.where(on, fake, logits)

    return propose


def _runs(budgets: list[int]) -> list[tuple[bool, int]]:
    """``budgets`` as runs: (tree steps or AR steps, how many in a row), in order."""
    runs: list[tuple[bool, int]] = []
    for b in budgets:
        if runs and runs[-1][0] == (b > 0):
            runs[-1] = (b > 0, runs[-1][1] + 1)
        else:
            runs.append((b > 0, 1))
    return runs


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_adaptive_runtime_equals_ar_through_backed_off_probes_then_trees_and_back(monkeypatch, target):
    """A scripted cost table under which a tree step pays only when it accepts most of its depth, and a
    draft that is weak, then right (the target's own tokens), then weak again: the policy runs AR steps
    with probes between them that back off while they fail (2, 5, then 11 AR steps: ``probe_every`` 3
    doubling to ``probe_max`` 12), then trees once a probe is accepted, then AR steps again after its
    trees are refused, the probes from ``probe_every`` again. No AR run is longer than ``max_ar_run``;
    every token is AR's, on a dense and a hybrid target; the first proposal after AR steps recomputes
    the draft's context of the window ``probe_max`` needs."""
    from engine.decoding.policy import StepCosts

    pair = pair_for(target, "random")
    ids = pair.encode("Long runs of AR steps, then trees, then AR steps again.")
    ar = generate_ar(pair, ids, EngineConfig(verify="ar"), 112).tokens
    cfg = EngineConfig(**ADAPTIVE, chain_seed=0, probe_every=3, probe_max=12, calibration_window=2)
    costs = StepCosts({0: 1.0, 4: 3.2, 8: 3.6, 16: 4.0})
    monkeypatch.setattr(pair.drafter, "propose_static", _switching(pair, len(ids), ar, strong=(24, 64)))
    original, keys = runtime.Graphs.run, []
    monkeypatch.setattr(runtime.Graphs, "run", lambda graphs, key, fn, *args: keys.append(key) or original(
        graphs, key, fn, *args))
    gen = generate_speculative(pair, ids, cfg, 112, step_costs=costs, use_runtime=True)
    assert gen.tokens == ar
    runs = _runs(gen.stats.step_budgets)
    longest = max(range(len(runs)), key=lambda i: runs[i][1] if runs[i][0] else 0)  # the trees of the strong part
    assert runs[longest][1] >= 4 and max(gen.stats.accept_lengths) >= 5
    # before them and after, AR runs between probes twice as long each time, up to the cap
    before = [n for tree, n in runs[:longest] if not tree]
    after = [n for tree, n in runs[longest:] if not tree]
    # (the last 1: the step launched before the accepted probe was read, chosen on the failed ones)
    assert before == [2, 5, 11, 11, 1], str(runs)
    # (the last cut by the generation's end: the first proposal is read before the first step is chosen, so
    # the generation opens with AR steps, not two blind trees, and its runs end earlier)
    assert after[:4] == [2, 5, 11, 11] and 1 <= after[4] <= 11 and len(after) == 5, str(runs)
    assert not runs[0][0]  # the first proposal's estimate (a weak draft under these costs): AR steps at once
    assert max(n for tree, n in runs if not tree) == 11 == 12 - 1
    block = cfg.block_size
    assert {k[-2] for k in keys if k[0] == "propose"} == {block, block + 11}
    # a tree step reads the buffers of the proposal it follows: a captured step of its own after each
    assert {k[3] for k in keys if k[0] == "verify" and k[2]} == {block, block + 11}


def _scripted(monkeypatch, choices: list[int]) -> None:
    """The adaptive policy's choices replaced by ``choices``, in launch order, then from the start again."""
    from engine.decoding.policy import AdaptivePolicy

    it = itertools.cycle(choices)
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self: (next(it), 1.0))


# Every AR run as long as probe_every=4 allows (3), the first at the prompt, each after a tree step that
# accepts its whole depth (8 tokens): the proposal after it needs every position of its window (8 + 3).
SCRIPT = [0, 0, 0, 16, 16, 0, 0, 0, 16, 0, 4, 16, 0, 0, 8, 16, 0, 0, 0, 4]


def _proposals(monkeypatch, pair, ids, truth, every_step: bool, check: bool) -> list[torch.Tensor]:
    """One scripted adaptive generation on the runtime, the target's own tokens proposed (so trees
    accept their whole depth): the draft's real logits at each proposal. ``every_step``: the draft's
    context of the positions each step commits written after it (the root's after an AR step, the last
    ``block`` after a tree step: what the policy's first version did). ``check``: each AR step leaves
    the draft's context untouched, and at each proposal every position before the root holds its
    context as computed from scratch (float32 rounding apart)."""
    real, proposals = pair.drafter.propose_static, []
    truth_t = torch.tensor(truth, dtype=torch.long)

    def propose(seq, start, block_size, window, features, context, key_len, rows=None):
        logits = real(seq, start, block_size, window, features, context, key_len, rows)
        proposals.append(logits.clone())
        if check:
            end = int(start)
            want = pair.drafter.new_context(end)
            pair.drafter.fill_context(want, features, end)
            for got, expect in zip(context, want, strict=True):
                torch.testing.assert_close(got[:, :end], expect, rtol=0, atol=1e-5)
        pos = (start - len(ids) + torch.arange(1, block_size)).clamp(0, truth_t.numel() - 1)
        return torch.zeros_like(logits).scatter(1, truth_t[pos][:, None], 10.0)

    step = RuntimeDecoder._policy_step

    def policy_step(self, *args):  # (key_len, cfg, block, proposal, budget, ...)
        block, budget = args[2], args[4]
        before = [c.clone() for c in self._draft_context()] if check and budget == 0 else None
        out = step(self, *args)
        if before is not None:
            assert all(torch.equal(a, b) for a, b in zip(before, self._draft_context(), strict=True))
        if every_step:
            back = 1 if budget == 0 else block
            positions = (self.start + torch.arange(-back, 0)).clamp(min=0)
            ctx = self._draft_context()
            for i, (k, v) in enumerate(pair.drafter.draft.context_kv(self.ws.features[positions], positions)):
                ctx[0][i].index_copy_(0, positions, k)
                ctx[1][i].index_copy_(0, positions, v)
        return out

    monkeypatch.setattr(pair.drafter, "propose_static", propose)
    monkeypatch.setattr(RuntimeDecoder, "_policy_step", policy_step)
    _scripted(monkeypatch, SCRIPT)
    cfg = EngineConfig(**ADAPTIVE, probe_every=4)
    gen = generate_speculative(pair, ids, cfg, 128, step_costs=_only(16), use_runtime=True)
    monkeypatch.setattr(pair.drafter, "propose_static", real)
    monkeypatch.setattr(RuntimeDecoder, "_policy_step", step)
    assert gen.tokens == truth and gen.stats.step_budgets == (SCRIPT * 4)[: gen.stats.steps]
    assert gen.stats.accept_lengths[3] == cfg.block_size  # the first tree accepts its whole depth
    return proposals


@pytest.mark.parametrize("target", ["tiny-dense", "tiny-hybrid"])
def test_proposals_after_ar_runs_equal_those_of_a_draft_context_written_every_step(monkeypatch, target):
    """AR steps write none of the draft's context; the first proposal after them recomputes it for
    every position committed since the last proposal (a fixed window: ``catch_up_rows``). Its
    proposals are those of a run that writes the context after every step, bit for bit (float32,
    CPU): every position such a run wrote since the last proposal is inside the window, and older ones
    were written alike by earlier proposals. A window of ``block`` rows, as after a tree step, misses
    positions and proposes otherwise."""
    from engine.decoding.policy import AdaptivePolicy

    pair = pair_for(target, "random")
    ids = pair.encode("The draft's context catches up after AR steps.")
    truth = generate_ar(pair, ids, EngineConfig(verify="ar"), 128).tokens
    got = _proposals(monkeypatch, pair, ids, truth, every_step=False, check=True)
    want = _proposals(monkeypatch, pair, ids, truth, every_step=True, check=False)
    assert len(got) == len(want) >= 12
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    monkeypatch.setattr(AdaptivePolicy, "catch_up_rows", lambda self, block: block)
    short = _proposals(monkeypatch, pair, ids, truth, every_step=False, check=False)
    assert not all(torch.equal(g, w) for g, w in zip(short, want, strict=True))
