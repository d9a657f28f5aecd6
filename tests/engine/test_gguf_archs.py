"""The GGUF architectures (engine.gguf_archs) on files written as llama.cpp's converter writes them
(tests/engine/gguf_files.py): each loads into our model holding exactly the weights the same HF
model's folder loads (every layout llama.cpp rewrote undone), and what cannot be read is refused
naming the file, the key or tensor, and what is supported. Native loads decoding as their
dequantized twins: tests/engine/test_gguf_native.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine
from engine import EngineInputError
from engine.gguf_archs import GGUF_ARCHS, Metadata
from engine.gguf_loading import load_target_gguf, readable_types
from engine.loading import load_target_folder
from engine.models.quant import FORMATS
from tests.engine.gguf_files import bpe_tokenizer, tiny_hf, write_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# name: (arch, tiny_hf overrides, write_gguf options)
CASES = {
    "qwen35": ("qwen35", {}, {}),  # two value heads per key head: llama.cpp tiles them
    "qwen35-one-value-head-per-key-head": ("qwen35", {"linear_num_value_heads": 2}, {}),
    "qwen35-tied-with-mtp-layer": ("qwen35", {"tie_word_embeddings": True}, {"mtp": True}),
    "qwen3": ("qwen3", {}, {}),
    "llama": ("llama", {}, {}),  # q/k rows permuted to interleaved RoPE pairs
}


def _written(tmp_path, arch: str, overrides: dict, options: dict):
    hf = tiny_hf(arch, **overrides)
    path = tmp_path / "model.gguf"
    write_gguf(path, hf, arch, **options)
    return hf, path


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_gguf_holds_exactly_the_weights_of_its_hf_folder(case, tmp_path):
    arch, overrides, options = CASES[case]
    hf, path = _written(tmp_path, arch, overrides, options)
    hf.save_pretrained(tmp_path / "hf")
    ours, meta = load_target_gguf(path, "cpu", torch.float32)
    direct = load_target_folder(tmp_path / "hf", "cpu", torch.float32)
    assert meta["general.architecture"] == arch and type(ours) is type(direct)
    if arch == "qwen35":  # a GGUF says the layer pattern by its interval, the HF config by its list
        assert ours.cfg.layer_types == direct.cfg.layer_types
        ours_cfg, direct_cfg = (dataclasses.replace(m.cfg, full_attention_interval=0) for m in (ours, direct))
        assert ours_cfg == direct_cfg
    else:
        assert ours.cfg == direct.cfg
    got, want = ours.state_dict(), direct.state_dict()
    assert set(got) == set(want)
    assert [name for name in got if not torch.equal(got[name], want[name])] == []
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == overrides.get("tie_word_embeddings", False)
    prompt = torch.randint(0, 300, (17,), generator=torch.Generator().manual_seed(3))
    logits, _ = ours(prompt, ours.new_cache(32), 0)
    assert torch.equal(logits, direct(prompt, direct.new_cache(32), 0)[0])
    ref = hf(prompt[None]).logits[0]  # and transformers' own forward agrees
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_the_written_qwen35_file_uses_llamacpps_names_shapes_and_keys(tmp_path):
    """What the test files claim to mimic: every tensor named as gguf's own QWEN35 name map names its
    HF tensor (A_log -> ssm_a, dt_bias -> ssm_dt.bias), the conv squeezed, the keys llama.cpp reads."""
    hf, path = _written(tmp_path, "qwen35", {}, {"mtp": True})
    reader = gguf.GGUFReader(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, hf.config.num_hidden_layers)
    expect = set()
    for name in hf.state_dict():
        stem, _, suffix = name.rpartition(".")
        if suffix == "A_log":
            expect.add(names.get_name(name))
        elif suffix == "dt_bias":
            expect.add(names.get_name(f"{stem}.dt_proj") + ".bias")
        else:
            expect.add(f"{names.get_name(stem)}.{suffix}")
    mtp = {t.name for t in reader.tensors if t.name.startswith("blk.4.")}
    assert {t.name for t in reader.tensors} - mtp == expect and mtp
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert shapes["blk.0.ssm_conv1d.weight"] == (4, 2 * 2 * 32 + 4 * 64)  # GGUF order: [K, C]
    assert shapes["blk.0.ssm_a"] == shapes["blk.0.ssm_dt.bias"] == (4,)
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert {k: fields[f"qwen35.{k}"] for k in ("block_count", "nextn_predict_layers", "full_attention_interval",
                                               "ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
                                               "ssm.time_step_rank", "ssm.inner_size", "rope.dimension_count")} \
        == {"block_count": 5, "nextn_predict_layers": 1, "full_attention_interval": 2, "ssm.conv_kernel": 4,
            "ssm.state_size": 32, "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 256,
            "rope.dimension_count": 32}


def test_native_out_proj_blocks_move_or_its_input_is_permuted(tmp_path):
    """Tiled value heads 64 wide: Q8_0's 32-value blocks move with them (no runtime permutation); a
    Q4_K block (256) spans heads, so the layer keeps the file's columns and the model permutes
    out_proj's input. The Gated DeltaNet's four in-projections share a format: one block tensor."""
    hf = tiny_hf("qwen35")
    for qtype, permuted in ((Q.Q8_0, False), (Q.Q4_K, True)):
        path = tmp_path / f"{qtype.name}.gguf"
        write_gguf(path, hf, "qwen35", qtype, tokenizer=bpe_tokenizer())
        pair = engine.load(str(path), "none", device="cpu", dtype="float32", weights="native")
        gdn = pair.target.layers[0].linear_attn
        assert (gdn.out_order is not None) == permuted and gdn.out_proj.fmt.name == qtype.name
        assert gdn.in_proj.fmt.name == qtype.name and gdn.in_proj.sizes == [2 * 64 + 256, 256, 4, 4]
        assert pair.target.layers[1].self_attn.qkv_proj.fmt.name == qtype.name
        if permuted:  # value position j of the file is (replica j // 2 // 64, key head j // 64 % 2)
            heads = gdn.out_order.view(4, 64)[:, 0] // 64
            assert heads.tolist() == [0, 2, 1, 3] and torch.equal(gdn.out_order.view(4, 64) % 64,
                                                                  torch.arange(64).expand(4, 64))


def _patch(path, field: str, value: int) -> None:
    """Rewrite one scalar metadata value, or (``tensor:NAME``) one tensor's type id, in place."""
    reader = gguf.GGUFReader(path, "r+")
    if field.startswith("tensor:"):
        parts = next(t for t in reader.tensors if t.name == field.removeprefix("tensor:")).field.parts
        parts[4][0] = value  # name length, name, n_dims, dims, type, offset
    else:
        f = reader.fields[field]
        f.parts[f.data[0]][0] = value
    del reader


