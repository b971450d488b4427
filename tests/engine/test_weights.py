"""Loading Hugging Face safetensors checkpoints (flowrt.engine.model.weights)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flowrt.engine.model.weights import find_safetensors_files, load_safetensors_dir, resolve_dtype
from support import STORIES



def _reference(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}


def _tiny_state(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.up_proj.weight": torch.randn(24, 16, generator=g).to(torch.float16),
        "model.norm.weight": torch.ones(16),
        "lm_head.weight": torch.randn(32, 16, generator=g),
        "position_ids": torch.arange(8, dtype=torch.int64),
    }


def test_stories_dir_matches_safetensors():
    ref = _reference(STORIES / "model.safetensors")
    got = load_safetensors_dir(STORIES, torch.float32)
    assert got.keys() == ref.keys()
    assert "lm_head.weight" not in got  # tied
    for k in ref:
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "fp16", torch.float16])
def test_dtype_conversion(dtype):
    ref = _reference(STORIES / "model.safetensors")
    got = load_safetensors_dir(STORIES, dtype)
    want = resolve_dtype(dtype)
    for k in ref:
        assert got[k].dtype == want
        assert torch.equal(got[k], ref[k].to(want)), k


def test_mixed_dtypes_and_integer_tensors_kept(tmp_path):
    state = _tiny_state()
    save_file(state, tmp_path / "model.safetensors")
    got = load_safetensors_dir(tmp_path, torch.float32)
    assert got["position_ids"].dtype == torch.int64 and torch.equal(got["position_ids"], state["position_ids"])
    for k, v in state.items():
        if v.is_floating_point():
            assert got[k].dtype == torch.float32 and torch.equal(got[k], v.float()), k
    # same-dtype tensors are writable (private mapping) and independent of the file
    got["model.norm.weight"].mul_(2)
    assert torch.equal(load_safetensors_dir(tmp_path)["model.norm.weight"], torch.ones(16))


def test_sharded_with_index(tmp_path):
    state = _tiny_state()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / fname)
        weight_map.update({k: fname for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # a stray file not in the index is ignored
    save_file({"junk": torch.zeros(1)}, tmp_path / "extra.safetensors")
    got = load_safetensors_dir(tmp_path, torch.float32)
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(got[k], v.float() if v.is_floating_point() else v), k


def test_all_safetensors_without_index(tmp_path):
    state = _tiny_state()
    names = sorted(state)
    save_file({k: state[k] for k in names[:4]}, tmp_path / "a.safetensors")
    save_file({k: state[k] for k in names[4:]}, tmp_path / "b.safetensors")
    assert [p.name for p in find_safetensors_files(tmp_path)] == ["a.safetensors", "b.safetensors"]
    assert load_safetensors_dir(tmp_path).keys() == state.keys()


def test_single_file_path(tmp_path):
    save_file(_tiny_state(), tmp_path / "weights.safetensors")
    assert "lm_head.weight" in load_safetensors_dir(tmp_path / "weights.safetensors")


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_safetensors_dir(tmp_path / "does-not-exist")


def test_empty_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        load_safetensors_dir(tmp_path)


@pytest.mark.parametrize("fname", ["pytorch_model.bin", "model.pt", "consolidated.00.pth"])
def test_pickle_only_refused(tmp_path, fname):
    (tmp_path / fname).write_bytes(b"\x80\x04not really a pickle")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="pickle checkpoints are not supported; convert to safetensors"):
        load_safetensors_dir(tmp_path)
    with pytest.raises(ValueError, match="pickle checkpoints are not supported"):
        load_safetensors_dir(tmp_path / fname)


def test_truncated_file(tmp_path):
    save_file(_tiny_state(), tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="model.safetensors.*truncated or corrupt"):
        load_safetensors_dir(tmp_path)


@pytest.mark.parametrize("content", [b"", b"1234", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"])
def test_corrupt_file(tmp_path, content):
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_safetensors_dir(tmp_path)


def test_index_with_missing_shard(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_safetensors_dir(tmp_path)


def test_index_lists_absent_tensor(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "s1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    with pytest.raises(ValueError, match="'b'"):
        load_safetensors_dir(tmp_path)


def test_duplicate_tensor_across_shards(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match="'a' is in both"):
        load_safetensors_dir(tmp_path)


def test_bad_dtype():
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_safetensors_dir(STORIES, "int8")
    with pytest.raises(ValueError, match="floating point"):
        resolve_dtype(torch.int32)
