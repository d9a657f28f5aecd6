"""GGUF files written from a transformers model for the tests (the loader's tests and the
own-model guide's): the keys, names and layouts llama.cpp's convert_hf_to_gguf.py writes; and
``headers_only``, which fails a test that reads any checkpoint tensor's data."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import torch

_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


# A tiny target for the native-weights tests (engine's and autotune's). Rows of 256 and 512 values:
# the K formats' blocks are 256 wide.
TINY_HF = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, initializer_range=0.05, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)


def bpe_tokenizer():
    """A byte-level BPE (what a GGUF's gpt2 tokenizer must be for engine.load) of exactly
    ``TINY_HF``'s 300 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"the {w} of {v} is {n}" for w in ("sea", "rain", "map", "key") for v in ("day", "night")
              for n in range(40)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=TINY_HF["vocab_size"], special_tokens=["<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert tok.get_vocab_size() == TINY_HF["vocab_size"]
    return tok


# Qwen3.5's extra fields, shaped so every projection's rows are whole blocks of every format: value
# heads (64 wide) narrower than a K block (256), two value heads per key head (llama.cpp tiles them).
TINY_QWEN35 = dict(num_hidden_layers=4, full_attention_interval=2, head_dim=64, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=64,
                   linear_conv_kernel_dim=4,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def tiny_hf(arch: str, **overrides):
    """A seeded transformers model of ``arch`` (llama, qwen2, qwen3, qwen35) shaped as ``TINY_HF`` (and
    ``TINY_QWEN35``) | ``overrides``. Qwen3.5's zero-initialised norms and its decay parameters are
    moved off their init (so their layout matters) to values llama.cpp's float32 rewrites (1 + w,
    -exp(A_log)) give back exactly when undone (``_round_trip_stable``)."""
    import transformers

    cls, cfg_cls = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
                    "qwen35": (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig)}[arch]
    torch.manual_seed(7)
    model = cls(cfg_cls(**(TINY_HF | (TINY_QWEN35 if arch == "qwen35" else {}) | overrides))).eval()
    if arch == "qwen35":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "dt_bias", "A_log")):
                    p.add_(0.3 * torch.randn_like(p))
                    p.copy_(_round_trip_stable(name, p))
    return model


