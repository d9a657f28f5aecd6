"""GGUF byte-level BPE tokenizer: parity with `tokenizers`, round trips, specials, chat and tool rendering;
an HF folder's chat template and end-of-turn tokens."""

import json
import random

import pytest

from engine.config import EngineInputError
from engine.data.assets import SMOLLM2_GGUF, asset_dir, is_cached
from engine.data.chat_template import flatten_tool_messages, render_chatml
from engine.data.tokenizer import (
    ByteTokenizer,
    GGUFTokenizer,
    read_gguf_metadata,
    tokenizer_from_folder,
    tokenizer_from_gguf_metadata,
)

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>"]
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ALPHABET = (list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 \t\n\r  .,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`")
            + list("éüñßøçÀÉ中文字日本語한국어Ωπ∑√∞😀🚀👍🏽\u00a0\u2003\u200b\u3000\u0301①½²Ⅻ٣\x1c\x85")
            + SPECIALS + ["'s", "'LL", "'re", "    ", "\n\n", "def ", "return ", "<|im_start", "1234567"])


def _corpus(n: int = 3000) -> list[str]:
    rng = random.Random(1)
    sylls = ["de", "f", "re", "turn", "se", "lf", "im", "port", "th", "e", "an", "d", "pr", "int", "va", "lu", "ça",
             "ï", "ve", "中", "文", "日本", "語", "한", "국", "어", "😀", "x", "y", "z", "ing", "tion", "qu", "ou"]
    words = ["".join(rng.choice(sylls) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    lines = []
    for _ in range(n):
        k = rng.randint(3, 12)
        lines.append(" ".join(rng.choice(words) + rng.choice(["", "", ",", ".", "()", ":", " 42", "\n    ", "'s"])
                              for _ in range(k)))
    return lines


def _hf_pre(pre: str):
    if pre == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + ("{1,3}" if pre == "llama-bpe" else "")
             + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    if pre == "qwen35":  # Qwen3.5's tokenizer.json: combining marks belong to words
        regex = regex.replace(r"?\p{L}+", r"?[\p{L}\p{M}]+").replace(r"[^\s\p{L}\p{N}]", r"[^\s\p{L}\p{M}\p{N}]")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.fixture(scope="module")
def trained() -> tuple[list[str], list[str]]:
    """A small byte-level BPE (tokens by id, merges) trained by `tokenizers` itself."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = _hf_pre("smollm")
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(merges) > 500
    return tokens, merges


def _meta(tokens: list[str], merges: list[str], pre: str = "smollm", template: str | None = SMOLLM2_TEMPLATE) -> dict:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    if template is not None:
        meta["tokenizer.chat_template"] = template
    return meta


def _hf_tokenizer(tokens: list[str], merges: list[str], pre: str):
    hf = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                         merges=[tuple(m.split(" ", 1)) for m in merges]))
    hf.pre_tokenizer = _hf_pre(pre)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens if t in SPECIALS])
    return hf


def _samples(n: int = 300) -> list[str]:
    rng = random.Random(0)
    out = ["", " ", "   ", "\n\n\n", "a  b", "x\t\ty", "trailing   ", "1234567890", "3.14159 and 2,718", "it's I'M",
           "def f(x):\n    return x ** 2  # square\n", "<|im_start|>user\nHi<|im_end|>\n", "<|im_end|><|im_end|>",
           "Café déjà vu. Ωμέγα 中文 😀👍🏽", "\u00a0nbsp\u2003em\u3000ideo", "①½²Ⅻ٣ numbers", "<|im_start", "{}[]()",
           "cafe\u0301 nai\u0308ve नमस्ते \u0301x -\u0308-"]  # combining marks: where qwen35 splits unlike qwen2
    out += [line for line in _corpus(40)]
    while len(out) < n:
        out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))))
    return out


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe", "qwen2", "qwen35"])
def test_ids_match_tokenizers_bpe(trained, pre):
    tokens, merges = trained
    ours = GGUFTokenizer.from_metadata(_meta(tokens, merges, pre))
    hf = _hf_tokenizer(tokens, merges, pre)
    for s in _samples():
        assert ours.encode(s) == hf.encode(s, add_special_tokens=False).ids, repr(s)


def test_round_trip_and_specials(trained):
    tokens, merges = trained
    tok = tokenizer_from_gguf_metadata(_meta(tokens, merges))
    for s in _samples():
        assert tok.decode(tok.encode(s)) == s
    ids = tok.encode("<|im_start|>user\n12<|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")
    assert tok.encode("12") == [tokens.index("1"), tokens.index("2")]  # digits are isolated for "smollm"
    assert tok.vocab_size == len(tokens)
    assert tok.stop_ids == (2, 0)  # eos (<|im_end|>) and <|endoftext|>
    assert tok.mask_id == tokens.index("<empty_output>")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([len(tokens)])


def test_split_multibyte_characters_decode_together(trained):
    tokens, merges = trained
    tok = tokenizer_from_gguf_metadata(_meta(tokens, merges))
    ids = tok.encode("👍🏽")
    assert len(ids) > 1 and tok.decode(ids) == "👍🏽"


def test_bad_metadata_is_a_clear_error(trained):
    tokens, merges = trained
    assert tokenizer_from_gguf_metadata({"general.architecture": "llama"}) is None
    with pytest.raises(EngineInputError, match="tokenizer.ggml.pre = 'nonsense'"):
        GGUFTokenizer.from_metadata(_meta(tokens, merges, pre="nonsense"))
    with pytest.raises(EngineInputError, match="'llama' is not supported"):
        GGUFTokenizer.from_metadata({**_meta(tokens, merges), "tokenizer.ggml.model": "llama"})
    with pytest.raises(EngineInputError, match="merges"):
        GGUFTokenizer.from_metadata({**_meta(tokens, merges), "tokenizer.ggml.merges": None})


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "content": "{\"temp_c\": 21}"},
]


def test_chat_template_renders_like_transformers(trained):
    tokens, merges = trained
    tok = tokenizer_from_gguf_metadata(_meta(tokens, merges))
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.render_chat(two, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_chat_template_matches_transformers_apply_chat_template(trained):
    transformers = pytest.importorskip("transformers")
    tokens, merges = trained
    ours = tokenizer_from_gguf_metadata(_meta(tokens, merges))
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=_hf_tokenizer(tokens, merges, "smollm"),
                                                  chat_template=SMOLLM2_TEMPLATE)
    chats = [[{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  spaces\n\n"}]]
    for chat in chats:
        for gen in (True, False):
            assert ours.render_chat(chat, add_generation_prompt=gen) == theirs.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen)


def test_tools_fall_back_to_our_format_when_the_template_ignores_them(trained):
    tokens, merges = trained
    tok = tokenizer_from_gguf_metadata(_meta(tokens, merges))
    text = tok.render_chat(TOOL_CHAT, TOOLS)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0], sort_keys=True) + "\n</tools>" in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text == render_chatml(TOOL_CHAT, TOOLS, True)  # same documented format as the byte tokenizer
    assert text == ByteTokenizer().render_chat(TOOL_CHAT, TOOLS)
    with_system = tok.render_chat([{"role": "system", "content": "Be exact."}, *TOOL_CHAT], TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe exact.\n\n# Tools")


def test_tool_aware_template_gets_tools_passed_through(trained):
    tokens, merges = trained
    template = ("{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                "{% if m['role'] == 'tool' %}{{ raise_exception('tool turns unsupported') }}{% endif %}"
                "[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = tokenizer_from_gguf_metadata(_meta(tokens, merges, template=template))
    out = tok.render_chat([{"role": "user", "content": "Hi"}], TOOLS)
    assert out == "TOOLS=" + json.dumps(TOOLS) + "\n[user]Hi\n[assistant]"
    with pytest.raises(EngineInputError, match="tool turns unsupported"):
        tok.render_chat(TOOL_CHAT, TOOLS)


def test_template_is_sandboxed(trained):
    tokens, merges = trained
    tok = tokenizer_from_gguf_metadata(_meta(tokens, merges, template="{{ messages.__class__.__mro__ }}"))
    with pytest.raises(EngineInputError):
        tok.render_chat([{"role": "user", "content": "Hi"}])


def test_no_template_falls_back_to_chatml(trained):
    tokens, merges = trained
    tok = tokenizer_from_gguf_metadata(_meta(tokens, merges, template=None))
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.render_chat(msgs) == render_chatml(msgs, None, True)


# --- an HF folder: its own chat template and stops (tokenizer_config.json, chat_template.jinja) ---

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def _hf_folder(tmp_path, trained, config: dict | None = None, generation: dict | None = None,
               jinja: str | None = None, chatml: bool = True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    tokens, merges = trained
    hf = _hf_tokenizer(tokens, merges, "smollm")
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    hf.save(str(tmp_path / "tokenizer.json"))
    if not chatml:  # a vocabulary without ChatML's tokens: drop them from the saved tokenizer
        data = json.loads((tmp_path / "tokenizer.json").read_text())
        data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in ("<|im_start|>", "<|im_end|>")]
        data["model"]["vocab"] = {t: i for t, i in data["model"]["vocab"].items()
                                  if t not in ("<|im_start|>", "<|im_end|>")}
        (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    for name, body in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        if body is not None:
            (tmp_path / name).write_text(json.dumps(body))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tokenizer_from_folder(tmp_path), hf


def test_hf_folder_renders_its_own_template_as_transformers_does_and_stops_at_its_eos(tmp_path, trained):
    transformers = pytest.importorskip("transformers")
    config = {"chat_template": LLAMA3_TEMPLATE, "bos_token": "<|begin_of_text|>",
              "eos_token": {"content": "<|eot_id|>", "special": True}}
    plain, _ = _hf_folder(tmp_path / "plain", trained)
    eot, eom = (plain._tok.token_to_id(t) for t in ("<|eot_id|>", "<|eom_id|>"))
    assert eom not in plain.stop_ids  # without the folder's files, <|eom_id|> is no stop
    tok, hf = _hf_folder(tmp_path / "llama", trained, config, {"eos_token_id": [eom, eot]})
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, chat_template=LLAMA3_TEMPLATE,
                                                  bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi  "}]
    for gen in (True, False):
        want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert tok.render_chat(chat, add_generation_prompt=gen) == want
    assert tok.render_chat(chat).startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.")
    assert eom in tok.stop_ids and eot in tok.stop_ids  # generation_config's list, and the eos_token
    assert tok._tok.token_to_id("<|im_end|>") in tok.stop_ids  # the common end-of-turn tokens stay stops


def test_hf_folder_template_sources_in_transformers_order(tmp_path, trained):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    tok, _ = _hf_folder(tmp_path / "a", trained, {"chat_template": named})
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == "DEFAULT"
    # chat_template.jinja wins over tokenizer_config.json's, as in transformers
    tok, _ = _hf_folder(tmp_path / "b", trained, {"chat_template": "CONFIG"},
                        jinja="JINJA {{ messages[0]['content'] }}")
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == "JINJA Hi"
    # none at all: ChatML, when the vocabulary has its tokens
    tok, _ = _hf_folder(tmp_path / "c", trained)
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.chat_template is None and tok.render_chat(msgs) == render_chatml(msgs, None, True)


@pytest.mark.parametrize("case", ["no default", "not a string", "bad eos id", "broken template", "not json",
                                  "no chatml"])
def test_hf_folder_bad_side_files_are_refused_by_name(tmp_path, trained, case):
    folder = tmp_path / case.replace(" ", "_")
    folder.mkdir()
    msgs = [{"role": "user", "content": "Hi"}]
    if case == "no default":
        with pytest.raises(EngineInputError, match=r"tokenizer_config\.json chat_template: lists templates "
                                                   r"\['tool_use'\] but none named 'default'"):
            _hf_folder(folder, trained, {"chat_template": [{"name": "tool_use", "template": "x"}]})
    elif case == "not a string":
        with pytest.raises(EngineInputError, match=r"chat_template must be a string .* but got int"):
            _hf_folder(folder, trained, {"chat_template": 7})
    elif case == "bad eos id":
        with pytest.raises(EngineInputError, match=r"generation_config\.json: eos_token_id must be a token id or a "
                                                   r"list of them, but got 'x'"):
            _hf_folder(folder, trained, {}, {"eos_token_id": "x"})
    elif case == "broken template":
        tok, _ = _hf_folder(folder, trained, {"chat_template": "{% for m in messages %}"})
        with pytest.raises(EngineInputError, match=r"tokenizer_config\.json chat_template does not compile"):
            tok.render_chat(msgs)
    elif case == "not json":
        (folder / "tokenizer_config.json").write_text("{nope")
        tokens, merges = trained
        _hf_tokenizer(tokens, merges, "smollm").save(str(folder / "tokenizer.json"))
        with pytest.raises(EngineInputError, match=r"tokenizer_config\.json"):
            tokenizer_from_folder(folder)
    else:
        tok, _ = _hf_folder(folder, trained, chatml=False)
        with pytest.raises(EngineInputError, match=r"no chat template .* no ChatML tokens; give plain-text prompts"):
            tok.render_chat(msgs)


def test_flatten_tool_messages_parses_string_arguments():
    flat = flatten_tool_messages(TOOL_CHAT, None)
    assert [m["role"] for m in flat] == ["user", "assistant", "user"]
    assert json.loads(flat[1]["content"].split("\n")[1]) == {"name": "get_weather", "arguments": {"city": "Paris"}}


# --- the real SmolLM2 tokenizer, when the asset is in the cache ---

real = pytest.mark.skipif(not is_cached("smollm2"), reason="SmolLM2 asset not cached (python -m engine assets fetch)")


@pytest.fixture(scope="module")
def smollm2_meta() -> dict:
    return read_gguf_metadata(asset_dir("smollm2") / SMOLLM2_GGUF)


@real
def test_real_smollm2_tokenizer(smollm2_meta):
    tok = tokenizer_from_gguf_metadata(smollm2_meta)
    assert smollm2_meta["tokenizer.ggml.pre"] == "smollm"
    assert tok.vocab_size == 49152 and tok.stop_ids == (2, 0) and tok.mask_id == 16
    known = {  # ids of the HF SmolLM2 tokenizer
        "Hello, we can use": [19556, 28, 392, 416, 722],
        "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
        "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
        "  multiple   spaces": [216, 2701, 256, 5600],
    }
    for text, ids in known.items():
        assert tok.encode(text) == ids
    rendered = tok.render_chat([{"role": "user", "content": "What is 2+2?"}])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok.encode(rendered)[0] == 1


@real
def test_real_smollm2_parity_with_tokenizers(smollm2_meta):
    tokens, merges = smollm2_meta["tokenizer.ggml.tokens"], smollm2_meta["tokenizer.ggml.merges"]
    ours = tokenizer_from_gguf_metadata(smollm2_meta)
    hf = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                         merges=[tuple(m.split(" ", 1)) for m in merges]))
    hf.pre_tokenizer = _hf_pre("smollm")
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, smollm2_meta["tokenizer.ggml.token_type"], strict=True) if ty == 3])
    texts = _samples(400) + [ours.render_chat(TOOL_CHAT, TOOLS)]
    for s in texts:
        assert ours.encode(s) == hf.encode(s, add_special_tokens=False).ids, repr(s)
