"""``objective: session_tps``: multi-turn sessions replayed through a prefix cache, scored by session
tok/s (prefill included) with decode tok/s beside it, on the tiny pair, end to end."""

from __future__ import annotations

import dataclasses
import io
import json
import time

import pytest
from autotune_helpers import tiny_experiment

from autotune import experiment, export, results
from autotune.errors import InputError
from autotune.report import write_report
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep

SESSIONS = [
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"},
                  {"role": "assistant", "content": "x"}, {"role": "user", "content": "and then?"},
                  {"role": "assistant", "content": "y"}, {"role": "user", "content": "more"}]},
    {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "z"},
                  {"role": "user", "content": "now subtract"}]},
]
WORKLOAD = {"sets": ["sessions.jsonl"], "n_prompts": 2, "max_new_tokens": 8, "seed": 0, "prefix_cache_mb": 64}


def _experiment(tmp_path, lines=None, **sections):
    (tmp_path / "sessions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in lines or SESSIONS))
    return tiny_experiment(tmp_path, name="sess", **{"objective": "session_tps", "workload": WORKLOAD, **sections})


@pytest.mark.parametrize("change,key,rule", [
    ({"workload": {**WORKLOAD, "sets": ["humaneval"]}}, "workload.sets[0]", "has no multi-turn sessions"),
    ({"workload": {**WORKLOAD, "sets": ["prompts.jsonl"]}}, "messages", "needs messages, not a prompt string"),
    ({"workload": {**WORKLOAD, "prefix_cache_mb": -1}}, "workload.prefix_cache_mb", "finite number of MiB >= 0"),
    ({"workload": {**WORKLOAD, "min_turns": 0}}, "workload.min_turns", ">= 1"),
    ({"objective": "decode_tps", "workload": {**WORKLOAD, "sets": ["prompts.jsonl"]}}, "workload.prefix_cache_mb",
     "only applies with objective: session_tps"),
])
def test_a_session_workload_is_checked_before_anything_runs(tmp_path, change, key, rule):
    with pytest.raises(InputError, match=rule) as err:
        experiment.load(_experiment(tmp_path, **change))
    assert key in str(err.value)


def test_min_turns_selects_a_session_file_s_sessions_when_it_is_set(tmp_path):
    every = experiment.load(_experiment(tmp_path))  # unset: each session of the file, whatever its turns
    assert [len(w.prompts) for w in experiment.load_workloads(every)] == [2]
    three = experiment.load(_experiment(tmp_path, workload={**WORKLOAD, "min_turns": 3}))
    assert [len(w.prompts) for w in experiment.load_workloads(three)] == [1]
    assert three.fingerprint() != every.fingerprint()
    # unset fingerprints as 4 did before the key could be unset: a study made then still resumes
    assert every.fingerprint() == experiment.load(_experiment(tmp_path, workload={**WORKLOAD, "min_turns": 4})
                                                  ).fingerprint()
    four = experiment.load(_experiment(tmp_path, workload={**WORKLOAD, "min_turns": 4}))
    with pytest.raises(InputError, match="workload.min_turns.*no session of .*sessions.jsonl has that many"):
        experiment.load_workloads(four)


def test_a_session_must_end_with_a_request_named_by_line(tmp_path):
    ends_on_a_reply = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(InputError, match=r"sessions.jsonl:2.*must end with its last turn's request"):
        experiment.load(_experiment(tmp_path, lines=[SESSIONS[0], ends_on_a_reply]))


def test_the_cache_budget_is_part_of_what_a_session_study_measured(tmp_path):
    a = experiment.load(_experiment(tmp_path))
    b = experiment.load(_experiment(tmp_path, workload={**WORKLOAD, "prefix_cache_mb": 0}))
    assert a.workload.sessions and a.workload.prefix_cache_mb == 64.0 and b.workload.prefix_cache_mb == 0.0
    assert a.fingerprint() != b.fingerprint()


def _sweep(tmp_path, **sections):
    exp = experiment.load(_experiment(tmp_path, study={"n_trials": 3, "sampler": "random", "pruner": "none",
                                                       "seed": 0}, **sections))
    opts = SweepOptions(n_trials=3, storage=parse_storage("memory"), study_name="sess", tracking_uri=None,
                        progress=False)
    out = io.StringIO()
    outcome = run_sweep(exp, opts, experiment.load_workloads(exp), out=out)
    assert outcome.exit_code == 0, out.getvalue()
    return outcome.study, out.getvalue()


def test_a_session_sweep_ranks_by_session_tps_and_reports_both_objectives(tmp_path):
    study, summary = _sweep(tmp_path)
    trials = {t.number: t for t in results.completed(study)}
    base = next(t for t in trials.values() if t.user_attrs["role"] == "baseline").user_attrs
    assert base["ar_session_tps"] == base["session_tps_median"] and base["speedup_vs_ar"] == 1.0
    for t in trials.values():
        a = t.user_attrs
        assert a["exact_match"] == 1.0 and a["turns"] == 5 and a["sessions_cut"] == {}
        assert t.value == pytest.approx(a["session_tps_median"] - a["spread"])  # the objective is scored
        assert a["session_tps_median"] != a["decode_tps_median"]  # prefill is in one, not the other
        passes = 4 if a["remeasured"] else 2  # a noisy first two (a busy machine's timings) take two more
        assert len(a["session_tps_runs"]) == len(a["decode_tps_runs"]) == passes and len(a["per_session_tps"]) == 2
        assert a["speedup_vs_ar"] == pytest.approx(a["session_tps_median"] / a["ar_session_tps"])
        assert a["decode_speedup_vs_ar"] == pytest.approx(a["decode_tps_median"] / a["ar_decode_tps"])
        assert a["cached_share_later"] > 0.5 and a["ttft_first_ms"] > 0 and a["ttft_later_ms"] > 0
        s = a["per_set"]["sessions"]
        assert (s["sessions"], s["turns"]) == (2, 5) and s["session_tps_median"] > 0
        assert a["memory"]["parts"]["prefix_cache"] > 0  # planned with the turns' cache (measured on CUDA)
    w = results.winner(study)
    assert w.objective == "session_tps" and w.decode_tps is not None
    assert f"best_session_tps: {w.figures(3)['session_tps']}" in summary and "best_decode_tps:" in summary
    assert "ar_session_tps:" in summary
    report = write_report(study, tmp_path / "report")[0].read_text()
    assert "## Sessions" in report and "session tok/s (median ± spread)" in report
    assert "| TTFT first turn (ms) | TTFT later turns (ms) |" in report
    assert "prefix_cache " in report.split("## Device memory")[1]  # the winner's peak per part
    doc = export.provenance(study, w)
    assert doc["objective"] == "session_tps" and doc["session_tps"] == w.figures(4)["session_tps"]
    assert "decode_tps" in doc and "ar_session_tps" in doc


def test_without_a_prefix_cache_every_turn_is_prefilled_whole(tmp_path):
    study, _ = _sweep(tmp_path, workload={**WORKLOAD, "prefix_cache_mb": 0})
    for t in results.completed(study):
        assert t.user_attrs["cached_share_later"] == 0.0 and t.user_attrs["exact_match"] == 1.0


def test_the_serve_flag_default_is_the_engine_s():
    import engine
    from autotune.cli import build_parser

    args = build_parser().parse_args(["serve", "best.yaml"])
    assert args.prefix_cache_mb == engine.DEFAULT_PREFIX_CACHE_MB


def test_memory_is_planned_at_the_last_turn_a_session_can_send(tmp_path):
    """The longest prompt of a session workload is a whole script; the replies that replace its
    answers may each be max_new_tokens long, so the plan covers every request the replay sends."""
    import engine
    from autotune import vram
    from autotune.record import Job
    from autotune.worker import Worker

    assert vram.memory_at(100, 8, session_turns=3) == (116, 8) and vram.memory_at(100, 8) == (100, 8)
    exp = experiment.load(_experiment(tmp_path))
    w = exp.workload
    worker = Worker.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype,
                         experiment.load_workloads(exp), exp.fixed_engine)
    facts = worker.limits()
    assert facts["session_turns"] == 3
    at = vram.memory_at(facts["longest_prompt"], w.max_new_tokens, facts["session_turns"])
    replay = engine.replay_sessions(worker.pair, engine.EngineConfig(verify="ar"),
                                    [p for _, ps in worker.sessions for p in ps], w.max_new_tokens)
    longest = max(len(p) for p in replay.prompts)
    # the tiny byte-level model's replies are bytes that decode to U+FFFD, three bytes again when the next
    # turn encodes them: longer than the plan allowed, so the job plans again at what the replay sent
    assert longest > at[0]
    job = Job(trial=1, role="search", config={"verify": "ar"}, max_new_tokens=w.max_new_tokens, warmup=0,
              repeats=1, max_rel_mad=0.5, memory_at=at, prefix_cache_mb=w.prefix_cache_mb)
    rec = worker.measure(job)
    assert rec.ok and rec.exact_match == 1.0 and rec.memory["prompt_tokens"] == longest
    # the prefix cache the turns commit into is in the plan: what it keeps of every session, each one's
    # last request and answer as memory_at plans them, one generation a turn (a hybrid's checkpoints)
    ar = engine.EngineConfig(verify="ar")
    new = w.max_new_tokens
    planned, generations = worker.cache_load(new, facts["context"])
    assert generations == sum(engine.session_turns(p) for _, ps in worker.sessions for p in ps)
    assert planned == sum(vram.memory_at(n, new, t, facts["context"])[0] + new - 1 + (t - 1) * new
                          for n, t in worker._scripts())
    # a fidelity rung's job has the first sessions of each set only: its plan counts those
    full = worker.sets, worker.sessions
    worker.sets, worker.sessions = [(n, ps[:1]) for n, ps in full[0]], [(n, ps[:1]) for n, ps in full[1]]
    first, first_turns = worker.cache_load(new, facts["context"])
    worker.sets, worker.sessions = full
    assert 0 < first < planned and first_turns == sum(engine.session_turns(ps[0]) for _, ps in full[1])
    # the job planned again after its replay, from the requests it sent
    scripts = worker.sets
    worker._turn_sets(new, w.prefix_cache_mb)
    positions, again = worker.cache_load(new, facts["context"], replayed=True)
    worker.sets, worker._session_of = scripts, []  # (as measure restores them after a job)
    assert again == generations and positions > planned  # (the replies re-encoded longer, as above)
    cached = engine.plan_memory(worker.pair, ar, longest, new, prefix_cache_bytes=64 << 20,
                                prefix_cache_tokens=positions, prefix_cache_generations=generations)
    one = engine.plan_memory(worker.pair, ar, longest, w.max_new_tokens, prefix_cache_bytes=64 << 20)
    assert rec.memory["parts"]["prefix_cache"] == cached.parts["prefix_cache"] > one.parts["prefix_cache"] > 0
    assert rec.memory["total"] == cached.total
    # ... which is no less than what one cache holds after replaying them all (the shared prefixes are
    # counted once a session in the plan, once in the cache's radix tree)
    cache = engine.PrefixCache(64 << 20)
    engine.replay_sessions(worker.pair, ar, [p for _, ps in worker.sessions for p in ps], w.max_new_tokens,
                           prefix_cache=cache)
    assert 0 < cache.bytes <= cached.parts["prefix_cache"]
    # a limit the config fits without the cache but not with it: over, refused before it runs
    bare = engine.plan_memory(worker.pair, ar, longest, w.max_new_tokens).total
    over = worker.measure(dataclasses.replace(job, vram_limit=bare))
    assert over.over_vram is not None and over.session_tps_runs == []
    assert over.memory["parts"]["prefix_cache"] > 0 and over.memory["total"] > bare
    assert worker.measure(dataclasses.replace(job, prefix_cache_mb=0.0, vram_limit=bare)).over_vram is None


