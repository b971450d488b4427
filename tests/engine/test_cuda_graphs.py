"""Decode graphs (engine/model/cuda_graphs.py) through their CPU emulation: the same staging, padding and bucket logic
as on CUDA, with "replays" that run the forward eagerly on the static buffers (Triton kernels interpreted).

A padded graph step must give the eager step's logits, write K/V only at its real rows' slots, and every step
a graph cannot run (prefill or mixed, oversize, too-wide tables) must fall back to the eager path."""

import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from flowrt import kernels  # noqa: E402
from flowrt.engine import LLMEngine, SamplingParams  # noqa: E402
from flowrt.engine.model.cuda_graphs import GraphConfig, batch_buckets, bucket_for  # noqa: E402
from flowrt.kernels import _dispatch  # noqa: E402
from support import make_tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not kernels.HAS_TRITON, reason=f"triton unavailable: {kernels.TRITON_IMPORT_ERROR}"),
    pytest.mark.skipif(not torch.cuda.is_available() and not _dispatch.can_interpret(),
                       reason="no CUDA, and triton was imported before TRITON_INTERPRET=1 was set"),
]

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One layer keeps the interpreted kernels fast; the graph path is forced on with buckets up to 4 (speculation
    off: its verify steps run eagerly, and these tests count pure decode steps)."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_cg"), num_hidden_layers=1, max_position_embeddings=256)
    eng = LLMEngine(model=path, dtype="float32", attention_backend="triton", block_size=16, device="cpu",
                    speculative_config=None)
    assert eng.runner.configure_graphs(GraphConfig(emulate=True, max_batch=4))
    return eng


def test_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(256)[-3:] == (192, 224, 256)
    b = batch_buckets(64)
    assert [bucket_for(n, b) for n in (1, 3, 4, 9, 33, 64)] == [1, 4, 4, 16, 48, 64]
    assert bucket_for(65, b) is None


def test_graph_config_from_env(monkeypatch):
    monkeypatch.setenv("FLOWRT_GRAPH_EMULATE", "1")
    monkeypatch.setenv("FLOWRT_ENFORCE_EAGER", "0")
    assert GraphConfig.from_env() == GraphConfig(enabled=True, emulate=True)
    monkeypatch.setenv("FLOWRT_ENFORCE_EAGER", "1")
    assert not GraphConfig.from_env().enabled


def test_only_graph_capable_backends_and_devices(engine):
    from flowrt.engine.model.attention import TorchAttentionBackend
    from flowrt.engine.model.runner import ModelRunner

    r = engine.runner
    assert ModelRunner(r.model, r.kv, 16, TorchAttentionBackend(), r.device, GraphConfig(emulate=True)).graphs is None
    assert ModelRunner(r.model, r.kv, 16, r.backend, r.device, GraphConfig()).graphs is None  # CPU, not emulated
    assert ModelRunner(r.model, r.kv, 16, r.backend, r.device, GraphConfig(enabled=False, emulate=True)).graphs \
        is None


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_engine_args_reach_the_runner(monkeypatch, tmp_path, enforce_eager):
    """EngineArgs.enforce_eager turns the graphs off; max_num_seqs is the largest bucket."""
    monkeypatch.setenv("FLOWRT_GRAPH_EMULATE", "1")
    path = make_tiny_model(tmp_path, num_hidden_layers=1, max_position_embeddings=256)
    eng = LLMEngine(model=path, dtype="float32", attention_backend="triton", device="cpu", max_num_seqs=6,
                    enforce_eager=enforce_eager)
    g = eng.runner.graphs
    assert (g is None) == enforce_eager
    if g is not None:
        assert g.max_batch == 6 and g.max_model_len == eng.max_model_len


def _batch(table_lens, new_tokens):
    seqs = [SimpleNamespace(kv=SimpleNamespace(block_table=list(range(n)))) for n in table_lens]
    return SimpleNamespace(seqs=seqs, num_new_tokens=new_tokens)


