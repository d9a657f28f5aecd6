"""``autotune plan EXPERIMENT``: the device memory a sweep's configs need, per part, at the workload's
longest prompt plus ``max_new_tokens`` (or ``--context N``: a prompt of N - max_new_tokens), against
``model.vram_limit``, and the largest tree budget and the longest context that fit it.

Planned (``engine.plan_memory``: shapes and dtypes) on a pair of shapes only (``engine.load`` on the
meta device: a GGUF's header, a checkpoint's config and safetensors header, no weight read or
allocated; the tokenizer loads, for the prompts' lengths), so neither a GPU nor room for the weights
is needed: a 27B target plans on any machine, in the dtype it would have on the GPU, for the device
the experiment names (CUDA: its captured graphs' pool included). Three configs: the AR baseline, the
reference DDTree config, and the search space's hungriest corner (every memory-relevant choice, with the
budget and top-k at their highest). A session experiment's plans include its prefix cache
(``workload.prefix_cache_mb``), as its trials' do. A space that searches ``weights`` has them planned
per form, each on a pair held that way (the weights' bytes differ): a column per config and form, and
the summary's keys per form (``ar_bytes_native``, ``fits_native``, ...). A DFlash draft held in floats:
the reference planned again with the draft in each recipe's blocks (``DRAFT@q8_0``, ``DRAFT@q4_k_m``).
Ends with a greppable ``key: value`` summary.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from autotune import sessions as sess
from autotune import vram
from autotune.errors import InputError
from autotune.experiment import Experiment
from autotune.study import REFERENCE
from autotune.tracking import config_label
from autotune.worker import Worker

# Search dimensions that change what a config holds: every choice is planned. Budget and top-k only
# grow the tree: planned at their highest.
_CHOICES = ("verify", "draft_path", "rollback", "block_size", "grammar")
_HIGHEST = ("budget", "top_k")
MAX_CORNERS = 512  # configs planned for the space's hungriest (each plan is arithmetic: milliseconds)


@dataclass(frozen=True)
class Planned:
    """One config's plan: its label in the table and its breakdown."""

    name: str
    config: Any  # engine.EngineConfig
    plan: Any  # engine.MemoryBreakdown
    pair: Any = None  # the engine.Pair it was planned on (a weights search: the pair of its form)


def run(exp: Experiment, workloads: list[Any], context: int | None, limit: int | None,
        out: TextIO | None = None) -> None:
    """Print the plan of ``exp`` (``context``: ``--context``; ``limit``: ``--vram-limit``, else the
    experiment's ``model.vram_limit``) to ``out`` (default: ``sys.stdout`` as it is at the call)."""
    import torch

    import engine

    out = out if out is not None else sys.stdout  # (a default bound at import would outlive a replaced stdout)
    want = exp.model.device
    on_cuda = want.startswith("cuda") or (want == "auto" and torch.cuda.is_available())
    dtype = exp.model.dtype if exp.model.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    try:  # shapes only: plan_memory of the meta pair is the loaded pair's, byte for byte
        worker = Worker.load(exp.model.target, exp.model.draft, "meta", dtype, workloads, exp.fixed_engine,
                             weights=exp.model.weights)
    except engine.EngineInputError as exc:
        raise InputError(str(exp.path), "model", f"the engine refused to load the pair ({exc})") from None
    facts = worker.limits()
    new = exp.workload.max_new_tokens
    prompt = _prompt_tokens(exp, facts, context, new)
    kw = {"device": "cuda" if on_cuda else want if want != "auto" else "cpu", "dtype": getattr(torch, dtype)}
    cache_mb = exp.workload.prefix_cache_mb if exp.workload.sessions else 0.0  # a session sweep's, as its trials
    kw["prefix_cache_bytes"] = sess.cache_bytes(cache_mb)
    if cache_mb:  # one cache through every session, as a trial replays them
        kw["prefix_cache_tokens"], kw["prefix_cache_generations"] = worker.cache_load(new, facts.get("context"))
    pair = worker.pair
    plans = _plans(exp, pair, prompt, new, worker, kw)
    limit = limit if limit is not None else exp.model.vram_limit
    most = facts.get("context") or 1 << 20
    groups = _per_form(exp, worker, facts, plans, prompt, new, kw)
    plans = [p for group in groups.values() for p in group]
    weights = " and ".join(f"{f} (searched)" for f in groups if f) or exp.model.weights
    print(f"plan: {exp.name} ({exp.path})", file=out)
    print(f"model: target {exp.model.target}, draft {exp.model.draft}, weights {weights}; planned for "
          f"{kw['device']} in {dtype}", file=out)
    print(f"context: {prompt + new:,} tokens ({'--context' if context else 'longest prompt'} {prompt:,} + "
          f"max_new_tokens {new:,})", file=out)
    print(f"vram_limit: {vram.size(limit) if limit else 'none'}", file=out)
    if exp.workload.sessions:
        kept = (f"planned: what it keeps of every session, {kw['prefix_cache_tokens']:,} positions at most (a "
                "prefix sessions share counted once a session), within the budget") if cache_mb else "off"
        print(f"prefix_cache: {vram.size(kw['prefix_cache_bytes']) if cache_mb else 'none'} budget "
              f"(workload.prefix_cache_mb; {kept})", file=out)
    print("", file=out)
    _table(plans, limit, out)
    for p in plans:
        print(f"- {p.name}: `{config_label(p.config.to_dict()) if p.config.verify != 'ar' else 'verify=ar'}` "
              f"({p.plan.loop} loop)", file=out)
    print("", file=out)
    summary: dict[str, Any] = {"context": prompt + new, "vram_limit_bytes": limit}
    for form, group in groups.items():
        summary.update(_fits(group, form, prompt, new, limit, most, kw, out))
    summary.update(_draft_in_blocks(exp, plans, prompt, new, limit, kw, facts["tools"], out))
    for key, value in summary.items():
        print(f"{key}: {'none' if value is None else ('yes' if value else 'no') if isinstance(value, bool) else value}",
              file=out)


