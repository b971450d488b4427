"""Test helper: write a GGUF file (llama.cpp's layout) from a Hugging Face Llama-family checkpoint.

    from gguf_util import write_gguf
    write_gguf("tests/models/stories260K", tmp_path / "m.gguf", qtype="Q8_0")
    write_gguf(model.state_dict(), tmp_path / "m.gguf", "F32", config=model.config, tokenizer=tok_dir)

It writes what llama.cpp's ``convert_hf_to_gguf.py`` would for the same model, so that loading it back
exercises the real conversions: GGUF tensor names, q/k rows permuted to llama.cpp's interleaved RoPE
layout (``llama`` architecture only), quantized 2-D weights with F32 norms, Llama-3 RoPE scaling as a
``rope_freqs.weight`` tensor, and the tokenizer as ``tokenizer.ggml.*`` metadata (``llama``
SentencePiece-style or ``gpt2`` byte-level BPE) plus an optional chat template.

Only test code uses this; it is written independently of ``flowrt.engine.model.gguf_loader`` (numpy, the
``gguf`` package's writer and quantizers).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

STORIES_DIR = Path(__file__).resolve().parent / "models" / "stories260K"

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")

# llama.cpp token types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    m = _LAYER_RE.match(hf_name)
    if not m or m.group(2) not in _HF_TO_GGUF_BLOCK:
        raise KeyError(f"no GGUF name for {hf_name}")
    return f"blk.{m.group(1)}.{_HF_TO_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (as convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope_theta: float, head_dim: int, scaling: Mapping[str, Any]) -> np.ndarray:
    """The ``rope_freqs.weight`` llama.cpp writes for Llama-3 RoPE scaling."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    orig = scaling.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _cfg(config, name, default=None):
    v = getattr(config, name, None)
    return default if v is None else v


def _rope(config) -> tuple[float, dict | None]:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or params
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    rtype = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return float(theta), (None if rtype in (None, "default") else dict(scaling))


def _load_tokenizer_json(tokenizer) -> tuple[dict, dict]:
    """(tokenizer.json dict, tokenizer_config dict) from a directory, a transformers tokenizer or None."""
    if tokenizer is None:
        tokenizer = STORIES_DIR
    if isinstance(tokenizer, (str, Path)):
        d = Path(tokenizer)
        tj = json.loads((d / "tokenizer.json").read_text())
        tc_path = d / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        return tj, tc
    if hasattr(tokenizer, "backend_tokenizer"):  # transformers fast tokenizer
        tj = json.loads(tokenizer.backend_tokenizer.to_str())
        tc = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        tc["chat_template"] = getattr(tokenizer, "chat_template", None)
        return tj, tc
    if hasattr(tokenizer, "to_str"):  # tokenizers.Tokenizer
        return json.loads(tokenizer.to_str()), {}
    raise TypeError(f"unsupported tokenizer {type(tokenizer)}")


def _token_name(tc: dict, key: str):
    v = tc.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return v


def _write_tokenizer(w, tj: dict, tc: dict, config, vocab_size: int, pre: str | None,
                     chat_template: str | None) -> None:
    model = tj["model"]
    if model.get("type") != "BPE":
        raise ValueError("write_gguf supports BPE tokenizers only")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["id"]: t for t in tj.get("added_tokens", [])}
    for i, t in added.items():
        vocab[t["content"]] = i
    n = max(vocab.values()) + 1
    if n > vocab_size:
        raise ValueError(f"tokenizer has {n} tokens but the model's vocab_size is {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for tok, i in vocab.items():
        tokens[i] = tok
    text = json.dumps(tj.get("pre_tokenizer")) + json.dumps(tj.get("decoder"))
    byte_level = "ByteLevel" in text
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]

    types = [_UNUSED] * vocab_size
    for tok, i in vocab.items():
        types[i] = _NORMAL
        if not byte_level and re.fullmatch(r"<0x[0-9A-F]{2}>", tok):
            types[i] = _BYTE
    for i, t in added.items():
        types[i] = _CONTROL if t.get("special") else _USER_DEFINED
    unk = model.get("unk_token")
    if unk in vocab:
        types[vocab[unk]] = _UNKNOWN

    if byte_level:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or "gpt2")
    else:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre(pre or "default")
        # SentencePiece-style scores: a merged piece scores by its merge rank, base pieces lowest
        rank = {m.replace(" ", ""): r for r, m in enumerate(merges)}
        scores = [-float(rank[t]) if t in rank else -float(len(merges) + i) for i, t in enumerate(tokens)]
        w.add_token_scores(scores)
        w.add_add_space_prefix(True)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)

    def tid(key, cfg_key):
        name = _token_name(tc, key)
        if name is not None and name in vocab:
            return vocab[name]
        v = getattr(config, cfg_key, None)
        return v[0] if isinstance(v, list) else v

    for key, cfg_key, adder in (("bos_token", "bos_token_id", w.add_bos_token_id),
                                ("eos_token", "eos_token_id", w.add_eos_token_id),
                                ("unk_token", "unk_token_id", w.add_unk_token_id),
                                ("pad_token", "pad_token_id", w.add_pad_token_id)):
        v = tid(key, cfg_key)
        if v is not None:
            adder(int(v))
    post = json.dumps(tj.get("post_processor"))
    bos = _token_name(tc, "bos_token")
    adds_bos = tc.get("add_bos_token")
    if adds_bos is None:
        adds_bos = bool(bos) and f'"{bos}"' in post
    w.add_add_bos_token(bool(adds_bos))
    w.add_add_eos_token(bool(tc.get("add_eos_token", False)))
    template = chat_template if chat_template is not None else tc.get("chat_template")
    if template:
        w.add_chat_template(template)


