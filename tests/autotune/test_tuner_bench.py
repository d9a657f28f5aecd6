"""benchmarks/tuner_bench.py on the CPU: the grid measured on the tiny pair, and the tuner's
strategies replayed (the real driver, a ReplayWorker answering from the cache) on a small synthetic
cache: regret curves never go up, and on a tiny grid a strategy reaches the optimum."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from autotune_helpers import tiny_experiment

from autotune import experiment
from autotune import study as st

REPO = Path(__file__).resolve().parents[2]
SPACE = {"verify": {"type": "categorical", "choices": ["chain", "ddtree"]},
         "budget": {"type": "categorical", "choices": [2, 4], "when": {"verify": "ddtree"}}}


def _bench():
    spec = importlib.util.spec_from_file_location("tuner_bench", REPO / "benchmarks" / "tuner_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it is executed
    spec.loader.exec_module(module)
    return module


def _synthetic_cache(bench, exp, path: Path) -> float:
    """AR 100 tok/s, the reference 120, chain 150, ddtree b2 130, ddtree b4 200 (the optimum); each
    with three passes around its value, a rung at 0.9x its rate and a quarter of its work, and slower
    configs taking longer."""
    fixed = exp.fixed_engine
    values = {"baseline": ({**fixed, "verify": "ar"}, 100.0), "reference": ({**st.REFERENCE, **fixed}, 120.0)}
    for pt, v in zip(bench.space_points(exp.search_space, "space"), (150.0, 130.0, 200.0), strict=True):
        values[json.dumps(pt)] = ({**fixed, **pt}, v)

    def fid(v: float, work: float) -> dict:
        return {"ok": True, "fail_reason": None, "refused": None, "decode_tps_runs": [0.97 * v, v, 1.03 * v],
                "per_prompt_tps": [v, v], "acceptance_length": 2.0, "steps": 10, "step_ms": 1.0, "exact_match": 1.0,
                "elapsed_s": 3 * work / v, "seconds_per_pass": work / v}

    lines = [{"kind": "header", "experiment": exp.name, "device": "cpu", "dtype": "float32", "max_new_tokens": 8,
              "workloads": [{"name": "prompts", "hash": "0123"}], "facts": {"recurrent_state": False, "tools": False},
              "ladder": [[1, 4]], "warmup": 0, "repeats": 3, "measured_at": "synthetic"}]
    lines += [{"kind": "config", "role": role, "config": bench.full_config(cfg),
               "fidelities": {"full": fid(v, 100.0), "p1t4": fid(0.9 * v, 25.0)}} for role, (cfg, v) in values.items()]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 200.0


def test_replayed_strategies_never_lose_ground_and_find_a_tiny_grids_optimum(tmp_path):
    bench = _bench()
    exp_path = tiny_experiment(tmp_path / "exp", space=SPACE, fidelity={"rungs": [{"prompts": 1, "max_new_tokens": 4}]})
    exp = experiment.load(exp_path)
    cache = tmp_path / "grid.jsonl"
    best = _synthetic_cache(bench, exp, cache)
    assert bench.Cache.read(cache).optimum(strict=True)[0] == best
    out = tmp_path / "out"
    rc = bench.main(["replay", str(exp_path), "--cache", str(cache), "--strategies", "ours,random", "--seeds", "2",
                     "--n-trials", "8", "--out", str(out)])
    assert rc == 0
    runs = json.loads((out / "runs.json").read_text())
    assert sorted((r["strategy"], r["seed"]) for r in runs) == [("ours", 0), ("ours", 1), ("random", 0), ("random", 1)]
    for r in runs:
        times = [t for t, _ in r["curve"]]
        regrets = [g for _, g in r["curve"]]
        assert times == sorted(times) and r["end_s"] >= times[-1] > 0  # simulated time, charged per measurement
        assert regrets == sorted(regrets, reverse=True), r  # the best found never gets worse
        assert all(0.0 <= g <= 1.0 for g in regrets)
        # the study's pick over time: what stopping the sweep then gives (it may move either way under noise)
        assert r["pick_curve"] and all(0.0 <= g <= 1.0 for _, g in r["pick_curve"])
        assert all(p >= f for (_, p), (_, f) in zip(r["pick_curve"], r["curve"], strict=True))  # never beats found
    reached = [r for r in runs if r["curve"][-1][1] == 0.0]
    assert reached and all(r["time_to_target"] is not None for r in reached)
    assert any(r["winner_regret"] == 0.0 for r in reached)  # and the confirmed winner is the optimum
    table = (out / "table.md").read_text()
    assert "| ours | 2 |" in table and "| random | 2 |" in table and "pick's regret at 600 s" in table
    assert (out / "regret.png").stat().st_size > 1000


def test_a_cache_without_a_config_is_refused_naming_it(tmp_path, capsys):
    bench = _bench()
    exp_path = tiny_experiment(tmp_path / "exp", space=SPACE)
    cache = tmp_path / "grid.jsonl"
    cache.write_text(json.dumps({"kind": "header", "max_new_tokens": 8, "workloads": [], "facts": {}}) + "\n")
    assert bench.main(["replay", str(exp_path), "--cache", str(cache), "--strategies", "ours,nope"]) == 2
    assert "--strategies: must list some of" in capsys.readouterr().err
    assert bench.main(["replay", str(exp_path), "--cache", str(tmp_path / "none.jsonl")]) == 2
    assert "no such cache file" in capsys.readouterr().err


def test_the_grid_is_measured_once_on_the_tiny_pair_and_cached(tmp_path, capsys):
    bench = _bench()
    exp_path = tiny_experiment(tmp_path / "exp", space=SPACE, measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.5})
    cache = tmp_path / "grid.jsonl"
    assert bench.main(["measure", str(exp_path), "--cache", str(cache), "--repeats", "2"]) == 0
    lines = [json.loads(line) for line in cache.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["facts"] == {"recurrent_state": False, "tools": False}
    configs = lines[1:]
    assert [c["role"] for c in configs] == ["baseline", "reference", "grid", "grid", "grid"]
    for c in configs:
        full = c["fidelities"]["full"]
        assert full["ok"] and len(full["decode_tps_runs"]) == 2 and full["exact_match"] == 1.0
        assert full["seconds_per_pass"] > 0
    # measured again: everything is in the cache already
    assert bench.main(["measure", str(exp_path), "--cache", str(cache)]) == 0
    assert "measured: 0" in capsys.readouterr().out and len(cache.read_text().splitlines()) == 6


def test_a_cache_measured_before_a_config_field_existed_still_answers(tmp_path):
    """Configs recorded without a field the engine added since (here the adaptive policy's) are keyed
    as today's engine completes them: the field's default, which decodes as the older engine did."""
    bench = _bench()
    exp = experiment.load(tiny_experiment(tmp_path / "exp", space=SPACE))
    cache = tmp_path / "grid.jsonl"
    _synthetic_cache(bench, exp, cache)
    added = ("policy", "policy_levels", "probe_every", "probe_max", "calibration_window", "switch_margin")
    old = []
    for line in cache.read_text().splitlines():
        obj = json.loads(line)
        if obj["kind"] == "config":
            assert set(added) <= set(obj["config"])  # what the engine records today
            obj["config"] = {k: v for k, v in obj["config"].items() if k not in added}
        old.append(json.dumps(obj))
    cache.write_text("\n".join(old) + "\n")
    read = bench.Cache.read(cache)
    ar = read.entry(bench.full_config({**exp.fixed_engine, "verify": "ar"}))
    assert ar["role"] == "baseline" and read.optimum(strict=True)[0] == 200.0


def test_bad_cache_lines_and_a_missing_config_are_refused_naming_them(tmp_path, capsys):
    """Each exits 2 with the file and line (or the config asked for), never a traceback."""
    bench = _bench()
    exp_path = tiny_experiment(tmp_path / "exp", space=SPACE)
    exp = experiment.load(exp_path)
    good = tmp_path / "good.jsonl"
    _synthetic_cache(bench, exp, good)
    header = good.read_text().splitlines()[0]
    for name, bad, needle in (
            ("list", "[1, 2]", r"bad.jsonl:2: every line must be a JSON object, but got 'list'"),
            ("no config", '{"kind": "config", "fidelities": {}}', r"bad.jsonl:2: config: a config line needs it"),
            ("refused", '{"kind": "config", "config": {"verify": "ddtree", "budget": 0}, "fidelities": {}}',
             r"bad.jsonl:2: config: the engine refuses it \(.*budget")):
        cache = tmp_path / "bad.jsonl"
        cache.write_text(header + "\n" + bad + "\n")
        assert bench.main(["replay", str(exp_path), "--cache", str(cache), "--strategies", "random", "--seeds",
                           "1"]) == 2, name
        err = capsys.readouterr().err
        assert re.search(needle, err) and "Traceback" not in err, (name, err)
    header_only = tmp_path / "header.jsonl"
    header_only.write_text(header + "\n")  # no config at all: the first one a strategy asks for is named
    assert bench.main(["replay", str(exp_path), "--cache", str(header_only), "--strategies", "random",
                       "--seeds", "1"]) == 2
    assert "a strategy asked for a config the cache does not hold" in capsys.readouterr().err


def _live():
    _bench()  # tuner_live imports it by name
    spec = importlib.util.spec_from_file_location("tuner_live", REPO / "benchmarks" / "tuner_live.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_live_sweeps_run_the_real_worker_and_score_against_the_grid(tmp_path, capsys):
    """`tuner_live.py`: each strategy a real sweep on the tiny pair, timed by the wall clock, its
    regret against the measured grid; a cache without the space's configs is refused naming it."""
    bench, live = _bench(), _live()
    exp_path = tiny_experiment(tmp_path / "exp", space=SPACE, measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.5})
    cache = tmp_path / "grid.jsonl"
    assert bench.main(["measure", str(exp_path), "--cache", str(cache), "--repeats", "2"]) == 0
    out = tmp_path / "live"
    assert live.main([str(exp_path), "--cache", str(cache), "--strategies", "ours,before", "--n-trials", "4",
                      "--out", str(out)]) == 0
    runs = json.loads((out / "runs.json").read_text())
    assert [r["strategy"] for r in runs] == ["ours", "before"]
    for r in runs:
        times, regrets = [t for t, _ in r["curve"]], [g for _, g in r["curve"]]
        assert times and times == sorted(times) and 0 < times[-1] <= r["end_s"]  # wall seconds since its start
        assert regrets == sorted(regrets, reverse=True) and all(0.0 <= g <= 1.0 for g in regrets)
    assert "(median, wall s)" in (out / "table.md").read_text()
    other = tiny_experiment(tmp_path / "other", space={"verify": {"type": "categorical", "choices": ["chain"]},
                                                       "draft_path": {"type": "categorical",
                                                                      "choices": ["generic", "auto"]}})
    capsys.readouterr()
    assert live.main([str(other), "--cache", str(cache), "--out", str(tmp_path / "x")]) == 2
    assert "the cache lacks" in capsys.readouterr().err