def _prompt_tokens(exp: Experiment, facts: dict[str, Any], context: int | None, new: int) -> int:
    """The prompt planned for: ``--context`` less ``max_new_tokens``, else the longest prompt; the
    whole must fit the target's context, as a sweep requires (``sweep._check_fits``)."""
    if context is not None and context <= new:
        raise InputError("--context", None, f"must be more than workload.max_new_tokens ({new}): it is a prompt "
                         "and the new tokens", context)
    most = facts.get("context")
    # (a session workload: its last request, each earlier answer a reply of up to `new` tokens, as a sweep
    # plans it, within the context: a turn past it ends its session)
    prompt = context - new if context is not None else \
        vram.memory_at(int(facts.get("longest_prompt") or 1), new, facts.get("session_turns", 0), most)[0]
    if most and prompt + new > most:
        where, key = ("--context", None) if context is not None else (str(exp.path), "workload.max_new_tokens")
        raise InputError(where, key, f"the prompt ({prompt:,} tokens) plus max_new_tokens must fit the target's "
                         f"context of {most:,} tokens ({prompt + new:,} do not)", context or new)
    return prompt


def _fits(plans: list[Planned], form: str | None, prompt: int, new: int, limit: int | None, most: int,
          kw: dict[str, Any], out: TextIO) -> dict[str, Any]:
    """Under a limit, the largest tree budget and the longest contexts that fit ``plans`` (one weight
    form's, or every plan where ``weights`` is not searched), printed; their summary keys (suffixed
    ``_<form>`` for a form)."""
    import engine

    hungriest = plans[-1]
    tree = next((p for p in reversed(plans) if p.config.verify == "ddtree"), None)
    budget = longest = None
    if limit is not None:
        if tree is not None:
            budget = engine.largest_budget(tree.pair, tree.config, prompt, new, limit, **kw)
            print(f"largest tree budget that fits{f' ({form})' if form else ''}: "
                  f"{budget if budget is not None else 'none'} (at {prompt + new:,} "
                  f"tokens, the {tree.name}'s other settings: top_k {tree.config.top_k})", file=out)
        fits = {p.name: engine.longest_context(p.pair, p.config, new, limit, most, **kw) for p in plans}
        print("longest context that fits: " + ", ".join(
            f"{name} {_tokens(n, most)}" for name, n in fits.items()), file=out)
        longest = fits[hungriest.name]
        print("", file=out)
    tail = f"_{form}" if form else ""
    return {**{f"{p.name.split()[0].lower()}_bytes{tail}": p.plan.total for p in plans},
            f"dominant{tail}": hungriest.plan.dominant,
            f"fits{tail}": None if limit is None else hungriest.plan.total <= limit,
            f"largest_budget{tail}": budget, f"longest_context{tail}": longest}


def _draft_in_blocks(exp: Experiment, plans: list[Planned], prompt: int, new: int, limit: int | None,
                     kw: dict[str, Any], tools: bool, out: TextIO) -> dict[str, Any]:
    """For a DFlash draft held in floats, what the reference would need with the draft held in each
    recipe's blocks (``model.draft: DRAFT@RECIPE``), planned as the reference is (``tools``: its prompts'
    grammar): printed, and a summary key each (``reference_bytes_draft_<recipe>``, a searched weight
    form's suffixed with it). Nothing for another draft, or one already in blocks."""
    import engine

    summary: dict[str, Any] = {}
    for reference in (p for p in plans if p.name.startswith("reference")):
        form, lines = reference.config.weights, []
        constrained = tools and reference.config.grammar != "off"
        for recipe in engine.DRAFT_RECIPES:
            pair = engine.draft_in_blocks(reference.pair, recipe)
            if pair is None:  # no DFlash draft, or one in blocks already
                return summary
            plan = engine.plan_memory(pair, reference.config, prompt, new, constrained=constrained, **kw)
            fits = "" if limit is None else (", fits" if plan.total <= limit else
                                             f", {vram.size(plan.total - limit)} over")
            draft = vram.size(plan.parts["draft_weights"])
            lines.append(f"- `draft: {pair.draft_name}`: {vram.size(plan.total)} (draft_weights {draft}{fits})")
            summary[f"reference_bytes_draft_{recipe}" + (f"_{form}" if form else "")] = plan.total
        print(f"the {reference.name} with its draft held in blocks (now {vram.size(reference.plan.total)}, "
              f"draft_weights {vram.size(reference.plan.parts['draft_weights'])}; the target verifies every token, so "
              "outputs stay AR's and acceptance may fall):", file=out)
        print("\n".join(lines) + "\n", file=out)
    return summary


