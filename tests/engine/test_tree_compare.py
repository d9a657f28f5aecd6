"""benchmarks/tree_compare.py on a tiny pair on the CPU: prompts as ids, a run per tree (here the
same tree twice), and the comparison over every prompt and over the prompts decoded to the same text."""

from __future__ import annotations

import json

from bench_modules import load_benchmark


def _tree_compare():
    return load_benchmark("tree_compare")


def test_two_runs_compare_overall_and_on_the_same_text(tmp_path, capsys):
    tc = _tree_compare()
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": f"def f{i}(x):"}) for i in range(3)) + "\n")
    ids = tmp_path / "ids.json"
    assert tc.main(["prompts", "--sets", str(tmp_path / "p.jsonl"), "--n-prompts", "3", "--target", "tiny-dense",
                    "--out", str(ids)]) == 0
    runs = []
    for name in ("old", "new"):
        runs.append(tmp_path / f"{name}.json")
        assert tc.main(["run", "--prompts", str(ids), "--draft", "oracle:0.5", "--budget", "8", "--max-new-tokens",
                        "8", "--repeats", "2", "--device", "cpu", "--dtype", "float32", "--out", str(runs[-1])]) == 0
    run = json.loads(runs[0].read_text())
    spec = run["sets"]["p"]["ddtree-b8"]
    assert len(spec["outputs"]) == 3 and len(spec["decode_s"]) == 2 and all(n == 8 for n in spec["new_tokens"])
    md = tmp_path / "cmp.md"
    assert tc.main(["compare", str(runs[0]), str(runs[1]), "--md", str(md)]) == 0
    text = md.read_text()
    # float32 on the CPU: every output equals AR's, so "same text" is every prompt
    assert "| p | ddtree-b8 | same text: 3 of 3 |" in text and "| p | ar | all: 3 of 3 |" in text
    assert "| p | ddtree-b8 outputs equal to the tree's AR | | 3/3 | 3/3 |" in text
    other = json.loads(runs[1].read_text())
    other["max_new_tokens"] = 16
    runs[1].write_text(json.dumps(other))
    capsys.readouterr()
    assert tc.main(["compare", str(runs[0]), str(runs[1])]) == 2
    assert "not of the same prompts and tokens" in capsys.readouterr().err


def test_bad_flags_exit_2_naming_them(tmp_path, capsys):
    import pytest

    tc = _tree_compare()
    with pytest.raises(SystemExit) as err:
        tc.main(["run", "--prompts", "x.json", "--repeats", "0", "--out", str(tmp_path / "o.json")])
    assert err.value.code == 2 and "--repeats must be >= 1, but got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        tc.main(["prompts", "--n-prompts", "3"])  # --out is required
    assert err.value.code == 2 and "--out" in capsys.readouterr().err


def test_two_sets_add_a_row_over_every_prompt():
    """Two sets: each set's rows, then "all sets" over the prompts of both (tokens over seconds summed)."""
    tc = _tree_compare()

    def run(seconds: float) -> dict:
        rec = {"outputs": [[1, 2]], "new_tokens": [11], "steps": [5], "decode_s": [[seconds], [seconds]]}
        return {"ar": rec, "ddtree-b8": dict(rec, steps=[2])}

    old = {"sets": {"a": run(1.0), "b": run(3.0)}}
    new = {"sets": {"a": run(1.0), "b": run(1.0)}}
    rows = [line for line in tc.compare(old, new) if line.startswith("| all sets | ddtree-b8 | all")]
    # old: 20 tokens in 4 s = 5 tok/s; new: 20 in 2 s = 10 tok/s
    assert rows == ["| all sets | ddtree-b8 | all: 2 of 2 | 5.0 | 10.0 | 2.000 | 5.00 | 5.00 | 1000.0000 | 500.0000 |"]