def test_a_session_plan_stays_within_the_context_a_replay_can_reach():
    from autotune import vram

    assert vram.memory_at(100, 8, session_turns=3, context=110) == (102, 8)  # a turn past it is cut instead
    assert vram.memory_at(100, 8, session_turns=3, context=1000) == (116, 8)
    assert vram.memory_at(100, 8, context=50) == (100, 8)  # prompts: the sweep refuses that (_check_fits)


def test_what_must_fit_the_context_is_each_session_s_first_request(tmp_path):
    """A session whose script (its later turns) outgrows the context is replayed until the turn
    that would not fit (cut and reported); only a first request that does not fit refuses the sweep."""
    import engine
    from autotune.sweep import _check_fits
    from autotune.worker import Worker

    long_tail = {"messages": [*SESSIONS[1]["messages"][:2], {"role": "user", "content": "go on " * 400}]}
    exp = experiment.load(_experiment(tmp_path, lines=[SESSIONS[0], long_tail]))
    worker = Worker.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype,
                         experiment.load_workloads(exp), exp.fixed_engine)
    facts = worker.limits()
    first = max(len(worker.pair.encode(engine.session_request(p))) for _, ps in worker.sessions for p in ps)
    assert facts["longest_first_request"] == first < facts["longest_prompt"]
    context = facts["longest_prompt"]  # the whole long script would not fit with max_new_tokens
    _check_fits(exp, {**facts, "context": context})
    with pytest.raises(InputError, match="longest session's first request"):
        _check_fits(exp, {**facts, "context": first + 1})
    with pytest.raises(InputError, match="longest prompt"):  # a prompt workload: the whole prompt must fit
        _check_fits(exp, {**facts, "session_turns": 0, "context": context})