@pytest.mark.parametrize("weights", ["dequantized", "native"])
def test_an_unreadable_tensor_type_is_named_with_the_supported_ones(tmp_path, weights):
    _, path = _written(tmp_path, "qwen35", {}, {})
    _patch(path, "tensor:blk.2.ssm_norm.weight", Q.I32)  # F32 -> I32: same bytes, a type no load reads
    _patch(path, "tensor:blk.1.attn_k_norm.weight", Q.I32)
    with pytest.raises(EngineInputError) as err:
        load_target_gguf(path, "cpu", torch.float32, weights)
    message = str(err.value)
    assert message.startswith(f"{path}: tensor 'blk.1.attn_k_norm.weight' has type I32, which is not supported "
                              "(and 1 more tensors of types ['I32']); supported types: ['F32', 'F16', 'Q4_0'")
    assert "'Q6_K'" in message and "'IQ4_XS'" in message and "'I32'" not in message.split("supported types")[1]
    assert f"kept in blocks with weights='native': {list(FORMATS)}" in message
    assert set(readable_types()) >= {"F32", "F16", "BF16", *FORMATS} and "Q8_1" not in readable_types()


def test_an_unknown_architecture_is_named_with_the_supported_ones(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "next.gguf"), "qwen3next")
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EngineInputError, match=r"next.gguf: general.architecture 'qwen3next' is not supported; "
                                               r"supported: \['llama', 'qwen2', 'qwen3', 'qwen35'\]"):
        engine.load(str(tmp_path / "next.gguf"), "none", device="cpu")
    assert list(GGUF_ARCHS) == ["llama", "qwen2", "qwen3", "qwen35"]


