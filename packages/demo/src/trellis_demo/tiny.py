"""Tiny local models for tests and the demo: a trained tokenizer plus a random Qwen2, never downloaded.

``make_tiny_model`` trains a byte-level BPE tokenizer on the task's own text with exactly the
pipeline that ``transformers``' ``Qwen2Tokenizer`` rebuilds on load (NFC, Qwen2's split regex,
which isolates every digit, then byte-level), so ``AutoTokenizer.from_pretrained`` and
``PreTrainedTokenizerFast(tokenizer_file=...)`` tokenize identically; numbers tokenize digit by
digit. It then builds a ``Qwen2ForCausalLM`` with random weights seeded by ``seed`` and saves a
normal Hugging Face folder. The folder is cached: a fingerprint of the arguments, the texts and
the library versions is stored in it, and a call with the same inputs returns at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from trellis.kit.runs import check_replaceable

logger = logging.getLogger("trellis")

FINGERPRINT_FILE = "trellis_tiny_model.json"
FORMAT_VERSION = 2  # 2: the vision chat template renders tools

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
BYTE_ALPHABET_SIZE = 256
DEFAULT_MERGES = 64  # BPE merges learned when vocab_size is None

# Qwen2's pre-tokenizer regex (transformers' tokenization_qwen2.PRETOKENIZE_REGEX): ``\p{N}`` takes
# one digit at a time, so "1234" is four tokens.
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# ChatML as Qwen2 writes it, without Qwen2's default system message (shorter prompts for tiny models).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# CHAT_TEMPLATE with tools: their schemas in a first system turn, an assistant's tool calls after its
# content as Hermes ``<tool_call>`` JSON (what the ``hermes`` tool parser reads), results as ``tool`` turns.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A vision-language model's tokens (Qwen2-VL's): an image is ``<|vision_start|><|image_pad|><|vision_end|>`` in the
# rendered prompt, its pad token repeated once per merged patch when tokenized (ids 3..6 of a tiny vision model).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# TOOLS_CHAT_TEMPLATE for content that is text or a list of parts ({"type": "image"} or {"type": "text", "text": ...}),
# in any role (a tool result may show images).
VISION_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '" + IMAGE_PLACEHOLDER + "' }}{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A tiny vision model's images: 14-pixel patches merged 2 x 2, between 2 x 2 and 8 x 8 patches (56 to 112 pixels a side).
PATCH, MERGE = 14, 2
# A tiny mixture-of-experts model's experts per layer and experts per token.
MOE_EXPERTS, MOE_TOP_K = 4, 2
MIN_PIXELS, MAX_PIXELS = (2 * PATCH) ** 2 * 4, (2 * PATCH) ** 2 * 16

# Role words the chat template adds, so that BPE learns them as whole tokens.
_SCAFFOLD = "system\nuser\nassistant\n"


def make_tiny_model(
    out_dir: str | os.PathLike,
    texts: Iterable[str],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    max_position_embeddings: int = 512,
    vision: bool = False,
    moe: bool = False,
) -> Path:
    """Build (or reuse) a tiny Qwen2 model folder at ``out_dir`` and return its path.

    vision: a Qwen2-VL instead: a one-block vision tower (14-pixel patches, merged 2 x 2 into the
        language model's width) before the same language model, the vision tokens in the tokenizer
        (:data:`VISION_TOKENS`), a chat template that renders image parts, and the image processor
        (``preprocessor_config.json``: 56 to 112 pixels a side); texts are still the tokenizer's.
    moe: a Qwen3-MoE instead: every layer's MLP is :data:`MOE_EXPERTS` experts of width
        ``intermediate_size / 4``, each token routed to the top :data:`MOE_TOP_K` (weights renormalised).

    texts: the text the tokenizer is trained on (e.g. ``trellis_demo.tasks.task_texts()``).
    intermediate_size: MLP width; None = ``4 * hidden_size``.
    vocab_size: embedding rows and the BPE trainer's cap; None = 256 bytes + 3 special tokens +
        up to 64 learned merges. Rows past the trained vocabulary are never produced by the tokenizer.
    seed: seeds the weights (the tokenizer depends on ``texts`` only). Same inputs, same folder.

    The folder holds ``model.safetensors``, ``config.json``, ``generation_config.json`` (eos =
    ``<|im_end|>``, pad = ``<|endoftext|>``), ``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja`` and the fingerprint ``trellis_tiny_model.json``. It is written to a
    temporary sibling folder and renamed into place, so a crash never leaves half a folder.
    """
    out = Path(out_dir)
    texts = list(texts)
    if not texts:
        raise ValueError("make_tiny_model: texts is empty; pass the task's text, e.g. trellis_demo.tasks.task_texts()")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise TypeError(f"make_tiny_model: texts[{bad[0]}] is {type(texts[bad[0]]).__name__}, not str; pass strings")
    _check_sizes(hidden_size, num_layers, num_heads, num_kv_heads, vocab_size, max_position_embeddings)
    args = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size if intermediate_size is not None else 4 * hidden_size,
        "vocab_size": vocab_size,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "seed": seed,
        "max_position_embeddings": max_position_embeddings,
        **({"vision": True} if vision else {}),
        **({"moe": True} if moe else {}),
    }
    if vision and moe:
        raise ValueError("make_tiny_model: vision and moe together are not built; choose one")
    fingerprint = _fingerprint(args, texts)
    if _read_fingerprint(out) == fingerprint:
        logger.debug("tiny model at %s is up to date", out)
        return out
    check_replaceable(out, FINGERPRINT_FILE, "make_tiny_model")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        _build(tmp, texts, args)
        (tmp / FINGERPRINT_FILE).write_text(json.dumps(fingerprint, indent=2, sort_keys=True) + "\n")
        _swap_into_place(tmp, out, fingerprint)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built tiny model at %s (hidden %d, %d layers, seed %d)", out, hidden_size, num_layers, seed)
    return out


def train_tokenizer(texts: Iterable[str], vocab_size: int | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` (byte-level BPE, Qwen2's pipeline) trained on ``texts``.

    Ids 0, 1, 2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    texts = list(texts)
    cap = vocab_size if vocab_size is not None else BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS) + DEFAULT_MERGES
    trainer = BpeTrainer(
        vocab_size=cap,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts + [_SCAFFOLD] * max(2, len(texts) // 4), trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"tokenizer training put {t!r} at id {tok.token_to_id(t)}, expected {i}")
    return tok


def make_tiny_tokenizer(texts: Iterable[str], vocab_size: int | None = None, vision: bool = False) -> Any:
    """A ``transformers`` fast tokenizer around :func:`train_tokenizer`: eos ``<|im_end|>``, pad
    ``<|endoftext|>``, the ChatML template; ``vision``: with :data:`VISION_TOKENS` added and
    :data:`VISION_CHAT_TEMPLATE`. In memory only (tests that need no model use it)."""
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(texts, vocab_size)
    if vision:
        tok.add_special_tokens(list(VISION_TOKENS))
    template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=None, chat_template=template)


def _build(folder: Path, texts: list[str], args: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config
    from transformers.utils import logging as hf_logging

    fast = make_tiny_tokenizer(texts, args["vocab_size"], args.get("vision", False))
    tok = fast.backend_tokenizer
    eos_id, pad_id = tok.token_to_id(IM_END), tok.token_to_id(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=max(tok.get_vocab_size(), args["vocab_size"] or 0),
        hidden_size=args["hidden_size"],
        intermediate_size=args["intermediate_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_heads"],
        num_key_value_heads=args["num_kv_heads"],
        max_position_embeddings=args["max_position_embeddings"],
        tie_word_embeddings=args["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    if args.get("vision"):
        config = _vision_config(config, tok)
    if args.get("moe"):
        config = _moe_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args["seed"])
        model = _model_class(args)(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
        fast.save_pretrained(folder)
        if args.get("vision"):
            _image_processor().save_pretrained(folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    # transformers picks Qwen2Tokenizer for model_type qwen2 whatever this says; say so honestly.
    # That class rebuilds the same normalizer / pre-tokenizer / decoder as ours, so both load paths agree.
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.update({"tokenizer_class": "Qwen2Tokenizer", "model_max_length": args["max_position_embeddings"]})
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def _vision_config(text: Any, tok: Any) -> Any:
    """Qwen2-VL around the text config ``text``: a one-block vision tower merged into its width, the
    rotary half-dimensions split over time, height and width as Qwen2-VL splits them (1/4, 3/8, 3/8)."""
    from transformers import Qwen2VLConfig

    half = text.hidden_size // text.num_attention_heads // 2
    t = half // 4
    section = [t, (half - t) // 2, half - t - (half - t) // 2]
    ids = {name: tok.token_to_id(token) for name, token in zip(("vision_start", "vision_end", "image", "video"), VISION_TOKENS)}
    text_config = text.to_dict() | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}
    vision_config = {"depth": 1, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "hidden_size": text.hidden_size}
    vision_config |= {"patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2}
    return Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=text.tie_word_embeddings,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        dtype="float32",
    )


def _moe_config(text: Any) -> Any:
    """Qwen3-MoE with ``text``'s sizes: experts a quarter of its MLP width, no shared expert."""
    from transformers import Qwen3MoeConfig

    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    keep += ("max_position_embeddings", "tie_word_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")
    sizes = {key: getattr(text, key) for key in keep}
    experts = {"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K, "moe_intermediate_size": text.intermediate_size // 4}
    return Qwen3MoeConfig(**sizes, **experts, head_dim=text.hidden_size // text.num_attention_heads, norm_topk_prob=True, dtype="float32")


def _model_class(args: dict[str, Any]) -> Any:
    from transformers import Qwen2ForCausalLM, Qwen2VLForConditionalGeneration, Qwen3MoeForCausalLM

    return Qwen2VLForConditionalGeneration if args.get("vision") else Qwen3MoeForCausalLM if args.get("moe") else Qwen2ForCausalLM


def _image_processor() -> Any:
    """Qwen2-VL's image processor on PIL (its default backend needs torchvision, which the CPU build of torch here lacks)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2)


def _swap_into_place(tmp: Path, out: Path, fingerprint: dict) -> None:
    """Rename ``tmp`` to ``out``; an older (different) tiny model at ``out`` is replaced."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        # Another process built the same folder meanwhile: keep theirs when it matches.
        if _read_fingerprint(out) != fingerprint:
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fingerprint(args: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return {
        "format": FORMAT_VERSION,
        "args": args,
        "texts_sha256": h.hexdigest(),
        "num_texts": len(texts),
        "versions": {name: metadata.version(name) for name in ("transformers", "tokenizers", "torch")},
    }


def _read_fingerprint(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / FINGERPRINT_FILE).read_text())
    except (OSError, ValueError):
        return None


def _check_sizes(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int | None, max_pos: int) -> None:
    for name, v in (("hidden_size", hidden), ("num_layers", layers), ("num_heads", heads), ("num_kv_heads", kv_heads)):
        if v <= 0:
            raise ValueError(f"make_tiny_model: {name}={v} must be positive")
    if hidden % heads:
        raise ValueError(f"make_tiny_model: hidden_size={hidden} must divide by num_heads={heads}; change one of them")
    if heads % kv_heads:
        raise ValueError(f"make_tiny_model: num_heads={heads} must divide by num_kv_heads={kv_heads}; change one of them")
    if (hidden // heads) % 2:
        raise ValueError(f"make_tiny_model: head size hidden_size/num_heads={hidden // heads} must be even (rotary embeddings)")
    minimum = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if vocab is not None and vocab < minimum:
        raise ValueError(f"make_tiny_model: vocab_size={vocab} is below the byte-level minimum {minimum}; use >= {minimum} or None")
    if max_pos <= 0:
        raise ValueError(f"make_tiny_model: max_position_embeddings={max_pos} must be positive")