def test_every_config_is_measured_on_the_requests_of_one_replay(tmp_path):
    """Configs whose AR twins decode on other loops (generic, runtime) answer the same requests: the
    baseline AR's replay, made once; each is exact against its own twin on them."""
    from autotune.record import Job
    from autotune.worker import Worker

    exp = experiment.load(_experiment(tmp_path, model={"target": "tiny-dense", "draft": "random", "device": "cpu",
                                                      "dtype": "float32"}))
    w = exp.workload
    worker = Worker.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype,
                         experiment.load_workloads(exp), exp.fixed_engine)
    for path in ("generic", "runtime"):
        job = Job(trial=1, role="search", config={"verify": "chain", "draft_path": path},
                  max_new_tokens=w.max_new_tokens, warmup=0, repeats=1, max_rel_mad=0.5,
                  prefix_cache_mb=w.prefix_cache_mb)
        rec = worker.measure(job)
        assert rec.ok and rec.refused is None and rec.exact_match == 1.0 and rec.turns == 5
    assert len(worker._replays) == 1
    assert len(worker._reference) == 2  # one AR twin per loop, both on the replay's requests


def test_the_cache_s_commit_is_paid_inside_session_tps(tmp_path, monkeypatch):
    """A turn's commit into the prefix cache is in the time session tok/s divides by: made slow, it
    bounds the rate (each turn's few tokens over at least the commit's time)."""
    import engine
    from autotune.record import Job
    from autotune.worker import Worker

    delay, commit = 0.2, engine.PrefixCache.commit

    def slow_commit(self, tokens):
        time.sleep(delay)
        commit(self, tokens)

    exp = experiment.load(_experiment(tmp_path))
    w = exp.workload
    worker = Worker.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype,
                         experiment.load_workloads(exp), exp.fixed_engine)
    monkeypatch.setattr(engine.PrefixCache, "commit", slow_commit)
    rec = worker.measure(Job(trial=1, role="search", config={"verify": "ar"}, max_new_tokens=w.max_new_tokens,
                             warmup=0, repeats=1, max_rel_mad=0.5, prefix_cache_mb=w.prefix_cache_mb))
    assert rec.ok and rec.turns == 5 and rec.cached_share_later > 0.5
    assert 0 < rec.session_tps_runs[0] <= w.max_new_tokens / delay  # at most 8 tokens a turn, >= 0.2 s each