@pytest.fixture(scope="module")
def qwen35_header(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35") / "model.gguf"
    write_gguf(path, tiny_hf("qwen35"), "qwen35")
    reader = gguf.GGUFReader(path)
    return path, {f.name: f.contents() for f in reader.fields.values()}, {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("change, message", [
    ({"qwen35.ssm.group_count": None}, r"metadata key 'qwen35.ssm.group_count' is missing"),
    ({"qwen35.ssm.inner_size": 250}, r"qwen35.ssm.inner_size 250 must be a multiple of ssm.time_step_rank 4"),
    ({"qwen35.ssm.group_count": 3}, r"not a valid qwen35 model: linear_num_value_heads must be a multiple of "
                                    r"linear_num_key_heads, but got 4 and 3"),
    ({"qwen35.attention.value_length": 32}, r"qwen35.attention.value_length 32 must equal attention.key_length 64"),
    ({"qwen35.rope.scaling.type": "yarn"}, r"qwen35.rope.scaling.type 'yarn' is not supported \(only none\)"),
    ({"qwen35.feed_forward_length": [512, 512, 256, 512]}, r"qwen35.feed_forward_length differs between layers"),
    ({"qwen35.ssm.time_step_rank": 0}, r"qwen35.ssm.time_step_rank must be a whole number >= 1, but got 0"),
    ({"qwen35.nextn_predict_layers": 4}, r"qwen35.nextn_predict_layers 4 must be >= 0 and below block_count 4"),
])
def test_bad_qwen35_metadata_is_refused_by_key(qwen35_header, change, message):
    path, meta, tensors = qwen35_header
    meta = {k: v for k, v in (meta | change).items() if v is not None}
    with pytest.raises(EngineInputError, match=rf"^{path}: {message}"):
        GGUF_ARCHS["qwen35"](Metadata(meta, "qwen35", path), tensors)


def test_a_layer_pattern_that_does_not_match_the_tensors_is_refused(tmp_path):
    """full_attention_interval 4 makes layer 1 a Gated DeltaNet layer, but the file holds attention
    there: the missing and unexpected tensors are named (by our names)."""
    _, path = _written(tmp_path, "qwen35", {}, {})
    _patch(path, "qwen35.full_attention_interval", 4)
    with pytest.raises(EngineInputError, match=r"model.gguf: checkpoint tensors do not match the model: missing "
                                               r"\[.*'layers.1.linear_attn.in_proj_qkv.weight'.*unexpected "
                                               r"\['layers.1.self_attn.k_norm.weight'"):
        load_target_gguf(path, "cpu", torch.float32)


# ------------------------------------------------------------------------------------ on a GPU
Q4_K_M = {"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "output": Q.Q6_K}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weights", ["native", "dequantized"])
def test_qwen35_q4_k_m_on_cuda_equals_its_own_ar_on_every_path(tmp_path, weights):
    """bf16 on the device: every verify / rollback / draft path decodes the tiny Qwen3.5 Q4_K_M file
    token for token as its AR with the same weights (the runtime's graphs replay out_proj's input
    permutation, native; on an sm_90 GPU its Q4_K and Q6_K through the operand-register decode); in float32
    the native load decodes as its dequantized twin."""
    import itertools

    from engine import EngineConfig

    path = tmp_path / "q4_k_m.gguf"
    write_gguf(path, tiny_hf("qwen35"), "qwen35", Q.Q4_K, tokenizer=bpe_tokenizer(), qtypes=Q4_K_M)
    pair = engine.load(str(path), "random", device="cuda", dtype="bfloat16", weights=weights)
    from engine.models import quant_gluon

    if weights == "native" and quant_gluon.runs_on(torch.device("cuda"), torch.bfloat16):
        # on an sm_90 GPU: Q4_K and Q6_K held as the operand-register decode's planes, the path under test
        assert set(pair.weight_summary()["operand"].values()) == {"Q4_K", "Q6_K"}
    prompts = [pair.encode(t) for t in ("the sea of day is", "the key of night is 7", "the map")]
    ar = EngineConfig(verify="ar")
    ref = engine.bench(pair, ar, prompts, 48, ignore_eos=True)
    for verify, rollback, draft_path in itertools.product(["chain", "ddtree"], ["replay", "fast"],
                                                          ["generic", "auto", "runtime"]):
        cfg = EngineConfig(verify=verify, rollback=rollback, draft_path=draft_path, budget=16, top_k=4,
                           block_size=8)
        if pair.refusal(cfg) is not None:
            continue
        res = engine.bench(pair, cfg, prompts, 48, reference=ref.outputs, ignore_eos=True, ar_config=ar)
        assert res.exact_match == 1.0 and res.new_tokens == 3 * 48, (verify, rollback, draft_path)
    if weights == "native":
        twins = [engine.load(str(path), "none", device="cuda", dtype="float32", weights=w)
                 for w in ("native", "dequantized")]
        outputs = [engine.bench(p, ar, prompts, 32, ignore_eos=True).outputs for p in twins]
        assert outputs[0] == outputs[1]
