"""benchmarks/policy_sim.py on the tiny dense target on the CPU: a replay of the per-position table must
be what decoding does. A draft proposing the target's own tokens (a decoy first at some depths, so
accepted paths take side branches; the random draft's own proposals for a stretch) makes the trees
deep; each fixed budget's replay must accept what the generic loop accepts at that budget, step for
step, and the real policy's replay (no lag: the generic loop reads each step before choosing the
next) choose its budgets."""

from __future__ import annotations

import json

import pytest
import torch
from bench_modules import load_benchmark

from engine import EngineConfig
from engine.decoding.decode import generate_ar, generate_speculative
from engine.decoding.policy import AdaptivePolicy, StepCosts
from tests.engine.engine_pairs import pair_for

NEW = 48
COSTS = StepCosts({0: 1.0, 4: 1.6, 8: 2.2, 16: 2.6})


@pytest.fixture(scope="module")
def sim():
    return load_benchmark("policy_sim")


@pytest.fixture(scope="module")
def peeked():
    """The tiny pair with a draft that proposes the AR text (decoys at some depths, by position), a
    prompt and the table the simulator builds for it."""
    pair = pair_for("tiny-dense", "random")
    ids = pair.encode("The simulator replays what decoding does.")
    truth = generate_ar(pair, ids, EngineConfig(verify="ar"), NEW + 16).tokens
    truth_t = torch.tensor(truth)
    real = pair.drafter.propose

    def propose(seq, start, block_size, window, features):
        logits = real(seq, start, block_size, window, features)
        pos = start - len(ids) + torch.arange(1, block_size)
        tok = truth_t[pos.clamp(0, truth_t.numel() - 1)]
        side = (pos * 7 + start) % 3 == 0  # a decoy first, the true token second, varying by root
        fake = torch.zeros_like(logits).scatter(1, ((tok + 1) % logits.shape[1])[:, None],
                                                 torch.where(side, 10.0, 0.0)[:, None])
        fake = fake.scatter(1, tok[:, None], torch.where(side, 9.0, 10.0)[:, None])
        return logits if 16 <= start - len(ids) < 28 else fake  # the random draft's own in between: AR steps

    pair.drafter.propose = propose
    return pair, ids, truth


def test_a_fixed_budgets_replay_accepts_what_decoding_at_that_budget_does(sim, peeked):
    pair, ids, truth = peeked
    cfg = EngineConfig(verify="ddtree", budget=16, top_k=3, chain_seed=0, draft_path="generic")
    rows = sim.positions(pair, cfg.replace(draft_path="auto"), ids, NEW)
    assert len(rows) == NEW - 1
    for budget in (4, 8, 16):
        gen = generate_speculative(pair, ids, cfg.replace(budget=budget), NEW, use_runtime=False)
        assert gen.tokens == truth[:NEW]
        steps = sim.replay(rows, lambda b=budget: (b, 0.0), lambda *_: None, 0)
        assert [a + 1 for _, _, a in steps] == gen.stats.accept_lengths, budget
    assert max(gen.stats.accept_lengths) >= 4 and gen.stats.side_branch_steps > 0


def test_the_policys_replay_chooses_what_it_chooses_decoding_and_the_oracle_beats_every_fixed_budget(sim, peeked):
    pair, ids, truth = peeked
    cfg = EngineConfig(verify="ddtree", budget=16, top_k=3, chain_seed=0, policy="adaptive", policy_levels=3,
                       probe_every=2, probe_max=8, calibration_window=2)
    rows = sim.positions(pair, cfg, ids, NEW)
    gen = generate_speculative(pair, ids, cfg, NEW, use_runtime=False, step_costs=COSTS)
    policy = AdaptivePolicy.for_config(cfg, pair.drafter.block_size - 1, COSTS)
    steps = sim.replay(rows, policy.choose, lambda b, r: policy.observe(b, r["probs"], r["path"]), 0,
                       lambda r: policy.preview(r["probs"]))
    assert [b for b, _, _ in steps] == gen.stats.step_budgets
    assert [a + 1 for _, _, a in steps] == gen.stats.accept_lengths
    assert [e for b, e, _ in steps if b] == pytest.approx(gen.stats.predicted_al)
    assert len(set(gen.stats.step_budgets)) > 1  # the replay is not trivially one budget
    report = sim.run_set([rows, rows[5:]], cfg, pair.drafter.block_size - 1, COSTS, ar_ms=1.0, lag=1)
    rates = report["vs_ar"]
    assert all(rates["oracle"] >= rates[f"fixed {b}"] - 1e-12 for b in (4, 8, 16))
    assert rates["oracle"] >= rates["adaptive"] and report["oracle_vs_best"] >= 1.0
    assert sum(report["histogram"].values()) == round(report["tokens"] / report["al"]["adaptive"])


def test_the_table_is_built_once_and_replayed_from_its_cache(sim, tmp_path, monkeypatch, capsys):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    args = ["--target", "tiny-dense", "--draft", "random", "--sets", str(tmp_path / "p.jsonl"), "--n-prompts", "1",
            "--max-new-tokens", "12", "--budget", "8", "--top-k", "2", "--levels", "2",
            "--costs", "0:1,4:1.5,8:1.6", "--cache", str(tmp_path / "t.json"), "--json", str(tmp_path / "r.json")]
    first = sim.main(args)
    assert json.loads((tmp_path / "t.json").read_text())["key"]["max_new_tokens"] == 12
    monkeypatch.setattr(sim, "build", lambda _: pytest.fail("the cached table was built again"))
    assert json.loads(json.dumps(sim.main(args))) == json.loads(json.dumps(first)) == \
        json.loads((tmp_path / "r.json").read_text())
    out = capsys.readouterr().out
    assert "p_adaptive_vs_ar: " in out and "| p |" in out
    with pytest.raises(SystemExit, match="--costs: expected budget:ms pairs"):
        sim.main([*args[:-4], "--costs", "0=1"])
