"""The GGUF weight-type fixtures in tests/models/quant/ (llama-quantize's files, scripts/make_quant_fixtures.py):
each file is the one manifest.json records (sha256, every tensor's type), the set covers every type issue 33
lists, and flowrt loads each file (dequantized, as it does today) and generates from it.

The manifest, not the files, is what other tests rely on to know what a fixture holds, so a regenerated set
must pass here before any test of the quantized path means anything.
"""

import hashlib
import json
from pathlib import Path

import pytest

from flowrt.engine.model.gguf_loader import read_gguf_header

QUANT_DIR = Path(__file__).resolve().parents[1] / "models" / "quant"
MANIFEST = json.loads((QUANT_DIR / "manifest.json").read_text())
FIXTURES = {f["ftype"]: f for f in MANIFEST["fixtures"]}
ISSUE_TYPES = {"F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"}


def test_every_type_has_a_pure_fixture_and_a_mixture_exists():
    assert {t for t, f in FIXTURES.items() if f["pure"]} == ISSUE_TYPES
    mixed = FIXTURES["Q4_K_M"]
    assert not mixed["pure"] and len(set(mixed["tensor_types"].values()) - {"F32"}) > 1


@pytest.mark.parametrize("ftype", FIXTURES)
def test_fixture_is_what_the_manifest_says(ftype):
    fx = FIXTURES[ftype]
    path = QUANT_DIR / fx["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fx["sha256"]
    header = read_gguf_header(path)
    assert {name: t.type_name for name, t in header.tensors.items()} == fx["tensor_types"]
    if fx["pure"]:  # llama-quantize --pure: every 2-D tensor in the file's type, 1-D norms F32
        for name, t in header.tensors.items():
            assert t.type_name == (ftype if len(t.shape) == 2 else "F32"), name


@pytest.mark.parametrize("ftype", FIXTURES)
def test_flowrt_loads_and_generates(ftype):
    from flowrt.engine import LLM, SamplingParams

    llm = LLM(model=str(QUANT_DIR / FIXTURES[ftype]["file"]), dtype="float32", seed=0)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ids = out[0].outputs[0].token_ids
    assert len(ids) == 4 and all(0 <= i < 512 for i in ids)
