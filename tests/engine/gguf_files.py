"""GGUF files written from a transformers model for the tests (the loader's tests and the
own-model guide's): the keys, names and layouts llama.cpp's convert_hf_to_gguf.py writes."""

from __future__ import annotations

import json

import numpy as np
import torch

_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # As llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF halves -> interleaved RoPE pairs).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf, arch: str = "qwen3", qtype=None, tokenizer=None, specials: tuple[str, ...] = (),
               chat_template: str | None = None) -> None:
    """``hf`` (a transformers Llama/Qwen3 model) as llama.cpp writes it: its config as GGUF keys,
    its weights by llama.cpp's names (Q/K permuted to interleaved RoPE pairs for ``llama``),
    quantised to ``qtype`` (F32 by default). The vocabulary: ``tokenizer``'s (an HF ``tokenizers``
    BPE: its tokens, merges, ``specials`` as control tokens and ``<|im_end|>`` as EOS) with
    ``chat_template``, else placeholder tokens."""
    import gguf

    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
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
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight")
    if c.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp stores llama3 scaling as per-frequency divisors of the plain frequencies.
        exponents = torch.arange(0, c.head_dim, 2).double() / c.head_dim
        plain = 1.0 / (c.rope_parameters["rope_theta"] ** exponents)
        sd["rope_freqs"] = (plain / hf.model.rotary_emb.inv_freq.double()).float().numpy()
    for name, arr in sd.items():
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            role = ".".join(parts[2:-1])
            gname = f"blk.{parts[1]}.{_HF_TO_GGUF[role]}.{parts[-1]}"
            if arch == "llama" and role in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if role == "self_attn.q_proj" else c.num_key_value_heads
                arr = _llamacpp_permute(arr, heads)
        else:
            gname = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight", "rope_freqs": "rope_freqs.weight"}[".".join(parts)]
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
