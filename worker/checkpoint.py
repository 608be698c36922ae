"""Random-weight HunyuanOCR-1.5 checkpoints, for tests and benchmarks (no weights can be downloaded).

``make_random_checkpoint(out, "full")`` writes the real 1.5 dimensions (~996M parameters, bf16):
memory and speed are real, text is gibberish. ``"tiny"`` writes a few-MB model (head_dim 32, so
vLLM's CPU attention accepts it) for CPU tests. Both use the real special-token strings and the
real flat ("legacy Tencent") config layout, so they load through the same code path as
``tencent/HunyuanOCR``: ``AutoConfig``/``AutoProcessor``/``HunYuanVLForConditionalGeneration``.

The tokenizer is a byte-level BPE without merges (one token per byte) padded with filler tokens
up to the special-token block, which sits at the top of the vocabulary as in the real one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

#: the real chat template (tencent/HunyuanOCR tokenizer_config.json): optional system message,
#: user content [image, text] → "<bos>{system}<sep>" + image span + text + "<｜hy_User｜>"
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% if messages[0]['content'] is string %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set system_message = messages[0]['content']['text'] %}{% endif %}"
    "<｜hy_begin▁of▁sentence｜>{{ system_message }}<｜hy_place▁holder▁no▁3｜>"
    "{% else %}{% set loop_messages = messages %}<｜hy_begin▁of▁sentence｜>{% endif %}"
    "{% for message in loop_messages %}{% if message['role'] == 'user' %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<｜hy_place▁holder▁no▁100｜><｜hy_place▁holder▁no▁102｜><｜hy_place▁holder▁no▁101｜>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<｜hy_User｜>{% elif message['role'] == 'assistant' %}{{ message['content'] }}"
    "<｜hy_Assistant｜>{% endif %}{% endfor %}"
)

BOS = "<｜hy_begin▁of▁sentence｜>"
PAD = "<｜hy_▁pad▁｜>"
USER = "<｜hy_User｜>"
ASSISTANT = "<｜hy_Assistant｜>"


def placeholder(n: int) -> str:
    return f"<｜hy_place▁holder▁no▁{n}｜>"


IMAGE_START, IMAGE_END, IMAGE, IMAGE_NEWLINE = (placeholder(n) for n in (100, 101, 102, 103))


def special_tokens() -> list[str]:
    """The real special-token block in id order (offset 0 = id 120000 in the real vocabulary)."""
    head = [BOS, "<｜hy_end▁of▁sentence｜>", PAD, "<｜hy_fim▁hole｜>", "<｜hy_fim▁begin｜>",
            "<｜hy_fim▁end｜>", USER, ASSISTANT, "<｜hy_EOT｜>"]
    head += [placeholder(n) for n in range(11, 20)] + [placeholder(n) for n in range(0, 11)]
    head += ["<think>", "</think>", "<answer>", "</answer>", "<tool_call>", "</tool_call>",
             "<tool_calls>", "</tool_calls>", "<tool_response>", "</tool_response>", "/think",
             "/no_think", "<tool_responses>", "</tool_responses>"]
    return head + [placeholder(n) for n in range(25, 800)]


#: offset of the special block and vocabulary size per size; ids follow as offset + index
_LAYOUT = {"full": (120000, 120818), "tiny": (896, 1024)}


def token_ids(size: Literal["full", "tiny"]) -> dict[str, int]:
    """Ids of the named special tokens for a checkpoint size (the real ones for ``full``)."""
    offset, _ = _LAYOUT[size]
    index = {tok: i for i, tok in enumerate(special_tokens())}
    named = {"bos": BOS, "pad": PAD, "user": USER, "assistant": ASSISTANT, "eos": placeholder(2),
             "sep": placeholder(3), "image_start": IMAGE_START, "image_end": IMAGE_END,
             "image": IMAGE, "image_newline": IMAGE_NEWLINE}
    return {name: offset + index[tok] for name, tok in named.items()}


def _config(size: Literal["full", "tiny"]) -> dict[str, Any]:
    ids = token_ids(size)
    _, vocab = _LAYOUT[size]
    if size == "full":
        text: dict[str, Any] = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                                    num_attention_heads=16, num_key_value_heads=8, head_dim=128)
        vision: dict[str, Any] = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                      num_attention_heads=16, out_hidden_size=1024)
        section, dtype = [16, 16, 16, 16], "bfloat16"
    else:
        text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32)
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      out_hidden_size=128)
        section, dtype = [4, 4, 4, 4], "bfloat16"
    # The real checkpoint's flat layout: text fields at the top level, legacy xdrope rope_scaling
    # (transformers folds both into text_config / rope_parameters; vLLM wants the `factor` entry).
    return {
        "architectures": ["HunYuanVLForConditionalGeneration"],
        "model_type": "hunyuan_vl",
        **text,
        "attention_head_dim": text["head_dim"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        **_token_fields(ids),
        "initializer_range": 0.02,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "type": "xdrope", "xdrope_section": section},
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_qk_norm": True,
        "dtype": dtype,
        # as in the real file; transformers also reads it to skip a Mistral-regex tokenizer check
        "transformers_version": "4.49.0",
        "vocab_size": vocab,
        "org_vocab_size": vocab,
        "vision_config": _vision_config(vision),
    }


def _token_fields(ids: dict[str, int]) -> dict[str, Any]:
    """The special tokens' ids, under every name the checkpoint's readers look them up by."""
    return {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "eod_token_id": ids["eos"],
        "pad_id": ids["pad"],
        "pad_token_id": -1,
        "sep_token_id": 0,
        "image_start_token_id": ids["image_start"],
        "image_end_token_id": ids["image_end"],
        "image_token_id": ids["image"],
        "image_newline_token_id": ids["image_newline"],
        "im_start_id": ids["image_start"],
        "im_end_id": ids["image_end"],
        "im_newline_id": ids["image_newline"],
    }


def _vision_config(vision: dict[str, Any]) -> dict[str, Any]:
    return {
        **vision,
        "hidden_act": "gelu",
        "interpolate_mode": "bilinear",
        "max_image_size": 2048,
        "min_image_size": 512,
        "max_vit_seq_len": 16384,
        "img_max_token_num": 4096,
        "num_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "rms_norm_eps": 1e-5,
        "cat_extra_token": 1,
    }


def _write_tokenizer(out: Path, size: Literal["full", "tiny"]) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    offset, vocab_size = _LAYOUT[size]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # bytes_to_unicode order, so byte b is id b (stable across runs: alphabet() is a set)
    byte_chars = [_byte_char(b) for b in range(256)]
    assert set(byte_chars) == set(alphabet)
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    vocab.update({f"<｜hy_filler▁{i}｜>": i for i in range(256, offset)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens()[: vocab_size - offset]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))

    ids = token_ids(size)
    added = {str(offset + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True} for i, s in enumerate(specials)}
    config = {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": ASSISTANT,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "extra_special_tokens": {"image_token": IMAGE, "image_start_token": IMAGE_START,
                                 "image_end_token": IMAGE_END},
        "chat_template": CHAT_TEMPLATE,
    }
    assert tok.token_to_id(IMAGE) == ids["image"]
    _dump(out / "tokenizer_config.json", config)
    _dump(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": ASSISTANT, "pad_token": PAD})
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _byte_char(b: int) -> str:
    """GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_random_checkpoint(
    out: Path, size: Literal["full", "tiny"], seed: int = 0, *, device: str | None = None
) -> Path:
    """Write a loadable random-weight HunyuanOCR-1.5 model directory to ``out`` and return it.

    ``device`` only speeds up initialisation of the full model (e.g. "cuda"); weights are
    deterministic for a seed on a given device.
    """
    if size not in _LAYOUT:
        raise ValueError(f"size must be 'full' or 'tiny', not {size!r}")
    import torch
    from transformers import HunYuanVLConfig, HunYuanVLForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = _config(size)
    _dump(out / "config.json", raw)
    config = HunYuanVLConfig.from_pretrained(out)
    torch.manual_seed(seed)
    if device and device.startswith("cuda"):
        torch.cuda.manual_seed_all(seed)
    dtype = torch.bfloat16 if raw["dtype"] == "bfloat16" else torch.float32
    with torch.device(device or "cpu"):
        model = HunYuanVLForConditionalGeneration(config)
    model.to(dtype)  # type: ignore[arg-type]  # in place; transformers' stub is too narrow
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")
    del model
    # save_pretrained rewrites config.json in the nested layout; keep the real flat one
    _dump(out / "config.json", raw)
    ids = token_ids(size)
    _dump(out / "generation_config.json", {
        "bos_token_id": ids["bos"], "pad_token_id": ids["pad"],
        "eos_token_id": [ids["assistant"], ids["eos"]],
        "do_sample": False, "top_k": 1, "top_p": 1.0, "temperature": 0.0, "repetition_penalty": 1.0,
    })
    _write_tokenizer(out, size)
    pre = {"min_pixels": 512 * 512, "max_pixels": 2048 * 2048, "patch_size": 16, "temporal_patch_size": 1,
           "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
           "image_std": [0.26862954, 0.26130258, 0.27577711],
           "image_processor_type": "HunYuanVLImageProcessorPil", "processor_class": "HunYuanVLProcessor"}
    _dump(out / "preprocessor_config.json", pre)
    _dump(out / "processor_config.json", {"processor_class": "HunYuanVLProcessor", "cat_extra_token": True})
    return out