class _StubWorker:
    """A worker whose configs run at set rates (tok/s) at every fidelity, a pass taking tokens / rate
    seconds; it records the jobs it measured."""

    RATES = {"ar": 100.0, "reference": 120.0, "chain": 10.0, "ddtree-2": 150.0, "ddtree-4": 20.0}

    def __init__(self, sets: int, n_prompts: int) -> None:
        from types import SimpleNamespace

        self.pair = SimpleNamespace(device="cpu", dtype="float32")
        self.sets, self.n_prompts, self.jobs = sets, n_prompts, []

    def limits(self) -> dict:
        return {"recurrent_state": False, "tools": False}

    def measure(self, job):
        from autotune.record import Record

        self.jobs.append(job)
        c = job.config
        name = ("reference" if job.role == "reference" else "ar" if c["verify"] == "ar" else
                "chain" if c["verify"] == "chain" else f"ddtree-{c['budget']}")
        rate, prompts = self.RATES[name], (job.prompts or self.n_prompts) * self.sets
        seconds = prompts * job.max_new_tokens / rate
        return Record(trial=job.trial, role=job.role, worker="stub", config=dict(c), rung=job.rung,
                      decode_tps_runs=[rate] * job.repeats, per_prompt_tps=[rate] * prompts, acceptance_length=2.0,
                      steps=10, step_ms=1.0, exact_match=1.0, elapsed_s=seconds * (job.warmup + job.repeats),
                      engine_s=seconds * (job.warmup + job.repeats))