def test_autotune_plan_of_a_session_experiment_plans_its_prefix_cache(tmp_path, capsys):
    import engine
    from autotune import cli
    from autotune.vram import size

    outs = {}
    for mb in (64, 0):
        (tmp_path / str(mb)).mkdir()
        path = _experiment(tmp_path / str(mb), workload={**WORKLOAD, "prefix_cache_mb": mb})
        assert cli.main(["plan", str(path)]) == 0
        outs[mb] = capsys.readouterr().out
    assert "| prefix_cache |" not in outs[0] and "prefix_cache: none budget" in outs[0]
    out = outs[64]
    assert "prefix_cache: 64.0 MiB budget (workload.prefix_cache_mb" in out
    row = next(line for line in out.splitlines() if line.startswith("| prefix_cache |"))
    summary = dict(line.split(": ", 1) for line in out.splitlines()[-9:])
    new = WORKLOAD["max_new_tokens"]
    from autotune.worker import Worker

    exp = experiment.load(tmp_path / "64" / path.name)
    worker = Worker.load(exp.model.target, exp.model.draft, "cpu", "float32", experiment.load_workloads(exp),
                         exp.fixed_engine)
    positions, generations = worker.cache_load(new, worker.limits()["context"])
    assert f"{positions:,} positions at most" in out  # every session's, not one generation's
    pair = engine.load("tiny-dense", "oracle:0.3", device="cpu", dtype="float32")
    plan = engine.plan_memory(pair, engine.EngineConfig(verify="ar"), int(summary["context"]) - new, new,
                              prefix_cache_bytes=64 << 20, prefix_cache_tokens=positions,
                              prefix_cache_generations=generations)
    assert row.split(" | ")[1] == size(plan.parts["prefix_cache"]) and plan.parts["prefix_cache"] > 0  # AR's column
    assert summary["ar_bytes"] == str(plan.total)
    bare = dict(line.split(": ", 1) for line in outs[0].splitlines()[-9:])
    assert int(bare["ar_bytes"]) == plan.total - plan.parts["prefix_cache"]


