"""The VRAM budget (issue #28): ``model.vram_limit`` read as people write sizes, a sweep whose limit
is below what the largest tree needs (exactly those trials infeasible, not measured, with by how much
and which part dominates), the report's memory section and MLflow's figures, and ``autotune plan``
with its bad inputs."""

from __future__ import annotations

import io
from pathlib import Path

import optuna
import pytest
import torch
from autotune_helpers import tiny_experiment
from optuna.trial import TrialState

import engine
from autotune import cli, experiment, results, vram
from autotune import study as st
from autotune.errors import InputError
from autotune.fidelity import FidelitySpec, Rung, jobs
from autotune.record import Job
from autotune.report import write_report
from autotune.storage import parse_storage
from autotune.sweep import SweepOptions, run_sweep
from autotune.tracking import trial_metrics, trial_tags
from autotune.worker import Worker

GRID = {"budget": {"type": "categorical", "choices": [2, 4, 8, 16]}}
MODEL = {"target": "tiny-dense", "draft": "random", "device": "cpu", "dtype": "float32"}


@pytest.mark.parametrize("text,want", [("24GiB", 24 * 2**30), ("22.5GB", 22_500_000_000), ("8000MiB", 8000 * 2**20),
                                       ("1.5 TiB", 3 * 2**39), ("512kb", 512_000), ("1234", 1234), (4096, 4096)])
def test_sizes_as_people_write_them(text, want):
    assert vram.parse_size(text, "exp.yaml", "model.vram_limit") == want


@pytest.mark.parametrize("bad", ["24G", "lots", "", "2.5", "-3GiB", 0, -1, 1.5, True, "2000TiB", None])
def test_a_bad_size_names_the_key_the_rule_and_the_value(bad):
    with pytest.raises(InputError) as err:
        vram.parse_size(bad, "exp.yaml", "model.vram_limit")
    message = str(err.value)
    assert message.startswith("exp.yaml: model.vram_limit: must be a size like 24GiB") and repr(bad) in message


def test_the_limit_joins_the_fingerprint_only_when_set(tmp_path):
    plain = experiment.load(tiny_experiment(tmp_path / "a", model=MODEL))
    again = experiment.load(tiny_experiment(tmp_path / "b", model={**MODEL, "vram_limit": None}))
    limited = experiment.load(tiny_experiment(tmp_path / "c", model={**MODEL, "vram_limit": "2MiB"}))
    assert plain.model.vram_limit is None and limited.model.vram_limit == 2 * 2**20
    assert plain.fingerprint() == again.fingerprint() != limited.fingerprint()
    with pytest.raises(InputError, match=r"c2\.yaml: model\.vram_limit: must be a size like .* but got 'lots'"):
        experiment.load(tiny_experiment(tmp_path / "d", name="c2", model={**MODEL, "vram_limit": "lots"}))


def test_the_rungs_plan_where_the_full_measurement_does():
    full = Job(trial=3, role="search", config={}, max_new_tokens=64, warmup=1, repeats=3, max_rel_mad=0.1,
               memory_at=(120, 64), vram_limit=2**30)
    assert [(j.memory_at, j.vram_limit) for j in jobs(full, (Rung(1, 16),), FidelitySpec())] == [((120, 64), 2**30)] * 2


def _limit_between_budgets(tmp_path: Path) -> tuple[int, dict[int, int], tuple[int, int]]:
    """A limit between the budget 8's plan and the budget 16's, the grid's plans, and where they are
    made: the workload's longest prompt and max_new_tokens (as the sweep makes them)."""
    path = tiny_experiment(tmp_path / "probe", space=GRID, model=MODEL, engine={"top_k": 3})
    exp = experiment.load(path)
    worker = Worker.load(*[getattr(exp.model, k) for k in ("target", "draft", "device", "dtype")],
                         experiment.load_workloads(exp), exp.fixed_engine)
    at = vram.memory_at(worker.limits()["longest_prompt"], exp.workload.max_new_tokens)
    plans = {b: engine.plan_memory(worker.pair, engine.EngineConfig(budget=b, top_k=3), *at).total
             for b in GRID["budget"]["choices"]}
    return (plans[8] + plans[16]) // 2, plans, at


