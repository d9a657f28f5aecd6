"""The engine contract autotune relies on: load a pair once, bench configs on it many times."""

from __future__ import annotations

import json
import resource
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.config import EngineConfig, EngineInputError
from engine.decoding import runtime
from engine.decoding.decode import generate, measure_step_costs
from engine.decoding.drafters import DFlashDrafter, Drafter
from engine.decoding.grammar import CompiledGrammar, GrammarVocab, compile_tool_grammar
from engine.decoding.loop import Workspace
from engine.decoding.policy import StepCosts
from engine.decoding.prefix_cache import PrefixCache
from engine.decoding.stats import (
    PHASES,
    BenchResult,
    Divergence,
    Generation,
    PromptResult,
    SessionReplay,
    first_divergence,
)
from engine.registry import load_drafter, load_target, resolve_device, resolve_dtype


class PromptIds(list):
    """A prompt's token ids that remember the prompt's tools (``Pair.encode`` of a chat with tools),
    so ``bench`` can serve each prompt with its own tool-call grammar."""

    tools: tuple[dict[str, Any], ...] | None = None


@dataclass
class Pair:
    """A loaded target + drafter, their tokenizer, and reusable decode buffers."""

    target: nn.Module
    drafter: Drafter | None
    tokenizer: Any
    target_name: str
    draft_name: str
    device: str
    dtype: str
    weights: str = "dequantized"  # as loaded: "native" keeps a GGUF's quantized projections in their blocks
    _workspace: Workspace | None = field(default=None, repr=False)
    _grammar_vocab: GrammarVocab | None = field(default=None, repr=False)
    _grammars: dict[str, CompiledGrammar] = field(default_factory=dict, repr=False)
    _step_costs: dict[tuple, StepCosts] = field(default_factory=dict, repr=False)

    def weight_summary(self) -> dict:
        """How the target holds its weights, as plain data for reports (``quant.weights_summary``):
        which tensors stay in their GGUF blocks and in which format, which are held as floats (and
        their type in the file), what ``native`` could not keep, and the bytes stored."""
        from engine.models.quant import weights_summary

        return weights_summary(self.target, self.weights)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.tokenizer, "stop_ids", ()) or ())

    def check_shape(self) -> None:
        """A draft made for another target is refused before any generation."""
        draft = getattr(self.drafter, "draft", None)
        if draft is None:
            return
        tc, dc = self.target.cfg, draft.cfg
        if dc.hidden_size != tc.hidden_size:
            raise EngineInputError(
                f"draft {self.draft_name!r} has hidden_size {dc.hidden_size}, but target {self.target_name!r} "
                f"has hidden_size {tc.hidden_size}: the draft was made for another target"
            )
        if dc.vocab_size != tc.vocab_size:
            raise EngineInputError(
                f"draft {self.draft_name!r} has vocab_size {dc.vocab_size}, but target {self.target_name!r} "
                f"has vocab_size {tc.vocab_size}: the draft was made for another target"
            )
        bad = [i for i in dc.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
        if bad:
            raise EngineInputError(
                f"draft {self.draft_name!r} reads target layers {bad}, but target {self.target_name!r} "
                f"has {tc.num_hidden_layers} layers"
            )

    def workspace(self, max_len: int, feature_dim: int, feature_rows: int | None = None) -> Workspace:
        """Static buffers, allocated once and grown only when a longer generation needs them.
        ``feature_rows``: the target features as a ring of that many rows (position p at row p mod the
        rows: ``decode.feature_rows``), where None keeps a row a position; a workspace with a row a
        position serves a ring's generation too (its positions never wrap)."""
        if self.target.device.type == "meta":  # every generation, its cost measurement and reserve_memory start here
            raise EngineInputError(f"the pair {self.target_name!r} + {self.draft_name!r} is on the meta device "
                                   "(shapes only, to plan memory on): it holds no weights to decode with; load it "
                                   "on cpu or cuda")
        ws = self._workspace
        feats_ok = not feature_dim or (ws is not None and ws.features is not None
                                        and ws.features.shape[1] == feature_dim
                                        and ws.features.shape[0] in (ws.max_len, feature_rows))
        if ws is None or ws.max_len < max_len or not feats_ok:
            # grown: doubled (a workload's longer generations); long enough, its features held otherwise (a ring
            # or a row a position: decode.feature_rows): the same length again
            size = max(max_len, (2 if ws.max_len < max_len else 1) * ws.max_len) if ws else max_len
            dev = self.target.device
            rows = size if feature_rows is None else min(feature_rows, size)
            feats = torch.zeros(rows, feature_dim, device=dev, dtype=self.target.dtype) if feature_dim else None
            ws = Workspace(self.target.new_cache(size), torch.zeros(size, dtype=torch.long, device=dev), feats, size)
            self._workspace = ws
        ws.cache.reset()
        return ws

    def step_costs(self, config: EngineConfig, prompt: Sequence[int] = (), costs: StepCosts | None = None,
                   use_runtime: bool | None = None) -> StepCosts:
        """The adaptive policy's step cost table (``engine.decoding.policy.StepCosts``) for ``config``
        on this pair and device: ``costs`` if given (kept for later generations of configs that cost
        alike), else the one kept, else measured now on ``prompt`` (``decode.measure_step_costs``:
        a few short generations per budget, outside any generation's timed decode). Kept per decode
        loop: ``use_runtime`` (default: the loop ``config`` takes without a grammar; a generation
        under a grammar the runtime refuses runs the generic loop, whose steps cost otherwise)."""
        if use_runtime is None:
            use_runtime = runtime.loop_for(self, config, False) != "generic"
        key = (config.budget, config.top_k, config.policy_levels, config.block_size, config.chain_seed,
               config.target_feat_ctx, config.rollback, config.draft_path, config.kernels,
               config.temperature > 0, use_runtime)
        if costs is not None:
            self._step_costs[key] = costs
        elif key not in self._step_costs:
            if not prompt:
                raise EngineInputError("the adaptive policy's step costs are measured on a prompt: none was given")
            self._step_costs[key] = measure_step_costs(self, config, prompt, use_runtime=use_runtime)
        return self._step_costs[key]

    def grammar_for(self, tools: Sequence[dict[str, Any]] | None) -> CompiledGrammar | None:
        """The tool-call grammar of ``tools`` for this pair's vocabulary (compiled once per tool set);
        ``None`` without tools: such a prompt is decoded unconstrained."""
        if not tools:
            return None
        if self.tokenizer is None:
            raise EngineInputError(f"target {self.target_name!r} has no tokenizer: a grammar needs its vocabulary")
        key = json.dumps(list(tools), sort_keys=True)
        if key not in self._grammars:
            if self._grammar_vocab is None:
                self._grammar_vocab = GrammarVocab(self.tokenizer, self.stop_ids)
            self._grammars[key] = compile_tool_grammar(self._grammar_vocab, tools)
        return self._grammars[key]

    def refusal(self, config: EngineConfig, constrained: bool = False) -> str | None:
        """Why ``config`` cannot run on this pair as asked (None: it can): it names weights the pair
        does not hold (``EngineConfig.weights``), or ``draft_path="runtime"`` where the runtime cannot
        run it (``engine.decoding.runtime.refusal``). ``constrained``: a prompt has a grammar that
        ``config`` places."""
        from engine.decoding import runtime

        if config.weights is not None and config.weights != self.weights:
            return (f"weights={config.weights}: this pair holds its target's weights {self.weights} (load it with "
                    f"weights={config.weights!r})")
        return runtime.refusal(self, config, constrained) if config.draft_path == "runtime" else None

    def grammar_of(self, prompt: Sequence[int], config: EngineConfig) -> CompiledGrammar | None:
        """The grammar ``bench`` decodes ``prompt`` under unless told otherwise: the tool-call grammar
        of the prompt's tools (``Pair.encode`` of a chat with tools) where ``config`` places one."""
        return None if config.grammar == "off" else self.grammar_for(getattr(prompt, "tools", None))

    def decode_paths(self, config: EngineConfig, constrained: bool = False) -> tuple[str, str]:
        """(loop, kernels) that ``config`` decodes with on this pair: the loop ``generic``,
        ``runtime`` or ``graphs`` (GenerationStats.loop), the kernels ``fused`` or ``eager`` as they
        run here (the Triton kernels on CUDA only). Configs with equal paths round alike. A config
        the runtime refuses (``draft_path="runtime"``, ``refusal``) raises ``EngineInputError``."""
        from engine.decoding import runtime
        from engine.models import fused

        on_cuda = self.target.device.type == "cuda"
        loop = runtime.loop_for(self, config, constrained)
        kernels = "fused" if config.kernels == "fused" and on_cuda and fused.kernels_enabled() else "eager"
        return loop, kernels

    def ar_twin(self, config: EngineConfig, constrained: bool = False) -> EngineConfig:
        """AR decoded the way ``config`` decodes here (its loop and kernels): the reference a
        speculative config is exact against, since in bf16 two loops round differently. The loop is
        the one ``config`` takes, not the one it names: under ``draft_path="auto"`` a config the
        runtime refuses (a host-side draft, a hybrid target's replay rollback) runs the generic
        loop, and so must its AR, where ``auto`` would give AR the graphs."""
        loop, _ = self.decode_paths(config, constrained)
        return config.replace(verify="ar", draft_path="generic" if loop == "generic" else "runtime")

    def encode(self, prompt: Any) -> list[int]:
        """A workload prompt (text, or messages + tools through the chat template) -> token ids."""
        if self.tokenizer is None:
            raise EngineInputError(
                f"target {self.target_name!r} has no tokenizer: give prompts as token ids (--prompt-ids)"
            )
        messages = getattr(prompt, "messages", None)
        if messages:
            text = self.tokenizer.render_chat(messages, getattr(prompt, "tools", None))
        else:
            text = prompt if isinstance(prompt, str) else prompt.text
        ids = self.tokenizer.encode(text)
        if not ids:
            raise EngineInputError("prompt encodes to no tokens")
        tools = getattr(prompt, "tools", None)
        if messages and tools:
            ids = PromptIds(ids)
            ids.tools = tuple(tools)
        return ids


def load(target: str, draft: str, device: str = "auto", dtype: str = "auto", weights: str = "dequantized") -> Pair:
    """Build or read the target and its drafter once; everything after that is cheap to repeat.
    A plans file (``ENGINE_LINEAR_PLANS``) is read here, so that a bad one stops before any work.
    ``weights``: ``"dequantized"`` (every GGUF tensor into ``dtype``, as ever) or ``"native"`` (a GGUF
    target's quantized projections kept in their blocks and dequantized per call:
    ``gguf_loading.load_target_gguf`` says which; ``Pair.weight_summary`` reports it).

    ``device="meta"``: the pair of shapes and dtypes only, to plan memory on (``plan_memory`` with
    the device it would run on; ``weight_summary``; the tokenizer loads as ever): no weight is read
    or allocated (a GGUF's header, a safetensors header, a preset's config), so a 27B target plans
    on any machine. Its ``plan_memory`` is byte for byte a real load's, in the same
    ``dtype`` (``auto`` is float32 there: give the dtype it would run in). It cannot decode."""
    from engine.models import linear

    dev = torch.device("meta") if device == "meta" else resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        linear.file_plans()
    except ValueError as exc:
        raise EngineInputError(str(exc)) from None
    model, tokenizer = load_target(target, dev, dt, weights)
    drafter = load_drafter(draft, model, tokenizer, dev, dt)
    pair = Pair(model, drafter, tokenizer, target, draft, str(dev), str(dt).removeprefix("torch."), weights=weights)
    pair.check_shape()
    return pair


def draft_in_blocks(pair: Pair, recipe: str) -> Pair | None:
    """``pair`` with its DFlash draft loaded again held in ``recipe``'s GGUF blocks (the spec
    ``DRAFT@RECIPE``: ``registry.draft_recipe``; recipes ``DRAFT_RECIPES``), on the pair's device and in its
    dtype (on the meta device: a plan's pair, nothing read or allocated); the target is shared. None where
    the pair has no DFlash draft, or holds one in blocks already."""
    from engine.registry import draft_recipe, load_drafter

    if not isinstance(pair.drafter, DFlashDrafter) or draft_recipe(pair.draft_name)[1] is not None:
        return None
    spec = f"{pair.draft_name}@{recipe}"
    drafter = load_drafter(spec, pair.target, pair.tokenizer, pair.target.device, pair.target.dtype)
    return Pair(pair.target, drafter, pair.tokenizer, pair.target_name, spec, pair.device, pair.dtype,
                weights=pair.weights)


def diagnose(pair: Pair, config: EngineConfig, prompt: Sequence[int], output: Sequence[int],
             reference: Sequence[int], ignore_eos: bool = False, grammar: CompiledGrammar | None = None,
             ar_config: EngineConfig | None = None) -> Divergence | None:
    """Why ``output`` (``config``'s tokens for ``prompt``) differs from ``reference`` (AR's), or None
    where they are equal.

    AR (``ar_config``: by default ``Pair.ar_twin(config)``, the loop and kernels it decodes
    with) and ``config`` are decoded again up to the first divergence with ``record_margins`` (both
    deterministic; the reference is tokens only, so AR's margin needs the re-run), under the same
    ``grammar`` and ``ignore_eos`` as the compared outputs. Each run's margin is that of the logits
    row that picked its token at the divergence; the verdict follows ``Divergence.judge``.
    """
    position = first_divergence(output, reference)
    if position is None:
        return None
    ar_config = ar_config or pair.ar_twin(config, grammar is not None and config.grammar != "off")
    n = position + 1
    ar, run = (generate(pair, list(prompt), cfg, n, ignore_eos=ignore_eos, grammar=grammar, record_margins=True)
               for cfg in (ar_config, config))
    reproduced = ar.tokens == list(reference[:n]) and run.tokens == list(output[:n])
    return Divergence.judge(position, _row_at(ar, position), _row_at(run, position), pair.target.dtype,
                            reproduced)


def _row_at(gen: Generation, position: int) -> tuple[float, float] | None:
    """(top logit, margin) of the row that picked ``gen``'s token at ``position``; None past its end."""
    return (gen.top_logits[position], gen.margins[position]) if position < len(gen.tokens) else None


def bench(
    pair: Pair,
    config: EngineConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    reference: Sequence[Sequence[int]] | None = None,
    ignore_eos: bool = False,
    grammars: Sequence[CompiledGrammar | None] | None = None,
    ar_config: EngineConfig | None = None,
    on_prompt: Callable[[int, int], None] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> BenchResult:
    """One measured pass of ``config`` over ``prompts``; caches reset between generations.

    ``reference`` (AR outputs for the same prompts) turns on the per-prompt exactness check; a
    prompt that differs gets ``PromptResult.divergence`` (``diagnose``, after the pass: outside the
    measured time and the peak memory; ``ar_config``: the AR config that produced ``reference``,
    by default ``Pair.ar_twin(config)``).
    ``grammars`` (one per prompt, ``None`` = unconstrained) apply when ``config.grammar != "off"``;
    left out, each prompt that remembers its tools (``Pair.encode`` of a chat with tools) gets its
    tool-call grammar (compiled before the pass, outside the measured time).
    ``on_prompt(done, total)`` is called after each generation, outside its timed decode (a
    progress display: ``autotune sweep``'s bar shows the prompt a trial is on).
    ``prefix_cache``: one cache through the pass, as a server keeps it: each prompt reuses what the
    earlier ones left (a session's turns, ``replay_sessions``); ``PromptResult.cached_tokens`` says how
    much, ``PromptResult.commit_s`` what keeping each prompt and output in it took (inside its
    ``total_s``), ``BenchResult.prefix_cache_bytes`` the most it held. Without it every prompt is
    prefilled whole.
    """
    if reference is not None and len(reference) != len(prompts):
        raise EngineInputError(f"reference has {len(reference)} outputs for {len(prompts)} prompts")
    if grammars is not None and len(grammars) != len(prompts):
        raise EngineInputError(f"grammars has {len(grammars)} entries for {len(prompts)} prompts")
    if config.grammar == "off":
        grammars = [None] * len(prompts)
    elif grammars is None:
        grammars = [pair.grammar_of(p, config) for p in prompts]
    cuda = pair.target.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    gens: list[Generation] = []
    results: list[PromptResult] = []
    held = 0  # the most the prefix cache held after a generation
    for i, prompt in enumerate(prompts):
        g = generate(pair, list(prompt), config, max_new_tokens, ignore_eos=ignore_eos, grammar=grammars[i],
                     prefix_cache=prefix_cache)
        gens.append(g)
        div = first_divergence(g.tokens, reference[i]) if reference is not None else None
        results.append(PromptResult(
            index=i, prompt_tokens=len(prompt), new_tokens=g.stats.new_tokens, decode_s=g.stats.decode_s,
            total_s=g.stats.total_s, decode_tps=g.stats.decode_tps, acceptance_length=g.stats.acceptance_length,
            steps=g.stats.steps, exact=None if reference is None else div is None, first_divergence=div,
            cached_tokens=g.stats.cached_tokens, ttft_s=g.stats.prefill_s, commit_s=g.stats.commit_s,
        ))
        if prefix_cache is not None:
            held = max(held, prefix_cache.bytes)
        if on_prompt is not None:
            on_prompt(i + 1, len(prompts))
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for r, g in zip(results, gens, strict=True):
        if r.first_divergence is not None:
            r.divergence = diagnose(pair, config, prompts[r.index], g.tokens, reference[r.index], ignore_eos,
                                    grammars[r.index], ar_config)
    return BenchResult(
        config=config.to_dict(),
        prompts=results,
        outputs=[g.tokens for g in gens],
        new_tokens=sum(g.stats.new_tokens for g in gens),
        decode_s=sum(g.stats.decode_s for g in gens),
        total_s=sum(g.stats.total_s for g in gens),
        steps=sum(g.stats.steps for g in gens),
        accept_lengths=[a for g in gens for a in g.stats.accept_lengths],
        phase_ms={k: sum(g.stats.phase_ms[k] for g in gens) for k in PHASES},
        bonus_tokens=sum(g.stats.bonus_tokens for g in gens),
        correction_tokens=sum(g.stats.correction_tokens for g in gens),
        side_branch_steps=sum(g.stats.side_branch_steps for g in gens),
        peak_memory_bytes=int(peak),
        device=pair.device,
        grammar_ms=sum(g.stats.grammar_ms for g in gens),
        constrained=sum(g is not None for g in grammars),
        loops=dict(Counter(g.stats.loop for g in gens)),
        step_budgets=[b for g in gens for b in g.stats.step_budgets],
        predicted_al=[a for g in gens for a in g.stats.predicted_al],
        prefix_cache_bytes=held,
    )


def replay_sessions(pair: Pair, config: EngineConfig, sessions: Sequence[Any], max_new_tokens: int,
                    prefix_cache: PrefixCache | None = None,
                    on_turn: Callable[[int, int], None] | None = None) -> SessionReplay:
    """Multi-turn sessions (``engine.data.sessions``) replayed as a client drives a server: each turn
    sends the whole conversation so far, ``config``'s own earlier replies in place of the script's
    assistant messages (as text, the way the server returns them), decoded under the session's
    tool-call grammar where ``config`` places one, through ``prefix_cache`` if given (one cache for
    every turn and session, as a server keeps it). A turn whose request and ``max_new_tokens`` would
    outgrow the target's context ends its session (``SessionReplay.cut`` says where), as a server
    refuses it. ``on_turn(session, turns)`` is called after each session.

    The requests depend on the replies, so the AR replay fixes them: a sweep replays AR once and
    measures every config on AR's requests (``bench`` of ``SessionReplay.prompts`` with one prefix
    cache), which are a speculative config's own wherever it is exact.
    """
    from engine.data.sessions import check_session, request_prompt, turns
    from engine.serving.text import TextStream

    context = getattr(getattr(pair.target, "cfg", None), "max_position_embeddings", None)
    out = SessionReplay()
    for s, session in enumerate(sessions):
        check_session(session, f"session {s}")
        replies: list[str] = []
        for t in range(turns(session)):
            ids = pair.encode(request_prompt(session, replies))
            if context is not None and len(ids) + max_new_tokens > context:
                out.cut[s] = (f"turn {t + 1}: {len(ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed the "
                              f"target's context of {context}")
                break
            g = generate(pair, ids, config, max_new_tokens, grammar=pair.grammar_of(ids, config),
                         prefix_cache=prefix_cache)
            stream = TextStream(pair.tokenizer.decode, pair.stop_ids, ())
            stream.push(g.tokens)
            stream.finish()
            replies.append(stream.text)
            out.prompts.append(ids)
            out.outputs.append(g.tokens)
            out.replies.append(stream.text)
            out.session_of.append(s)
        if on_turn is not None:
            on_turn(s + 1, len(sessions))
    return out
