"""Issue 39 item 12: a model's config is checked against its checkpoint's tensors and sane ranges before the model
allocates anything (a config.json edited, a GGUF's metadata edited): a ValueError naming the field, where
num_hidden_layers 100000 allocated 2.46 GB for 31 s before "missing tensor", max_position_embeddings 1e10 tried a
40 GB allocation, and num_attention_heads 0 gave a raw torch shape error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from support import STORIES
from flowrt.engine.model import loader as model_loader
from flowrt.engine.model.loader import load_model


@pytest.fixture(autouse=True)
def no_model_built(monkeypatch):
    """Every load here must be refused before the model (its layers, its rotary tables) is built."""
    def built(*args, **kwargs):
        raise AssertionError("the model was built (allocated) before the config was refused")

    monkeypatch.setattr(model_loader, "LlamaModel", built)


def _stories_with(tmp_path, **changes) -> str:
    d = tmp_path / "stories"
    shutil.copytree(STORIES, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _load(path: str, max_model_len: int | None = None) -> None:
    load_model(path, torch.float32, torch.device("cpu"), max_model_len)


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 100000}, r"num_hidden_layers=100000, but the checkpoint holds tensors for 5 layers"),
    ({"num_hidden_layers": 3}, r"num_hidden_layers=3, but the checkpoint holds tensors for 5 layers"),
    ({"max_position_embeddings": 1e10}, r"max_position_embeddings=10000000000 is out of range: its rotary tables "
                                        r"would take 596\.0 GiB \(at most 16,777,216 positions at head_dim 8\)"),
    ({"num_attention_heads": 0}, r"num_attention_heads=0: it must be a positive integer"),
    ({"num_attention_heads": 0, "head_dim": None}, r"num_attention_heads=0: it must be a positive integer"),
    ({"num_attention_heads": 4}, r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(64, 64\), but the "
                                 r"model's config \(num_attention_heads x head_dim, hidden_size\) makes it \(32, 64\)"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=8 and num_key_value_heads=3"),
    ({"hidden_size": -64}, r"hidden_size=-64: it must be a positive integer"),
    ({"intermediate_size": "big"}, r"intermediate_size='big': it must be a positive integer"),
    ({"vocab_size": 1000}, r"'model.embed_tokens.weight' has shape \(512, 64\), .*\(vocab_size, hidden_size\)"),
    ({"head_dim": 7, "num_attention_heads": 8}, r"head_dim=7: rotary embeddings need an even one"),
    ({"rope_theta": -1.0}, r"rope_theta=-1.0: it must be finite and > 0"),
])
def test_an_edited_config_json_is_refused_naming_the_field(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        _load(_stories_with(tmp_path, **changes))


def test_a_max_model_len_past_the_rotary_bound_is_named():
    with pytest.raises(ValueError, match=r"max_model_len=1000000000 is out of range"):
        _load(str(STORIES), max_model_len=10**9)


def test_an_edited_gguf_is_refused_naming_the_field(tmp_path):
    from transformers import AutoConfig

    from gguf_util import write_gguf

    config = AutoConfig.from_pretrained(STORIES)
    config.max_position_embeddings = 2**32 - 1   # the largest llama.context_length GGUF's uint32 holds
    path = write_gguf(STORIES, tmp_path / "m.gguf", "F32", config=config)
    with pytest.raises(ValueError, match=r"max_position_embeddings=4294967295 is out of range"):
        _load(str(path))