def test_a_limit_below_the_largest_tree_makes_exactly_those_trials_infeasible(tmp_path, capsys):
    limit, plans, _ = _limit_between_budgets(tmp_path)
    exp = experiment.load(tiny_experiment(tmp_path / "exp", space=GRID, model={**MODEL, "vram_limit": limit},
                                          engine={"top_k": 3}, study={"n_trials": 5, "sampler": "grid", "seed": 0}))
    opts = SweepOptions(n_trials=5, storage=parse_storage("memory"), study_name="vram", tracking_uri=None,
                        progress=False)
    out = io.StringIO()
    outcome = run_sweep(exp, opts, experiment.load_workloads(exp), out=out)
    study = outcome.study
    by_role = {r: [t for t in study.get_trials() if st.role_of(t) == r] for r in st.ROLES}
    # the reference (DDTree's defaults: budget 22, top-k 8) is over the limit too: a yardstick that
    # does not fit fails, with the reason
    (ref,) = by_role["reference"]
    assert ref.state == TrialState.FAIL and "not measured, over the memory limit" in ref.user_attrs["fail_reason"]
    search = {t.params["budget"]: t for t in by_role["search"]}
    assert sorted(search) == [2, 4, 8, 16] and all(t.state == TrialState.COMPLETE for t in search.values())
    over = search[16]
    assert over.constraints["vram"] == pytest.approx((plans[16] - limit) / limit) and plans[16] > limit
    assert over.value == 0.0 and "decode_tps_runs" not in over.user_attrs  # refused on its plan: never measured
    reason = over.user_attrs["over_vram"]
    assert f"planned peak {vram.size(plans[16])} is {vram.size(plans[16] - limit)} over model.vram_limit" in reason
    assert "dominates" in reason and over.user_attrs["memory"]["dominant"] in reason
    for b in (2, 4, 8):  # measured, exact, and within the limit by their plan (on a CPU the peak is planned)
        t = search[b]
        assert t.constraints["vram"] <= 0 and t.constraints["exactness"] <= 0 and t.user_attrs["decode_tps_runs"]
        assert t.user_attrs["peak_memory_kind"] == "planned" and t.user_attrs["peak_memory_bytes"] == plans[b]
        assert t.user_attrs["memory"]["parts"]["kv_cache"] > 0 and t.user_attrs["vram_limit_bytes"] == limit
    (base, *_) = by_role["baseline"]
    assert base.state == TrialState.COMPLETE and base.user_attrs["memory"]["parts"]["features"] == 0  # AR: no draft
    assert results.over_vram(study) == [over] and results.infeasible(study) == []
    assert results.winner(study).trial != over.number
    assert "trials_over_vram: 1" in out.getvalue() and "trials_infeasible: 0" in out.getvalue()
    assert f"trial {over.number} OVER VRAM: planned peak" in capsys.readouterr().err

    report = write_report(study, tmp_path / "report")[0].read_text()
    assert "## Device memory" in report and f"Limit: {vram.size(limit)}" in report
    assert "**1 trial(s) over the limit**" in report and f"| {over.number} | {vram.size(plans[16])} |" in report
    assert "1 over the memory limit" in report
    metrics, tags = trial_metrics(search[4]), trial_tags(over, {})
    assert metrics["vram_limit_bytes"] == limit and metrics["memory.kv_cache"] > 0
    assert metrics["peak_memory_bytes"] == plans[4]
    assert tags["over_vram"] == reason and tags["peak_memory_kind"] == "planned" and tags["feasible"] == "False"
    assert study.user_attrs["model"]["vram_limit"] == limit  # the parent run's param model.vram_limit


def test_a_measured_peak_over_the_limit_is_infeasible_with_the_reason():
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    memory = {"kind": "measured", "total": 30 * 2**30, "dominant": "target_weights", "prompt_tokens": 100,
              "new_tokens": 50, "loop": "graphs", "parts": {"target_weights": 20 * 2**30, "kv_cache": 10 * 2**30}}
    reason = vram.record(trial, memory, 24 * 2**30)
    assert reason == ("measured peak 30.00 GiB is 6.00 GiB over model.vram_limit 24.00 GiB; target_weights "
                      "dominates (20.00 GiB)")
    study.tell(trial, 123.0)
    (t,) = study.get_trials()
    assert not results.feasible(t) and t.constraints == {"vram": 0.25}
    assert vram.record(study.ask(), memory, None) is None  # no limit: recorded, never over


