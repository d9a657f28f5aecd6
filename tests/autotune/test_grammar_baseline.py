"""A study that tunes the grammar placement measures its AR baseline under the same grammar."""

from pathlib import Path

from autotune.experiment import load

ROOT = Path(__file__).resolve().parents[2]


def test_grammar_space_gives_baseline_and_reference_the_grammar():
    exp = load(ROOT / "experiments" / "smollm2-agent.yaml", check_models=False)
    assert "grammar" in exp.search_space.names
    assert exp.fixed_engine == {"temperature": 0.0, "grammar": "walk"}  # AR masks every step either way
    assert dict(exp.engine) == {"temperature": 0.0}  # the fingerprint's fields are untouched


def test_space_without_grammar_keeps_fixed_fields():
    exp = load(ROOT / "experiments" / "quickstart.yaml", check_models=False)
    assert "grammar" not in exp.fixed_engine