def test_slow_configs_full_fidelity_is_extrapolated_from_the_rung_and_validated(tmp_path, monkeypatch, capsys):
    """--extrapolate-slow 2: a grid config 2x or more behind the reference at the rung is not measured
    in full (its seconds a pass scaled by the tokens, its rates the rung's); --validate 1 measures the
    first such one anyway with the estimate beside; the rest are measured; the replay reads the cache."""
    from autotune import worker as worker_mod

    bench = _bench()
    exp_path = tiny_experiment(tmp_path / "exp", space=SPACE, measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.5},
                               fidelity={"rungs": [{"prompts": 1, "max_new_tokens": 4}]})
    stub = _StubWorker(sets=1, n_prompts=2)
    monkeypatch.setattr(worker_mod.Worker, "load", classmethod(lambda cls, *a, **k: stub))
    cache = tmp_path / "grid.jsonl"
    assert bench.main(["measure", str(exp_path), "--cache", str(cache), "--extrapolate-slow", "2",
                       "--validate", "1"]) == 0
    out = capsys.readouterr().out
    lines = {(c["config"]["verify"], c["config"]["budget"] if c["config"]["verify"] == "ddtree" else None,
              c["role"]): c["fidelities"] for c in map(json.loads, cache.read_text().splitlines()[1:])}
    full_jobs = [(j.role, j.config["verify"], j.config["budget"]) for j in stub.jobs if j.rung is None]
    chain = lines[("chain", None, "grid")]
    assert "estimate" in chain["full"] and chain["full"]["seconds_per_pass"] == 2 * 8 / 10.0  # measured
    assert chain["full"]["estimate"]["seconds_per_pass"] == chain["p1t4"]["seconds_per_pass"] * 4  # 2x8 / 1x4 tokens
    slow = lines[("ddtree", 4, "grid")]["full"]
    assert slow["extrapolated"] == {"factor": 4.0} and slow["decode_tps_runs"] == [20.0, 20.0]
    assert slow["per_prompt_tps"] == [20.0, 20.0]  # the set's one rung prompt, cycled over its 2
    assert slow["seconds_per_pass"] == lines[("ddtree", 4, "grid")]["p1t4"]["seconds_per_pass"] * 4
    assert ("grid", "ddtree", 4) not in full_jobs and ("grid", "ddtree", 2) in full_jobs  # not measured in full
    assert "extrapolated from the rung" in out and "extrapolated: 10.0 tok/s" in out
    assert "estimate" not in lines[("ddtree", 2, "grid")]["full"]  # fast configs: measured as before
    assert bench.Cache.read(cache).optimum(strict=True)[0] == 150.0
    rc = bench.main(["replay", str(exp_path), "--cache", str(cache), "--strategies", "before", "--seeds", "1",
                     "--n-trials", "5", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0 and "extrapolated: 1 config" in out
    # the stub's seconds grow with the tokens, so the one validated estimate is exact
    assert "validated: measured / estimated seconds a pass 1.00 (chain" in out
    # --extrapolated-scale: only the estimated seconds are charged scaled, the measured ones as measured
    from autotune.record import Job

    read = bench.Cache.read(cache)
    charged = {}
    for scale in (1.0, 0.25):
        worker = bench.ReplayWorker(read, seed=0, extrapolated_scale=scale)
        for budget in (2, 4):
            config = next(c["config"] for c in map(json.loads, cache.read_text().splitlines()[1:])
                          if c["config"]["verify"] == "ddtree" and c["config"]["budget"] == budget)
            job = Job(trial=0, role="grid", config=config, max_new_tokens=8, warmup=0, repeats=2, max_rel_mad=0.5)
            charged[scale, budget] = worker.measure(job).elapsed_s
    assert charged[0.25, 4] == pytest.approx(charged[1.0, 4] / 4) and charged[1.0, 4] == 2 * slow["seconds_per_pass"]
    assert charged[0.25, 2] == charged[1.0, 2]
    assert bench.main(["replay", str(exp_path), "--cache", str(cache), "--extrapolated-scale", "0"]) == 2
    assert "--extrapolated-scale: must be a factor > 0" in capsys.readouterr().err


def test_measure_options_are_refused_naming_them(tmp_path, capsys):
    bench = _bench()
    exp_path = tiny_experiment(tmp_path / "exp", space=SPACE)
    cache = str(tmp_path / "grid.jsonl")
    for argv, says in ((["--extrapolate-slow", "1"], "--extrapolate-slow: must be a ratio > 1"),
                       (["--validate", "2"], "--validate: must be >= 0, and given only with --extrapolate-slow"),
                       (["--only", "budget"], "--only"), (["--only", "nope=1"], "nope"),
                       (["--only", "budget=["], "the value is not YAML")):
        assert bench.main(["measure", str(exp_path), "--cache", cache, *argv]) == 2
        assert says in capsys.readouterr().err
    no_ladder = tiny_experiment(tmp_path / "flat", space=SPACE, fidelity={"rungs": []})
    assert bench.main(["measure", str(no_ladder), "--cache", cache, "--extrapolate-slow", "2"]) == 2
    assert "needs the experiment's fidelity ladder" in capsys.readouterr().err


def test_configs_that_differ_only_where_the_target_cannot_see_are_measured_once(tmp_path, capsys):
    """rollback on the tiny pair's dense target: the grid's replay and fast configs run one decode
    program, so the second carries the first's measurement and names it (and why); the replay counts
    it; --measure-twins measures both; a later call over the cache keeps the twin."""
    bench = _bench()
    space = {**SPACE, "rollback": {"type": "categorical", "choices": ["replay", "fast"]}}
    exp_path = tiny_experiment(tmp_path / "exp", space=space, measure={"warmup": 0, "repeats": 2, "max_rel_mad": 0.5})
    cache = tmp_path / "grid.jsonl"
    assert bench.main(["measure", str(exp_path), "--cache", str(cache), "--only", "verify=chain"]) == 0
    out = capsys.readouterr().out
    grid = [json.loads(line) for line in cache.read_text().splitlines()[1:]]
    grid = [c for c in grid if c["role"] == "grid"]
    assert sorted(c["config"]["rollback"] for c in grid) == ["fast", "replay"]
    measured, twin = sorted(grid, key=lambda c: "same_program_as" in c)
    assert "same_program_as" not in measured
    assert twin["same_program_as"]["config"] == measured["config"]
    assert twin["same_program_as"]["fixed"][0]["name"] == "rollback"
    assert "dense target" in twin["same_program_as"]["fixed"][0]["why"]
    assert twin["fidelities"] == measured["fidelities"] and "the program of" in out and "measured: 3" in out
    # the ddtree half later: its twins found among this call's lines and the cache's
    assert bench.main(["measure", str(exp_path), "--cache", str(cache)]) == 0
    lines = [json.loads(line) for line in cache.read_text().splitlines()[1:]]
    assert sum("same_program_as" in c for c in lines) == 3 and len(lines) == 2 + 6
    capsys.readouterr()
    assert bench.main(["replay", str(exp_path), "--cache", str(cache), "--strategies", "before", "--seeds", "1",
                       "--n-trials", "4", "--out", str(tmp_path / "out")]) == 0
    assert "twins: 3 config(s)" in capsys.readouterr().out
    every = tmp_path / "every.jsonl"
    assert bench.main(["measure", str(exp_path), "--cache", str(every), "--only", "verify=chain",
                       "--measure-twins"]) == 0
    assert not any("same_program_as" in json.loads(line) for line in every.read_text().splitlines()[1:])
    assert "measured: 4" in capsys.readouterr().out


def test_a_replayed_sweeps_timeout_runs_on_the_simulated_clock(tmp_path):
    """--timeout 5: the synthetic configs cost ~1-3 simulated seconds a pass, so the sweep starts no
    trial after 5 simulated seconds and ends with fewer trials than the 8 asked for, although its
    wall time is a fraction of a second (on the wall clock every trial would start)."""
    bench = _bench()
    exp_path = tiny_experiment(tmp_path / "exp", space=SPACE)
    exp = experiment.load(exp_path)
    cache = tmp_path / "grid.jsonl"
    _synthetic_cache(bench, exp, cache)
    runs = {}
    for name, extra in (("all", []), ("timed", ["--timeout", "5"])):
        assert bench.main(["replay", str(exp_path), "--cache", str(cache), "--strategies", "random", "--seeds", "1",
                           "--n-trials", "8", "--out", str(tmp_path / name), *extra]) == 0
        runs[name] = json.loads((tmp_path / name / "runs.json").read_text())[0]
    assert runs["timed"]["trials"] < runs["all"]["trials"]
    assert runs["timed"]["end_s"] < runs["all"]["end_s"]
    assert bench.main(["replay", str(exp_path), "--cache", str(cache), "--timeout", "0"]) == 2
