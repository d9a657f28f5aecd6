"""The training sequences: the target's own answers to prompts (self-distillation: greedy, or sampled
at a temperature for more answers than there are prompts), and their files (one JSON object a line,
optionally compressed)."""

from __future__ import annotations

import gzip
import json
import lzma
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import torch
from torch import Tensor

from engine.config import EngineInputError
from engine.models.dense import BatchKV, DenseModel, forward_padded


def length_batches(lengths: Sequence[int], batch_size: int, batch_tokens: int = 0,
                   max_new_tokens: int = 0) -> list[list[int]]:
    """Indices of ``lengths`` in batches of similar length (sorted, shortest first): at most
    ``batch_size`` each and, with ``batch_tokens``, at most that many cache positions (rows x (the
    longest prompt + ``max_new_tokens``)), one prompt at least. A token budget lets short prompts
    share a large batch: the answer's steps cost launches, not rows, at these sizes."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        # sorted: prompt i is the longest of the batch it joins
        fits = last is not None and len(last) < batch_size and (
            not batch_tokens or (len(last) + 1) * (lengths[i] + max_new_tokens) <= batch_tokens)
        if fits:
            last.append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def generate_responses(target: DenseModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       batch_size: int, stop_ids: Sequence[int], time_budget_s: float = 0.0,
                       seed: int = 0, batch_tokens: int = 0, temperature: float = 0.0) -> list[list[int] | None]:
    """The target's answers to every prompt, batched with left padding: greedy, or with ``temperature``
    > 0 sampled from its distribution at that temperature (each batch from its own generator, seeded by
    ``seed`` and the batch: the same call gives the same answers; a prompt given twice gets two draws).

    Prompts of similar length share a batch (``length_batches``); the batches run in a seeded random
    order, so that with ``time_budget_s`` (no new batch starts after it) the answered prompts are a
    fair sample of every length, and the prompts of the batches not run get ``None``."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise EngineInputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if not isinstance(target, DenseModel):
        raise EngineInputError("draft training supports dense targets (Llama/Qwen3 family) only")
    device, cfg = target.device, target.cfg
    batches = length_batches([len(p) for p in prompts], batch_size, batch_tokens, max_new_tokens)
    perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed)).tolist()
    out: list[list[int] | None] = [None for _ in prompts]
    stop = torch.tensor(list(stop_ids) or [-1], device=device)
    t0 = time.perf_counter()
    for k in perm:
        if time_budget_s and time.perf_counter() - t0 > time_budget_s:
            break
        idx = batches[k]
        b, p = len(idx), max(len(prompts[i]) for i in idx)
        tokens = torch.zeros(b, p, dtype=torch.long, device=device)
        valid = torch.zeros(b, p, dtype=torch.bool, device=device)
        for r, i in enumerate(idx):
            n = len(prompts[i])
            tokens[r, p - n :] = torch.tensor(prompts[i], device=device)
            valid[r, p - n :] = True
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        size = p + max_new_tokens
        kv = BatchKV(
            k=torch.zeros(cfg.num_hidden_layers, b, size, cfg.num_key_value_heads, cfg.dim_per_head,
                          device=device, dtype=target.dtype),
            v=torch.zeros(cfg.num_hidden_layers, b, size, cfg.num_key_value_heads, cfg.dim_per_head,
                          device=device, dtype=target.dtype),
            valid=torch.zeros(b, size, dtype=torch.bool, device=device),
        )
        logits, _ = forward_padded(target, tokens, positions, valid, kv, 0, last_only=True)
        draw = torch.Generator(device=device).manual_seed(seed * 1_000_003 + k) if temperature > 0 else None
        nxt = _pick(logits[:, -1], temperature, draw)
        pos = positions[:, -1] + 1
        gen = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            gen[:, step] = nxt
            done |= torch.isin(nxt, stop)
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            logits, _ = forward_padded(target, nxt[:, None], pos[:, None], torch.ones(b, 1, dtype=torch.bool,
                                       device=device), kv, p + step)
            nxt, pos = _pick(logits[:, -1], temperature, draw), pos + 1
        for r, i in enumerate(idx):
            row = gen[r].tolist()[: step + 1]
            cut = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
            out[i] = row[:cut]
    return out


def _pick(logits: Tensor, temperature: float, draw: torch.Generator | None) -> Tensor:
    """Each row's next token: its argmax, or a draw from softmax(logits / temperature). (Not
    ``sampling.select_tokens``: its noise is keyed by (seed, position) for speculative exactness, so two
    rows of one prompt at one position would draw alike; here each row draws on its own.)"""
    if temperature == 0:
        return logits.argmax(-1)
    # shifted by the row's max first: however small the temperature, the scaled logits stay finite (<= 0)
    logits = logits.float()
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=draw).squeeze(1)


def _open_text(path: Path, mode: str) -> IO[str]:
    # Self-distilled data is kept in the repository between GPU sessions: ``.xz`` makes it 1/12 of
    # the JSON (``.gz`` 1/6), and every byte of it travels to the GPU machine in each call.
    if path.suffix == ".xz":
        return lzma.open(path, mode + "t", preset=9 if mode == "w" else None)
    return gzip.open(path, mode + "t") if path.suffix == ".gz" else path.open(mode)


def save_sequences(path: Path, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                   temperatures: Sequence[float] | None = None) -> None:
    """One JSON object per line, ``{"tokens": [...], "prompt_len": n}``, with ``"temperature": t`` for an
    answer sampled at t > 0 (``temperatures``, one per sequence; None: all greedy); compressed when the
    name ends in .xz or .gz."""
    temps = [0.0] * len(sequences) if temperatures is None else temperatures
    with _open_text(path, "w") as fh:
        for s, p, t in zip(sequences, prompt_lens, temps, strict=True):
            fh.write(json.dumps({"tokens": list(s), "prompt_len": p} | ({"temperature": t} if t else {})) + "\n")


def load_sequences(path: Path) -> tuple[list[list[int]], list[int]]:
    """What ``save_sequences`` wrote: the sequences and their prompt lengths (``load_sequence_records``
    also gives each answer's temperature)."""
    seqs, plens, _ = load_sequence_records(path)
    return seqs, plens


def load_sequence_records(path: Path) -> tuple[list[list[int]], list[int], list[float]]:
    """What ``save_sequences`` wrote, each answer's temperature too (0.0: greedy, a line without one); a
    malformed line is an error naming the file and the line."""
    if not path.is_file():
        raise EngineInputError(f"--data {str(path)!r}: no such file")
    seqs, plens, temps = [], [], []
    with _open_text(path, "r") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                tokens, plen, temp = rec["tokens"], rec["prompt_len"], rec.get("temperature", 0.0)
                ok = (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
                      and isinstance(plen, int) and 0 < plen < len(tokens))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise EngineInputError(f"{path}:{n}: not a sequence record ({e})") from None
            if not ok:
                raise EngineInputError(f"{path}:{n}: 'tokens' must be a list of token ids longer than "
                                       f"'prompt_len' (a positive integer)")
            # (a JSON integer past a float's range would overflow float())
            number = (isinstance(temp, int) and abs(temp) < 1e308) or (isinstance(temp, float) and math.isfinite(temp))
            if isinstance(temp, bool) or not number or temp < 0:
                raise EngineInputError(f"{path}:{n}: 'temperature' must be a finite number >= 0 (the answer's "
                                       f"sampling temperature; absent or 0: greedy), got {temp!r}")
            seqs.append(tokens)
            plens.append(plen)
            temps.append(float(temp))
    if not seqs:
        raise EngineInputError(f"{path}: no sequences")
    return seqs, plens, temps