def _per_form(exp: Experiment, worker: Worker, facts: dict[str, Any], plans: list[Planned], prompt: int, new: int,
              kw: dict[str, Any]) -> dict[str | None, list[Planned]]:
    """``plans`` (the loaded pair's) by weight form: ``{None: plans}`` unless the space searches
    ``weights`` where it matters (``autotune.dimensions``: a native load keeps some projection in its
    blocks); then each form's, the loaded one's named for it and the other planned on a pair held that
    way (``Worker.pair_for``: loaded as a sweep's worker loads it)."""
    from autotune import dimensions

    param = next((p for p in exp.space.params if p.name == "weights"), None)
    moot = dimensions.irrelevant(exp.space, dimensions.facts_from({"weights": facts.get("weights")}), exp.fixed_engine)
    if param is None or any(f.name == "weights" for f in moot):
        return {None: plans}
    loaded = exp.model.weights
    out: dict[str | None, list[Planned]] = {}
    for form in param.choices:
        out[form] = [Planned(f"{p.name} ({form})", p.config.replace(weights=form), p.plan, p.pair) for p in plans] \
            if form == loaded else _plans(exp, worker.pair_for(form), prompt, new, worker, kw, form)
    return out


def _plans(exp: Experiment, pair: Any, prompt: int, new: int, worker: Worker, kw: dict[str, Any],
           form: str | None = None) -> list[Planned]:
    """The AR baseline's, the reference's and the space's hungriest config's plans (the two
    speculative ones only with a draft); ``form``: on the pair holding that weight form, each config
    naming it."""
    from engine import EngineConfig, EngineInputError, plan_memory

    tools = worker.limits()["tools"]

    def planned(name: str, values: dict[str, Any]) -> Planned:
        if form is not None:
            name, values = f"{name} ({form})", {**values, "weights": form}
        cfg = EngineConfig.from_dict(values, source=name)
        return Planned(name, cfg, plan_memory(pair, cfg, prompt, new, constrained=tools and cfg.grammar != "off", **kw),
                       pair)

    fixed = exp.fixed_engine
    out = [planned("AR baseline", {**fixed, "verify": "ar"})]
    if pair.drafter is None:
        return out
    out.append(planned("reference", {**REFERENCE, **fixed}))
    corners = []
    for values in itertools.islice(_corners(exp), MAX_CORNERS):
        try:
            corners.append(planned("hungriest in the space", values))
        except EngineInputError:
            continue  # a corner the engine refuses is never a trial either
    if corners:
        out.append(max(corners, key=lambda p: p.plan.total))
    return out


def _corners(exp: Experiment) -> Iterator[dict[str, Any]]:
    """Configs of the space at every memory-relevant choice, budget and top-k at their highest."""
    options = []
    for p in exp.space.params:
        values = list(p.choices) if p.type == "categorical" else [p.high]
        if p.name in _HIGHEST:
            options.append([(p.name, max(v for v in values if v is not None))])
        elif p.name in _CHOICES:
            options.append([(p.name, v) for v in values])
    for combo in itertools.product(*options):
        yield {**exp.fixed_engine, **exp.fixed_dimension_values, **dict(combo)}


def _table(plans: list[Planned], limit: int | None, out: TextIO) -> None:
    """Bytes per part (the parts every config leaves at 0 left out), the total, and whether it fits."""
    from engine import MEMORY_PARTS

    print("| part | " + " | ".join(p.name for p in plans) + " |", file=out)
    print("|---" * (len(plans) + 1) + "|", file=out)
    for part in MEMORY_PARTS:
        if any(p.plan.parts[part] for p in plans):
            print(f"| {part} | " + " | ".join(vram.size(p.plan.parts[part]) for p in plans) + " |", file=out)
    print("| **total** | " + " | ".join(f"**{vram.size(p.plan.total)}**" for p in plans) + " |", file=out)
    if limit is not None:
        print("| fits | " + " | ".join("yes" if p.plan.total <= limit else f"no: {vram.size(p.plan.total - limit)} "
                                      "over" for p in plans) + " |", file=out)
    print("", file=out)


def _tokens(n: int | None, most: int) -> str:
    if n is None:
        return "none"
    return f"{n:,} (the target's context)" if n >= most else f"{n:,}"