def _round_trip_stable(name: str, p: torch.Tensor) -> torch.Tensor:
    """``p`` moved (by an ulp or so) to values its GGUF rewrite and its inverse give back bit for bit:
    (w + 1) - 1 and log(exp(x)) round in float32, which is the file's precision, not the loader's."""
    for _ in range(8):
        if name.endswith("A_log"):
            back = torch.log(torch.exp(p).double()).float()  # the file's -exp(x) in float32, read back
        elif name.endswith("norm.weight") and ".linear_attn." not in name:
            back = (p + 1) - 1
        else:
            return p
        if torch.equal(back, p):
            return p
        p = back
    raise AssertionError(f"{name}: no float32 round-trip fixed point")


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # As llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF halves -> interleaved RoPE pairs).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf, arch: str = "qwen3", qtype=None, tokenizer=None, specials: tuple[str, ...] = (),
               chat_template: str | None = None, qtypes: dict | None = None, mtp: bool = False) -> None:
    """``hf`` (a transformers Llama/Qwen2/Qwen3/Qwen3.5 model) as llama.cpp writes it: its config as
    GGUF keys, its weights by llama.cpp's names and layouts (Q/K permuted to interleaved RoPE pairs for
    ``llama``; Qwen3.5's rewrites: ``_qwen35_tensors``), matrices quantised to ``qtype`` (F32 by
    default) or, per tensor, to ``qtypes``' type for its name without ``.weight`` (``blk.1.ffn_down``)
    or its role (``attn_v``, ``output``, ``token_embd``), as llama.cpp's mixes (Q4_K_M) do; ``quantize``
    makes the blocks. The vocabulary: ``tokenizer``'s (an HF ``tokenizers`` BPE: its tokens, merges,
    ``specials`` as control tokens and ``<|im_end|>`` as EOS) with ``chat_template``, else placeholder
    tokens. ``mtp`` (qwen35): one multi-token-prediction layer after the model's, as the converter
    appends Qwen3.5's (random tensors: the engine skips them)."""
    import gguf

    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    qtypes = qtypes or {}
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Qwen2's config has none
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers + (1 if mtp else 0))
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "qwen35":  # as the converter's Qwen3NextModel / Qwen3_5TextModel add them
        w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
        w.add_ssm_state_size(c.linear_key_head_dim)
        w.add_ssm_group_count(c.linear_num_key_heads)
        w.add_ssm_time_step_rank(c.linear_num_value_heads)
        w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
        # transformers 5 keeps the interval as layer_types; llama.cpp reads only the interval
        every = c.layer_types.index("full_attention") + 1
        assert all((t == "full_attention") == ((i + 1) % every == 0) for i, t in enumerate(c.layer_types))
        w.add_full_attention_interval(every)
        w.add_rope_dimension_count(int(head_dim * c.rope_parameters["partial_rotary_factor"]))
        w.add_rope_dimension_sections([11, 11, 10, 0])  # the converter's default interleaved M-RoPE split
        if mtp:
            w.add_nextn_predict_layers(1)
    else:
        w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    if tokenizer is None:
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    else:
        vocab = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
        merges = json.loads(tokenizer.to_str())["model"]["merges"]
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(vocab)
        w.add_token_types([3 if t in specials else 1 for t in vocab])  # 3: control tokens, matched whole
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        w.add_eos_token_id(tokenizer.token_to_id("<|im_end|>"))
    if chat_template is not None:
        w.add_chat_template(chat_template)
    tensors = _qwen35_tensors(hf, mtp) if arch == "qwen35" else _dense_tensors(hf, arch, head_dim)
    for gname, arr in tensors.items():
        stem = gname.removesuffix(".weight")
        kind = qtypes.get(stem, qtypes.get(stem.split(".")[2] if stem.startswith("blk.") else stem, qtype))
        if arr.ndim == 2 and kind != gguf.GGMLQuantizationType.F32 and not stem.endswith("ssm_conv1d"):
            w.add_tensor(gname, quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _dense_tensors(hf, arch: str, head_dim: int) -> dict[str, np.ndarray]:
    c = hf.config
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight")
    if c.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp stores llama3 scaling as per-frequency divisors of the plain frequencies.
        exponents = torch.arange(0, head_dim, 2).double() / head_dim
        plain = 1.0 / (c.rope_parameters["rope_theta"] ** exponents)
        sd["rope_freqs"] = (plain / hf.model.rotary_emb.inv_freq.double()).float().numpy()
    out = {}
    for name, arr in sd.items():
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            role = ".".join(parts[2:-1])
            gname = f"blk.{parts[1]}.{_HF_TO_GGUF[role]}.{parts[-1]}"
            if arch == "llama" and role in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if role == "self_attn.q_proj" else c.num_key_value_heads
                arr = _llamacpp_permute(arr, heads)
        else:
            gname = _TOP_TO_GGUF[".".join(parts)]
        out[gname] = arr
    return out


_TOP_TO_GGUF = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight", "rope_freqs": "rope_freqs.weight"}
_QWEN35_TO_GGUF = _HF_TO_GGUF | {"post_attention_layernorm": "post_attention_norm",
                                 "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
                                 "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
                                 "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
                                 "linear_attn.out_proj": "ssm_out"}


def _qwen35_tensors(hf, mtp: bool) -> dict[str, np.ndarray]:
    """Qwen3.5's tensors as llama.cpp's converter rewrites them: value heads from grouped by key head
    to tiled (where there are more value heads than key heads), then A_log as -exp(A_log), dt_bias
    renamed, the conv squeezed to [C, K], and the zero-centred norms (all but the gated one) as 1 + w."""
    c = hf.config
    hk, hv, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
    qk = 2 * hk * c.linear_key_head_dim

    def tiled(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
        # [..., hk, hv / hk, width, ...] -> [..., hv / hk, hk, width, ...] along ``dim``
        shape = list(t.shape)
        grouped = t.reshape(*shape[:dim], hk, hv // hk, width, *shape[dim + 1:])
        return grouped.transpose(dim, dim + 1).reshape(shape)

    out = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = name.removeprefix("model.").split(".")
        if parts[0] != "layers":
            stem = ".".join(parts)
            out[_TOP_TO_GGUF[stem]] = (t + 1 if stem == "norm.weight" else t).numpy()
            continue
        layer, role, suffix = parts[1], ".".join(parts[2:-1]), parts[-1]
        if hk != hv and role.split(".")[0] == "linear_attn":
            if role in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
                t = torch.cat([t[:qk], tiled(t[qk:], 0, dv)])
            elif role == "linear_attn.in_proj_z":
                t = tiled(t, 0, dv)
            elif role in ("linear_attn.in_proj_a", "linear_attn.in_proj_b") or suffix in ("A_log", "dt_bias"):
                t = tiled(t, 0, 1)
            elif role == "linear_attn.out_proj":
                t = tiled(t, 1, dv)
        if suffix == "A_log":
            out[f"blk.{layer}.ssm_a"] = (-torch.exp(t)).numpy()
        elif suffix == "dt_bias":
            out[f"blk.{layer}.ssm_dt.bias"] = t.numpy()
        elif role == "linear_attn.conv1d":
            out[f"blk.{layer}.ssm_conv1d.{suffix}"] = t.squeeze(1).numpy()
        else:
            one_plus = role.endswith("norm") and role != "linear_attn.norm"
            out[f"blk.{layer}.{_QWEN35_TO_GGUF[role]}.{suffix}"] = (t + 1 if one_plus else t).numpy()
    if mtp:  # the converter's MTP layer: a full-attention block and the nextn projections (random here)
        gen = np.random.default_rng(0)
        n, hidden = c.num_hidden_layers, c.hidden_size
        for role, shape in (("attn_q", (2 * c.num_attention_heads * c.head_dim, hidden)), ("attn_norm", (hidden,)),
                            ("nextn.eh_proj", (hidden, 2 * hidden)), ("nextn.enorm", (hidden,))):
            out[f"blk.{n}.{role}.weight"] = gen.standard_normal(shape).astype(np.float32)
    return out


# ------------------------------------------------------------------------ blocks for the K formats
# The gguf package quantises the 32-value formats (and a few others) but not the K formats: these
# are plain min/max quantisers of our own (not llama.cpp's searched scales), enough to write a file
# whose weights are close to the model's. Their layouts are the inverse of engine.models.quant's
# decoders; test_quant checks them against gguf's reference dequantisation.


def quantize(arr: np.ndarray, qtype) -> np.ndarray:
    """``arr`` [rows, cols] as GGUF blocks [rows, row_bytes] of ``qtype``."""
    import gguf

    encode = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}.get(qtype.name)
    if encode is None:
        return gguf.quants.quantize(arr, qtype)
    rows, cols = arr.shape
    assert cols % 256 == 0, f"{qtype.name} needs rows of whole 256-value blocks, got {cols}"
    return encode(np.asarray(arr, np.float32).reshape(-1, 256)).reshape(rows, -1)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x as fp16 bytes [n, 2], the fp16 value back as float32 [n, 1]): scales are used as stored."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32).reshape(-1, 1)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _k_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins -> (header bytes [n, 16], q [n, 8, 32])."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # the stored min is subtracted: it must be <= 0
    step = (sub.max(-1) - low) / levels
    dbytes, d = _f16(step.max(-1) / 63)
    mbytes, dmin = _f16(-low.min(-1) / 63)
    sc = np.clip(np.rint(_ratio(step, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(-low, dmin)), 0, 63).astype(np.uint8)
    q = np.rint(_ratio(sub + (dmin * mn)[..., None], (d * sc)[..., None]))
    q = np.clip(q, 0, levels).astype(np.uint8)
    packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    return np.concatenate([dbytes, mbytes, packed], axis=1), q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] -> 128 bytes: chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high."""
    return ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    head, q = _k_affine(x, 15)
    return np.concatenate([head, _low_nibbles(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    head, q = _k_affine(x, 31)
    high = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)  # bit j: sub-block j
    return np.concatenate([head, high, _low_nibbles(q)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    groups = x.reshape(-1, 16, 16)
    scale = np.abs(groups).max(-1) / 31
    dbytes, d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d)), -128, 127).astype(np.int8)
    q = np.clip(np.rint(_ratio(groups, (d * sc)[..., None])), -32, 31).astype(np.int16) + 32
    u = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128, their four groups of 32
    low = np.zeros((u.shape[0], 2, 64), np.uint8)
    high = np.zeros((u.shape[0], 2, 32), np.uint8)
    for g in range(4):  # group g: low nibbles in bytes (g % 2) * 32.. at shift 4 * (g // 2); top bits at 2 * g
        low[:, :, (g % 2) * 32 : (g % 2) * 32 + 32] |= (u[:, :, g] & 15) << (4 * (g // 2))
        high |= (u[:, :, g] >> 4) << (2 * g)
    return np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64), sc.view(np.uint8), dbytes], axis=1)


def random_blocks(qtype, rows: int, cols: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """Blocks [rows, row_bytes] of ``qtype``: random bytes, their fp16 scales replaced by finite random
    values of either sign and magnitudes from ``scale`` * 1e-4 to ``scale`` (random bytes would make
    NaN and inf scales). ``scales``: each format's fp16 offsets, as engine.models.quant lists them."""
    import gguf

    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    scales = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "TQ2_0": (64,)}[qtype.name]
    rng = np.random.default_rng(seed)
    n = rows * cols // values
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for offset in scales:
        magnitude = scale * 10.0 ** rng.uniform(-4, 0, n)
        blocks[:, offset : offset + 2] = _f16(magnitude * rng.choice([-1.0, 1.0], n))[0]
    return blocks.reshape(rows, -1)