def test_the_report_sets_each_measured_peak_beside_its_plan():
    """The bar's "plan within 10% of the measured peaks", read off the report: every trial measured on CUDA
    with its plan, the gap signed, the widest named; planned-only trials (a CPU's, one refused on its plan)
    are not in the table."""
    from autotune.report import _memory

    def told(number: int, budget: int, kind: str, total: int, planned: int | None):
        memory = {"kind": kind, "total": total, "dominant": "target_weights", "parts": {"target_weights": total},
                  **({"planned_total": planned} if planned else {})}
        return optuna.trial.create_trial(value=100.0, user_attrs={
            "role": "search", "config": {"verify": "ddtree", "budget": budget}, "memory": memory})

    study = optuna.create_study(direction="maximize")
    study.add_trial(told(0, 8, "measured", 1000 * 2**20, 1020 * 2**20))
    study.add_trial(told(1, 32, "measured", 1000 * 2**20, 930 * 2**20))
    study.add_trial(told(2, 64, "planned", 1100 * 2**20, None))
    study.add_trial(told(3, 16, "measured", 1000 * 2**20, None))  # measured without a plan (an older study's)
    text = "\n".join(_memory(study, None))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "search" in line]
    assert len(rows) == 2 and rows[0].startswith("| 0 | search |") and rows[1].startswith("| 1 | search |")
    assert rows[0].endswith("| 1000.0 MiB | 1020.0 MiB | +2.0% |") and rows[1].endswith("| -7.0% |")
    assert "within **7.0%** of the measured peak on all 2 measured trial(s)" in text
    study2 = optuna.create_study(direction="maximize")
    study2.add_trial(told(0, 64, "planned", 1100 * 2**20, None))
    assert "Planned against measured" not in "\n".join(_memory(study2, None))