def test_bucket_rules(engine):
    g = engine.runner.graphs
    assert g.width == 16  # 256 positions / block size 16
    assert g.bucket(_batch([1, 2, 3], [1, 1, 1])) == 4
    assert g.bucket(_batch([1], [1])) == 1
    assert g.bucket(_batch([1, 2], [1, 5])) is None  # a prefill chunk in the step
    assert g.bucket(_batch([1] * 5, [1] * 5)) is None  # more rows than the largest bucket
    assert g.bucket(_batch([17], [1])) is None  # a table wider than the static buffer


@pytest.mark.slow  # whole interpreted forwards, each graph step twice (graph and eager): seconds
def test_padded_graph_steps_match_eager_and_touch_only_their_slots(engine):
    """Every graph step is also run eagerly on the same batch: same logits; and the graph step's KV writes
    land only on its real rows' slots (padded rows have slot -1)."""
    runner = engine.runner
    orig_prepare, orig_execute = runner.prepare, runner.execute
    seen = {"graph": [], "eager": 0}
    last = {}

    def prepare(batch, logit_rows, eager=False):
        last["batch"], last["rows"] = batch, list(logit_rows)
        return orig_prepare(batch, logit_rows, eager)

    def execute(inp):
        if inp.graph is None:
            seen["eager"] += 1
            return orig_execute(inp)
        bs = runner.block_size
        want = {seq.kv.block_table[seq.kv.num_computed_tokens // bs] * bs + seq.kv.num_computed_tokens % bs
                for seq in last["batch"].seqs}
        before = runner.kv.clone()
        out = orig_execute(inp)
        got = out.logits
        changed = (runner.kv != before).flatten(4).any(-1).any(0).any(0).flatten()  # [num_blocks * bs]
        slots = set(torch.nonzero(changed).flatten().tolist())
        assert slots and slots <= want, (slots, want)
        ref = orig_execute(orig_prepare(last["batch"], last["rows"], eager=True)).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        seen["graph"].append((inp.graph.bucket, inp.graph.num_rows))
        return out

    runner.prepare, runner.execute = prepare, execute
    try:
        p = SamplingParams(max_tokens=4, **GREEDY)
        reqs = [engine.add_request({"prompt_token_ids": ids}, p) for ids in ([1, 5, 6, 7], [1, 9], [1, *range(30, 50)])]
        engine.step()  # the three prompts: prefill, eager
        engine.step()  # decode of 3 rows: bucket 4, one padded row
        late = engine.add_request({"prompt_token_ids": [1, 60, 61]}, SamplingParams(max_tokens=2, **GREEDY))
        while not all(r.finished for r in [*reqs, late]):
            engine.step()  # a mixed step (decodes + the late prompt: eager), then decodes of 4 rows
    finally:
        runner.prepare, runner.execute = orig_prepare, orig_execute
    assert seen["eager"] == 2  # the prefill step and the mixed step
    assert (4, 3) in seen["graph"] and (4, 4) in seen["graph"]


@pytest.mark.slow  # two whole interpreted generations: seconds
def test_graph_tokens_equal_eager_tokens(engine):
    """Whole generations with graphs (buckets 1, 2 and 4, padded) and without give the same greedy tokens."""
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10], [1, *range(11, 40)]]

    def generate():
        engine.reset_prefix_cache()
        params = [SamplingParams(max_tokens=n, **GREEDY) for n in (5, 3, 4)]  # the batch shrinks 3 -> 2 -> 1
        reqs = [engine.add_request({"prompt_token_ids": ids}, p) for ids, p in zip(prompts, params)]
        while not all(r.finished for r in reqs):
            engine.step()
        return [engine.make_output(r).outputs[0].token_ids for r in reqs]

    graphs = engine.runner.graphs
    replays = graphs.stats["replays"]
    with_graphs = generate()
    assert graphs.stats["replays"] - replays >= 4
    assert {1, 4} <= set(graphs._replays)
    engine.runner.configure_graphs(GraphConfig(enabled=False))
    try:
        assert engine.runner.graphs is None
        eager = generate()
    finally:
        engine.runner.configure_graphs(GraphConfig(emulate=True, max_batch=4))
    assert with_graphs == eager
    assert engine.stats()["kv_blocks_used"] == 0