@pytest.mark.parametrize("cache_mb", [64, 0])
def test_a_session_trial_reserves_the_features_its_cache_keeps(tmp_path, monkeypatch, cache_mb):
    """With a prefix cache (it keeps every position's target features) a session trial's reserved workspace
    holds a row a position; without one, the runtime's ring (``decode.feature_rows``), as its generations do."""
    import engine
    from autotune import vram
    from autotune.record import Job
    from autotune.worker import Worker

    exp = experiment.load(_experiment(tmp_path, model={"target": "tiny-dense", "draft": "random", "device": "cpu",
                                                        "dtype": "float32"}))
    worker = Worker.load(exp.model.target, exp.model.draft, exp.model.device, exp.model.dtype,
                         experiment.load_workloads(exp), exp.fixed_engine)
    reserved = []
    real = engine.reserve_memory
    monkeypatch.setattr(engine, "reserve_memory", lambda *a, **k: reserved.append(k) or real(*a, **k))
    facts = worker.limits()
    at = vram.memory_at(facts["longest_prompt"], 8, facts["session_turns"])
    job = Job(trial=1, role="search", config={"verify": "ddtree", "budget": 3, "top_k": 2, "draft_path": "runtime"},
              max_new_tokens=8, warmup=0, repeats=1, max_rel_mad=0.5, memory_at=at, prefix_cache_mb=cache_mb)
    assert worker.measure(job).ok
    assert reserved and all(k["prefix_cache"] == (cache_mb > 0) for k in reserved)