def _plan(tmp_path, capsys, *flags, **model) -> tuple[int, str, str]:
    path = tiny_experiment(tmp_path, model={**MODEL, **model})
    code = cli.main(["plan", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_autotune_plan_prints_every_part_and_what_fits(tmp_path, capsys):
    limit, _, at = _limit_between_budgets(tmp_path)
    code, out, _ = _plan(tmp_path / "exp", capsys, vram_limit=limit)
    assert code == 0 and "planned for cpu in float32" in out
    for part in ("target_weights", "draft_weights", "kv_cache", "features", "draft_context", "activations"):
        assert f"| {part} |" in out
    assert "| fits | yes | no:" in out  # AR fits, the reference (budget 22) does not
    assert "largest tree budget that fits: " in out and "longest context that fits: AR baseline" in out
    summary = dict(line.split(": ", 1) for line in out.splitlines()[-11:])
    assert summary["vram_limit_bytes"] == str(limit) and summary["context"] == str(sum(at))
    pair = engine.load("tiny-dense", "random", device="cpu", dtype="float32")
    budget = engine.largest_budget(pair, engine.EngineConfig(top_k=8), *at, limit)
    assert summary["largest_budget"] == str(budget) and 8 <= budget < 16  # the grid's 8 fits, 16 does not
    # the reference again with the draft in blocks: what a pair loaded so plans (its draft's weights fewer
    # bytes; on the CPU its context fill dequantizes a weight whole, a transient the floats have not)
    assert "the reference with its draft held in blocks" in out
    floats = engine.plan_memory(pair, engine.EngineConfig(), *at).parts["draft_weights"]
    for recipe in ("q8_0", "q4_k_m"):
        held = engine.load("tiny-dense", f"random@{recipe}", device="cpu", dtype="float32")
        planned = engine.plan_memory(held, engine.EngineConfig(), *at)
        assert summary[f"reference_bytes_draft_{recipe}"] == str(planned.total)
        assert planned.parts["draft_weights"] < floats / 2
        assert f"- `draft: random@{recipe}`: {vram.size(planned.total)}" in out
    code, out, _ = _plan(tmp_path / "ctx", capsys, "--context", "300")
    assert code == 0 and "context: 300 tokens (--context 292 + max_new_tokens 8)" in out
    assert "vram_limit: none" in out and "largest_budget: none" in out


@pytest.mark.parametrize("model", [
    {"device": "cpu", "dtype": "float32", "weights": "dequantized", "vram_limit": "3MiB"},
    {"device": "cuda", "dtype": "bfloat16", "weights": "native", "vram_limit": "2MiB"},  # planned for CUDA anywhere
])
def test_autotune_plan_reads_no_weights_and_prints_what_a_loaded_pair_plans(tmp_path, capsys, monkeypatch, model):
    """A quantized Qwen3.5 GGUF target: the plan is made from the file's header (reading any tensor's
    data fails the test), and prints what the pair loaded on the CPU plans, line for line."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tests.engine.gguf_files import bpe_tokenizer, headers_only, tiny_hf, write_gguf

    Q = gguf.GGMLQuantizationType
    folder = tmp_path / "exp"
    folder.mkdir()
    write_gguf(folder / "target.gguf", tiny_hf("qwen35"), "qwen35", Q.Q4_K, tokenizer=bpe_tokenizer(),
               qtypes={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K})
    path = tiny_experiment(folder, model={"target": "target.gguf", "draft": "random", **model},
                           measure={"warmup": 1, "repeats": 2, "max_rel_mad": 0.5})  # (CUDA: a warm-up pass)
    # plain prompts, one long: the file has no chat template for the helper's chat line
    (folder / "prompts.jsonl").write_text('{"prompt": "the sea of day is"}\n{"prompt": "%s"}\n' % ("the map " * 40))

    def plan() -> tuple[int, str, str]:
        code = cli.main(["plan", str(path)])
        return code, *capsys.readouterr()

    with monkeypatch.context() as patched:
        headers_only(patched)
        code, planned, err = plan()
    assert code == 0 and "| fits | " in planned and "longest context that fits: " in planned, err

    load = Worker.load.__func__

    def on_the_cpu(cls, target, draft, device, *args, **kw):
        assert device == "meta"  # what the plan asks for; loaded here instead
        return load(cls, target, draft, "cpu", *args, **kw)

    monkeypatch.setattr(Worker, "load", classmethod(on_the_cpu))
    code, loaded, _ = plan()
    assert code == 0 and planned == loaded


@pytest.mark.parametrize("flags,model,message", [
    (["--context", "abc"], {}, "--context: must be a whole number of tokens, at least 2, but got 'abc'"),
    (["--context", "8"], {}, "--context: must be more than workload.max_new_tokens (8): it is a prompt and the new "
                             "tokens, but got 8"),
    (["--context", "100000"], {}, "--context: the prompt (99,992 tokens) plus max_new_tokens must fit the target's "
                                  "context of 4,096 tokens"),
    (["--vram-limit", "24G"], {}, "--vram-limit: must be a size like 24GiB"),
    ([], {"vram_limit": "-1GiB"}, "model.vram_limit: must be a size like 24GiB"),
    ([], {"vram_limit": [24]}, "model.vram_limit: must be a size like 24GiB"),
])
def test_autotune_plan_bad_input_exits_2_naming_it(tmp_path, capsys, flags, model, message):
    code, out, err = _plan(tmp_path, capsys, *flags, **model)
    assert code == 2 and out == "" and message in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_each_trial_records_its_measured_peak_beside_its_plan(tmp_path):
    exp = experiment.load(tiny_experiment(tmp_path, space=GRID, engine={"top_k": 3},
                                          model={**MODEL, "device": "cuda", "vram_limit": "8GiB"},
                                          study={"n_trials": 4, "sampler": "grid", "seed": 0}))
    opts = SweepOptions(n_trials=4, storage=parse_storage("memory"), study_name="vram-cuda", tracking_uri=None,
                        progress=False)
    study = run_sweep(exp, opts, experiment.load_workloads(exp), out=io.StringIO()).study
    done = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert len(done) >= 5 and not results.over_vram(study)
    for t in done:
        m = t.user_attrs["memory"]
        assert m["kind"] == t.user_attrs["peak_memory_kind"] == "measured" and m["planned_total"] > 0
        assert t.user_attrs["peak_memory_bytes"] == m["total"] >= m["parts"]["target_weights"] > 0
        print(f"trial {t.number} ({st.role_of(t)}): measured {m['total']:,} B, planned {m['planned_total']:,} B")


def test_the_confirmation_re_measures_each_config_at_the_trials_memory_position(tmp_path):
    """Each re-measured config reserves its own buffers at the length its trial had (Job.memory_at),
    not whatever the last trial left reserved."""
    from autotune.executors.local import LocalExecutor

    seen: list[tuple[str, tuple[int, int] | None]] = []

    class Recording(Worker):
        def measure(self, job, on_first_pass=None, on_progress=None):
            seen.append((job.role, job.memory_at))
            return super().measure(job, on_first_pass, on_progress)

    exp = experiment.load(tiny_experiment(tmp_path, space=GRID, model=MODEL, engine={"top_k": 3},
                                          study={"n_trials": 3, "sampler": "grid", "seed": 0}))
    workloads = experiment.load_workloads(exp)
    executor = LocalExecutor(lambda: Recording.load(exp.model.target, exp.model.draft, exp.model.device,
                                                    exp.model.dtype, workloads, exp.fixed_engine))
    opts = SweepOptions(n_trials=3, storage=parse_storage("memory"), study_name="conf", tracking_uri=None,
                        progress=False)
    outcome = run_sweep(exp, opts, workloads, executor=executor, out=io.StringIO())
    assert outcome.study.user_attrs["confirmation"]["candidates"]
    positions = {at for _, at in seen}
    assert len(positions) == 1 and None not in positions  # the trials' and the confirmation's alike
    assert [role for role, _ in seen].count("confirm") >= 2