class _Unread:
    """A GGUF tensor's data that fails the test on any use."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        raise AssertionError(f"tensor {self._name!r}: its data was read ({attr})")

    def __array__(self, *args, **kw):
        raise AssertionError(f"tensor {self._name!r}: its data was read")

    def __getitem__(self, index):
        raise AssertionError(f"tensor {self._name!r}: its data was read")


def headers_only(monkeypatch) -> None:
    """Every GGUF tensor's data and every safetensors tensor fail the test when read (a loader may
    read the headers: names, shapes, types, metadata). The loader wraps a failed read of a GGUF
    tensor in its refusal, which then says "its data was read"."""
    import gguf

    import engine.loading

    class HeaderReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kw):
            super().__init__(path, *args, **kw)
            self.tensors = [t._replace(data=_Unread(t.name)) for t in self.tensors]

    real_open = engine.loading.safe_open

    class Headers:
        def __init__(self, *args, **kw):
            self._handle = real_open(*args, **kw)

        def __enter__(self):
            self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def keys(self):
            return self._handle.keys()

        def get_slice(self, name):
            shape = self._handle.get_slice(name).get_shape()
            return SimpleNamespace(get_shape=lambda: shape)

        def get_tensor(self, name):
            raise AssertionError(f"safetensors tensor {name!r} was read")

    monkeypatch.setattr(gguf, "GGUFReader", HeaderReader)
    monkeypatch.setattr(engine.loading, "safe_open", Headers)
