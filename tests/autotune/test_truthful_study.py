"""The study's values tell the truth (issue #25): a pruned trial carries no objective value, `best`
prints only the parameters that apply to the winner, and the report names one winner everywhere.

Studies here are built from trial records (no model runs), so each case is certain; the sweeps in
test_fidelity.py prune real trials through the driver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from autotune import results
from autotune import study as st
from autotune.cli import main
from autotune.report import write_report
from engine import EngineConfig

TREE_ONLY = ("budget", "top_k", "proposal_temp", "chain_seed")


def _config(**fields: Any) -> dict[str, Any]:
    return EngineConfig.from_dict(fields).to_dict()  # every field, as a sweep records it


AR = _config(verify="ar")
CHAIN = _config(verify="chain", draft_path="runtime")
DDTREE = _config(verify="ddtree", draft_path="runtime", budget=48, top_k=4)


def _trial(role: str, config: dict[str, Any], median: float, spread: float = 1.0) -> optuna.trial.FrozenTrial:
    attrs = {"role": role, "config": config, "worker": "host:1", "decode_tps_median": median, "spread": spread,
             "decode_tps_runs": [median - spread, median, median + spread], "acceptance_length": 3.0,
             "al_histogram": {"1": 2, "4": 5}, "exact_match": 1.0, "ar_decode_tps": 100.0,
             "speedup_vs_ar": median / 100.0, "baseline_trial": 0, "workload_hash": "h", "device": "cpu",
             "step_ms": 10.0, "phase_ms_per_step": {"draft": 2.0, "verify": 7.0}, "per_set": {}}
    return optuna.trial.create_trial(value=median - spread, params={"x": median},
                                     distributions={"x": FloatDistribution(0, 1000)}, user_attrs=attrs)


def _tied_study(storage: Any = None) -> optuna.Study:
    """AR (trial 0), the reference (1), a chain (2) and a DDTree (3) with the higher search value; the
    confirmation finds 2 and 3 tied and picks the simpler chain: the confirmed winner is trial 2."""
    study = optuna.create_study(study_name="tied", direction="maximize", storage=storage)
    study.set_user_attr("model", {"target": "tiny-dense", "draft": "oracle:0.3"})
    study.set_user_attr("fixed_dimensions", [{"name": "rollback", "value": "fast", "why": "dense target"}])
    for role, cfg, median in (("baseline", AR, 100.0), ("reference", _config(), 120.0),
                              ("search", CHAIN, 150.0), ("search", DDTREE, 156.0)):
        study.add_trial(_trial(role, cfg, median))
    cands = [{"trial": n, "config": c, "score": {"median": m, "spread": s, "value": m - s},
              "speedup_vs_ar": m / 100.0, "break_even_al": None if n == 0 else 1.5, "exact_match": 1.0}
             for n, c, m, s in ((0, AR, 100.0, 1.0), (2, CHAIN, 152.0, 4.0), (3, DDTREE, 153.0, 4.0))]
    study.set_user_attr("confirmation", {
        "finished_trials": 3, "repeats": 3, "worker": "host:1", "when": "now", "winner": 2, "ties": [2, 3],
        "ar_median_tps": 100.0, "winner_median_tps": 152.0, "winner_spread": 4.0, "winner_speedup_vs_ar": 1.52,
        "positive_vs_ar": True, "positive_vs_reference": True, "dropped": [], "candidates": cands})
    return study


def test_a_pruned_trial_has_no_value_and_keeps_its_partial_figure():
    """Optuna's own tell would make the pruned trial's last reported figure (500 tok/s on one prompt)
    its value, above the winner's: best_trial would name it."""
    study = optuna.create_study(direction="maximize")
    study.add_trial(_trial("search", CHAIN, 150.0))
    trial = study.ask()
    trial.report(500.0, 0)
    st.tell_pruned(study, trial, 500.0, "stopped at rung 0: far behind")
    pruned = study.trials[1]
    assert pruned.state == TrialState.PRUNED and pruned.value is None and pruned.values is None
    assert pruned.user_attrs["partial_decode_tps"] == 500.0
    assert pruned.user_attrs["pruned_reason"] == "stopped at rung 0: far behind"
    assert pruned.intermediate_values == {0: 500.0}  # what TPE ranks pruned trials by stays
    assert study.best_trial.number == 0 and results.summary(study)["best_trial"] == 0
    with pytest.raises(ValueError, match="Cannot tell a PRUNED trial"):
        st.tell_pruned(study, trial, 1.0, "twice")


def test_best_prints_only_the_fields_that_apply_to_a_chain_winner(tmp_path: Path, capsys):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    _tied_study(url)
    assert main(["best", "tied", "--storage", url]) == 0
    out = capsys.readouterr().out
    config = out.split("config:", 1)[1]
    assert "trial: 2" in out and "verify: chain" in config and "draft_path: runtime" in config
    assert "rollback:" in config  # a chain still rolls back rejected tokens (the export must load as it is)
    assert "fixed_dimensions: rollback=fast (dense target)" in out  # ... and it says the sweep fixed it
    for key in TREE_ONLY:
        assert f"{key}:" not in config
    assert main(["best", "tied", "--storage", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engine"] == EngineConfig.from_dict(CHAIN).applicable() and not set(TREE_ONLY) & set(doc["engine"])
    assert doc["provenance"]["fixed_dimensions"] == [{"name": "rollback", "value": "fast", "why": "dense target"}]


def test_the_report_names_the_confirmed_winner_in_every_section(tmp_path: Path):
    study = _tied_study()
    assert results.winner(study).trial == 2
    write_report(study, tmp_path)
    md = (tmp_path / "report.md").read_text()
    sections = {s.split("\n", 1)[0]: s for s in md.split("\n## ")}
    assert "Trial 2 (search, path `chain/runtime/fast`), confirmed" in sections["Winner"]
    paths = sections["Which path won"]
    assert "Best path: `chain/runtime/fast` (the winner: trial 2, search value 149.00)" in paths
    assert "`ddtree/runtime/fast`: best value 155.00 (trial 3); the winner is -3.9% ahead (tied with the winner" \
        in paths
    assert "| 2 ★ | search |" in sections["Top trials"] and "| 3 ★" not in md
    # a chain's row shows no tree parameters, whatever the trial recorded
    assert "budget" not in sections["Top trials"].split("| 2 ★", 1)[1].split("\n", 1)[0]
