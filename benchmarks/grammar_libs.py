"""Pick the grammar library: xgrammar vs llguidance vs outlines-core on the SmolLM2 vocabulary (CPU).

For the tool-call grammar of each of N agent prompts (BFCL tools), every library:
- compiles the grammar (ms, once per tool set);
- walks a reference answer (a schema-valid tool call per tool, rendered as our chat template renders
  tool calls, encoded with our tokenizer), and at every token computes the next-token mask (µs)
  and advances (µs); the reference token must be allowed (exactness), and the libraries' masks
  must agree bit for bit where they are compared (same language, same vocabulary);
- rolls back a few tokens (µs), which a tree walk needs.

Run: pip install llguidance==1.9.1 outlines-core==0.2.14  (not project dependencies; xgrammar is)
     python benchmarks/grammar_libs.py --n-prompts 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import engine
from engine.data.workloads import load_workload
from engine.decoding.grammar import call_schema, example_call, vocab_bytes


def _xgrammar(tok_bytes, stops, vocab, schema):
    import xgrammar as xgr

    info = xgr.TokenizerInfo([b if b is not None else "" for b in tok_bytes], xgr.VocabType.RAW,
                             vocab_size=vocab, stop_token_ids=list(stops))
    t0 = time.perf_counter()
    js = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    ebnf = js.replace("root ::=", "call ::=", 1) + '\nroot ::= ("<tool_call>\\n" call "\\n</tool_call>" "\\n"?)+\n'
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(ebnf)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    m = xgr.GrammarMatcher(compiled)
    bm = xgr.allocate_token_bitmask(1, vocab)

    def mask():
        m.fill_next_token_bitmask(bm)
        return bm[0]

    return compile_ms, mask, m.accept_token, m.rollback


# llguidance's %json defaults to flexible whitespace; this is xgrammar's any_whitespace=False.
_COMPACT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def _llguidance(tok_bytes, stops, vocab, schema, tokenizer):
    import llguidance as llg
    import llguidance.torch as llt

    class Wrap:
        eos_token_id = stops[0]
        bos_token_id = None
        tokens = [b if b is not None else b"\xff<special_%d>" % i for i, b in enumerate(tok_bytes)]
        special_token_ids = [i for i, b in enumerate(tok_bytes) if b is None]

        def __call__(self, s):
            return tokenizer.encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)

    lltok = llg.LLTokenizer(llg.TokenizerWrapper(Wrap()), n_vocab=vocab, eos_token=list(stops))
    t0 = time.perf_counter()
    lark = ('start: ("<tool_call>\\n" call "\\n</tool_call>" "\\n"?)+\n'
            f'call: %json {json.dumps({**schema, **_COMPACT})}\n')
    m = llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_lark(lark), log_level=1)
    assert not m.is_error(), m.get_error()
    compile_ms = 1e3 * (time.perf_counter() - t0)
    bm = llt.allocate_token_bitmask(1, vocab)

    def mask():
        llt.fill_next_token_bitmask(m, bm)
        return bm[0]

    return compile_ms, mask, m.consume_token, m.rollback


def _outlines(tok_bytes, stops, vocab, schema):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = stops[0]
    mapping: dict = {}
    for i, b in enumerate(tok_bytes):
        if b is not None and i not in stops:
            mapping.setdefault(b, []).append(i)
    t0 = time.perf_counter()
    call = build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
    regex = f"(<tool_call>\\n({call})\\n</tool_call>\\n?)+"
    index = Index(regex, Vocabulary(eos, mapping))
    compile_ms = 1e3 * (time.perf_counter() - t0)
    g = Guide(index, max_rollback=64)
    bm = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)

    def mask():
        g.write_mask_into(bm.data_ptr(), bm.numel(), bm.element_size())
        return bm[0]

    return compile_ms, mask, g.advance, g.rollback_state


def _replay(r: dict, ids: list[int], mask, advance, rollback) -> list[torch.Tensor]:
    """Walk a library's matcher along ``ids`` (the reference call, then a stop token), timing each
    mask, advance and (every 16 tokens) a rollback of 4 re-advanced as a tree walk would; counts
    the tokens it rejects into ``r``. Returns the masks it gave, in order."""
    seq = []
    for j, t in enumerate(ids):
        t0 = time.perf_counter()
        m = mask()
        t1 = time.perf_counter()
        allowed = bool((int(m[t // 32]) >> (t % 32)) & 1)
        seq.append(m.clone())
        r["rejected"] += not allowed
        r["tokens"] += 1
        if not allowed or j == len(ids) - 1:
            break  # a rejected token ends the walk; so does the stop token (allowed is all a stop needs)
        t2 = time.perf_counter()
        advance(t)
        t3 = time.perf_counter()
        r["mask_us"].append(1e6 * (t1 - t0))
        r["advance_us"].append(1e6 * (t3 - t2))
        if j and j % 16 == 0:
            t4 = time.perf_counter()
            rollback(4)
            r["rollback_us"].append(1e6 * (time.perf_counter() - t4))
            for u in ids[j - 3 : j + 1]:
                advance(u)
    return seq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--libs", default="xgrammar,llguidance,outlines")
    args = ap.parse_args()
    pair = engine.load("smollm2-135m-instruct", "none", device="cpu", dtype="float32")
    tok = pair.tokenizer
    vocab, stops = tok.vocab_size, pair.stop_ids
    tok_bytes = vocab_bytes(tok)
    wl = load_workload("agent", Path("."), args.n_prompts, 0)
    rows = {lib: {"compile_ms": [], "mask_us": [], "advance_us": [], "rollback_us": [], "rejected": 0,
                  "tokens": 0, "failed": []} for lib in args.libs.split(",")}
    disagree = 0
    for pi, prompt in enumerate(wl.prompts):
        if not prompt.tools:
            continue
        schema = call_schema(prompt.tools)
        text = "".join(f"<tool_call>\n{json.dumps(example_call(t))}\n</tool_call>" for t in prompt.tools)
        ids = tok.encode(text) + [stops[0]]
        masks = {}
        for lib in rows:
            try:
                if lib == "xgrammar":
                    built = _xgrammar(tok_bytes, stops, vocab, schema)
                elif lib == "llguidance":
                    built = _llguidance(tok_bytes, stops, vocab, schema, tok)
                else:
                    built = _outlines(tok_bytes, stops, vocab, schema)
                compile_ms, mask, advance, rollback = built
            except Exception as exc:  # a library refusing a real schema is a finding, not a crash
                rows[lib]["failed"].append(f"prompt {pi}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            rows[lib]["compile_ms"].append(compile_ms)
            masks[lib] = _replay(rows[lib], ids, mask, advance, rollback)
        libs = [lib for lib in masks if lib in ("xgrammar", "llguidance")]  # same JSON whitespace choice
        if len(libs) == 2:
            a, b = masks[libs[0]], masks[libs[1]]
            disagree += sum(not torch.equal(x, y) for x, y in zip(a, b, strict=False))
    print(f"prompts: {sum(1 for p in wl.prompts if p.tools)}  vocab: {vocab}  torch threads: {torch.get_num_threads()}")
    for lib, r in rows.items():
        def med(xs):
            return f"{statistics.median(xs):.1f}" if xs else "-"

        def p90(xs):
            return f"{sorted(xs)[int(0.9 * (len(xs) - 1))]:.1f}" if xs else "-"

        print(f"{lib}: compile_ms median {med(r['compile_ms'])} max {max(r['compile_ms'], default=0):.0f} | "
              f"mask_us median {med(r['mask_us'])} p90 {p90(r['mask_us'])} | "
              f"advance_us median {med(r['advance_us'])} | "
              f"rollback_us median {med(r['rollback_us'])} | reference tokens rejected {r['rejected']}/{r['tokens']} | "
              f"failed {len(r['failed'])} {r['failed'][:2]}")
    print(f"xgrammar_vs_llguidance_mask_disagreements: {disagree}")


if __name__ == "__main__":
    main()