def write_gguf(source, out_path, qtype: str = "F32", *, config=None, tokenizer=None,
               tokenizer_pre: str | None = None, chat_template: str | None = None, name: str | None = None,
               qtypes: Mapping[str, str] | None = None, architecture: str | None = None,
               extra_tensors: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write ``source`` as a GGUF file at ``out_path``; returns the path.

    source: a Hugging Face model directory (config.json + safetensors [+ tokenizer.json]) or a state dict
        with HF names (then ``config`` is required).
    qtype: the type of every 2-D weight whose rows fit its blocks ("F32", "F16", "BF16", "Q8_0", "Q4_0",
        "Q4_1", "Q5_0", ...); 1-D tensors (norms, biases) stay F32 as llama.cpp keeps them.
    qtypes: per-tensor overrides, HF name -> type.
    tokenizer: a directory with tokenizer.json, a transformers fast tokenizer or a ``tokenizers.Tokenizer``;
        default: the source directory's, else stories260K's. Its vocabulary is padded to vocab_size.
    tokenizer_pre: the ``tokenizer.ggml.pre`` value (default "default" / "gpt2").
    chat_template: written as ``tokenizer.chat_template`` (default: the tokenizer config's, if any).
    architecture: override ``general.architecture`` (default from config.model_type; mistral -> llama).
    extra_tensors: raw arrays added under these GGUF names as they are (for tests of bad files).
    """
    import gguf
    from gguf import GGMLQuantizationType, quants

    if isinstance(source, (str, Path)):
        from transformers import AutoConfig
        from flowrt.engine.model.weights import load_safetensors_dir

        src = Path(source)
        config = config or AutoConfig.from_pretrained(src)
        state = load_safetensors_dir(src, torch.float32)
        if tokenizer is None and (src / "tokenizer.json").exists():
            tokenizer = src
    else:
        if config is None:
            raise ValueError("write_gguf(state_dict, ...) needs config=")
        state = dict(source)

    model_type = config.model_type
    arch = architecture or {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
    if arch is None:
        raise ValueError(f"write_gguf: no GGUF architecture for model_type {model_type!r}")
    n_head = config.num_attention_heads
    n_kv = _cfg(config, "num_key_value_heads", n_head)
    head_dim = _cfg(config, "head_dim", config.hidden_size // n_head)
    theta, scaling = _rope(config)
    model_name = name or ("Mistral tiny" if model_type == "mistral" else f"tiny {model_type}")

    out_path = Path(out_path)
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_name(model_name)
    w.add_context_length(int(config.max_position_embeddings))
    w.add_embedding_length(int(config.hidden_size))
    w.add_block_count(int(config.num_hidden_layers))
    w.add_feed_forward_length(int(config.intermediate_size))
    w.add_head_count(int(n_head))
    w.add_head_count_kv(int(n_kv))
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(int(config.vocab_size))
    w.add_rope_dimension_count(int(head_dim))
    if head_dim != config.hidden_size // n_head or arch == "qwen3":
        w.add_key_length(int(head_dim))
        w.add_value_length(int(head_dim))
    if scaling is not None:
        rtype = scaling.get("rope_type", scaling.get("type"))
        if rtype == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(scaling["factor"]))
        elif rtype != "llama3":
            raise ValueError(f"write_gguf: RoPE scaling {rtype!r} not supported")
    ftype = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}.get(qtype)
    if ftype is not None:
        w.add_file_type(ftype)

    tj, tc = _load_tokenizer_json(tokenizer)
    _write_tokenizer(w, tj, tc, config, int(config.vocab_size), tokenizer_pre, chat_template)

    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(theta, head_dim, scaling))

    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        arr = tensor.detach().to(torch.float32).cpu().numpy()
        if arch == "llama" and re.search(r"self_attn\.[qk]_proj\.(weight|bias)$", hf_name):
            arr = llama_cpp_permute(arr, n_head if ".q_proj." in hf_name else n_kv)
        t = (qtypes or {}).get(hf_name, qtype if arr.ndim == 2 else "F32")
        qt = GGMLQuantizationType[t]
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if block > 1 and arr.shape[-1] % block:
            qt = GGMLQuantizationType.F16  # rows that do not fill whole blocks (llama.cpp falls back too)
        if qt.name in ("I8", "I16", "I32", "I64"):  # integer types: only for tests of files the loader must refuse
            w.add_tensor(gguf_name(hf_name), arr.astype(getattr(np, "int" + qt.name[1:])))
        elif qt == GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(hf_name), np.ascontiguousarray(arr))
        elif qt == GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(hf_name), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_name(hf_name), quants.quantize(arr, qt), raw_dtype=qt)

    for gname, arr in (extra_tensors or {}).items():
        w.add_tensor(gname, arr)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
