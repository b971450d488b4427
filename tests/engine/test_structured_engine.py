"""Structured outputs in the engine (SamplingParams.structured_outputs): JSON schemas, regex, choice, Lark
grammars on a near-random model (stories260K: only the constraint makes the outputs valid), n > 1, preemption,
forced tokens, errors at submission, and unconstrained neighbours left alone."""

import asyncio
import json
import re

import jsonschema
import pytest

from flowrt.engine import LLM, AsyncLLM, SamplingParams, StructuredOutputsParams
from structured_schemas import SCHEMAS

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(model=stories_path, dtype="float32")


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def assert_no_leaks(llm):
    st = llm.stats()
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schemas_valid(llm, temperature):
    assert len(SCHEMAS) >= 30
    params = [SamplingParams(max_tokens=160, temperature=temperature, seed=i, structured_outputs=so(json=s))
              for i, s in enumerate(SCHEMAS)]
    outs = llm.generate([PROMPT] * len(params), params)
    for i, (out, schema) in enumerate(zip(outs, SCHEMAS)):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        check_json(c.text, schema)
    assert_no_leaks(llm)


@pytest.mark.slow
def test_json_schema_as_string_and_json_object(llm):
    schema = SCHEMAS[1]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=64, temperature=1.0, seed=3,
                                              structured_outputs=so(json=json.dumps(schema))))[0].outputs[0]
    assert out.finish_reason == "stop"
    check_json(out.text, schema)
    # any JSON object: may run long on a random model, but whatever it printed is a prefix of an object
    out = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0.0,
                                              structured_outputs=so(json_object=True)))[0].outputs[0]
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length"


def test_regex_choice_grammar(llm):
    regex = r"[a-z]{3,6}-[0-9]{2}"
    choices = ["red", "green", "blue", "dark green"]
    lark = 'start: "(" NUM ("," NUM){0,3} ")"\nNUM: /[0-9]{1,3}/'
    params = []
    for seed in range(4):
        params += [SamplingParams(max_tokens=32, temperature=1.0, seed=seed, structured_outputs=so(regex=regex)),
                   SamplingParams(max_tokens=32, temperature=1.0, seed=seed, structured_outputs=so(choice=choices)),
                   SamplingParams(max_tokens=32, temperature=1.0, seed=seed, structured_outputs=so(grammar=lark))]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params)]
    for i, c in enumerate(outs):
        assert c.finish_reason == "stop", (i, c.text)
        kind = i % 3
        if kind == 0:
            assert re.fullmatch(regex, c.text), c.text
        elif kind == 1:
            assert c.text in choices
        else:
            assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,3}\)", c.text), c.text


def test_n4_samples_each_valid(llm):
    schema = SCHEMAS[10]
    out = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=7,
                                              structured_outputs=so(json=schema)))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop"
        check_json(c.text, schema)
    assert len({c.text for c in out.outputs}) > 1  # the samples branched, each from the shared grammar state
    assert_no_leaks(llm)


def test_max_tokens_mid_object_is_length(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0,
                                              structured_outputs=so(json=SCHEMAS[8])))[0].outputs[0]
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_stop_strings_still_apply(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=64, temperature=0.0, stop=[":"],
                                              structured_outputs=so(json=SCHEMAS[1])))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == ":"
    assert out.text == '{"name"'


@pytest.mark.slow
def test_preemption_mid_object_still_valid(stories_path):
    small = LLM(model=stories_path, dtype="float32", num_kv_blocks=14, block_size=4)
    schema = SCHEMAS[8]  # {"user": {"id": ..., "name": ...}}
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=so(json=schema))
              for i in range(6)]
    outs = small.generate([PROMPT] * 6, params)
    assert small.stats()["preemptions"] > 0
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            check_json(c.text, schema)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 3
    # the same requests without memory pressure: identical (the matcher is not re-fed on recompute)
    ref = LLM(model=stories_path, dtype="float32").generate([PROMPT] * 6, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert_no_leaks(small)


@pytest.mark.slow
def test_forced_tokens_counted_and_greedy_identical(stories_path, llm):
    off = LLM(model=stories_path, dtype="float32", enable_forced_tokens=False)
    schemas = SCHEMAS[:12]
    params = [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=so(json=s)) for s in schemas]
    f0 = llm.stats()["forced_tokens"]
    on_outs = llm.generate([PROMPT] * len(params), params)
    forced = llm.stats()["forced_tokens"] - f0
    off_outs = off.generate([PROMPT] * len(params), params)
    assert forced > 0 and off.stats()["forced_tokens"] == 0
    assert [o.outputs[0].token_ids for o in on_outs] == [o.outputs[0].token_ids for o in off_outs]
    assert [o.outputs[0].text for o in on_outs] == [o.outputs[0].text for o in off_outs]
    assert off.stats()["steps"] > 0


def test_forced_tokens_with_logprobs(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=64, temperature=0.0, logprobs=1,
                                              structured_outputs=so(json=SCHEMAS[4])))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    assert out.logprobs[0][out.token_ids[0]].logprob == 0.0  # "{" is forced


@pytest.mark.parametrize("kw, field", [
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json"),
    (dict(regex="[a-"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(json={"type": "string", "pad": "x" * 70_000}), "structured_outputs.json"),
])
def test_bad_constraint_is_value_error_naming_field(llm, kw, field):
    before = llm.stats()["prompt_tokens"]
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate([PROMPT, PROMPT], [SamplingParams(), SamplingParams(structured_outputs=so(**kw))])
    assert llm.stats()["prompt_tokens"] == before  # nothing was queued


def test_params_need_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError):
        StructuredOutputsParams(choice=[])
    p = SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert p.structured_outputs.kind == "json" and p.structured_outputs.json == {"type": "object"}


def test_compile_time_cap(llm, monkeypatch):
    import time

    from flowrt.engine.decoding import structured_output

    real = structured_output._new_matcher

    def slow(tok, grammar):
        time.sleep(0.5)
        return real(tok, grammar)

    monkeypatch.setattr(structured_output, "_new_matcher", slow)
    monkeypatch.setattr(llm.engine.structured, "compile_timeout_s", 0.05)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: compiling .* longer than 0.05 s"):
        llm.generate(PROMPT, SamplingParams(structured_outputs=so(regex="[0-9]{1,7}x[a-f]{2,9}")))


@pytest.mark.slow
def test_unconstrained_neighbours_unaffected(llm):
    plain = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.0)]
    prompts = [PROMPT, "Lily and Ben"]
    alone = llm.generate(prompts, plain)
    cons = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=so(json=SCHEMAS[2]))
    mixed = llm.generate([prompts[0], "The dog", prompts[1]], [plain[0], cons, plain[1]])
    assert [o.outputs[0].token_ids for o in alone] == [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids]
    check_json(mixed[1].outputs[0].text, SCHEMAS[2])


def test_async_engine_and_sequence_handle(stories_path):
    asyncio.run(_async_engine_and_sequence_handle(stories_path))


async def _async_engine_and_sequence_handle(stories_path):
    async with AsyncLLM(model=stories_path, dtype="float32") as eng:
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, structured_outputs=so(choice=["yes", "no"]))
        out = await eng.generate(PROMPT, params)
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
        seq = eng.open(eng.tokenizer(PROMPT).input_ids)
        out = await eng.generate(seq, SamplingParams(max_tokens=40, temperature=0.0,
                                                     structured_outputs=so(regex="[a-z]{2,4}!")))
        assert re.fullmatch("[a-z]{2,4}!", out.outputs[0].text)
        assert seq.token_ids[-len(out.outputs[0].token_ids):] == out.outputs[0].token_ids
        seq.close()


def test_unconstrained_requests_do_no_mask_work(llm):
    mgr = llm.engine.structured
    rows, secs = mgr.mask_rows, mgr.mask_seconds
    llm.generate([PROMPT] * 3, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
    assert (mgr.mask_rows, mgr.mask_seconds) == (rows, secs)


def test_compiled_constraints_are_cached(llm):
    mgr = llm.engine.structured
    spec = so(json={"type": "object", "properties": {"zz": {"type": "boolean"}}, "required": ["zz"]})
    n = len(mgr.compile_seconds)
    a, b = mgr.compile(spec), mgr.compile(spec)
    assert a is not b and len(mgr.compile_seconds) == n + 1  # one compile, then copies of the template


@pytest.mark.slow
def test_json_schemas_valid_on_the_default_model():
    """The same schemas on the real default model (SmolLM2-135M-Instruct), greedy and sampled in one batch."""
    from flowrt.engine import default_model_path

    llm = LLM(model=default_model_path(), dtype="float32")
    prompt = "Write one JSON value that fits the requested format.\n"
    params = [SamplingParams(max_tokens=160, temperature=t, seed=i, structured_outputs=so(json=s))
              for t in (0.0, 1.0) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate([prompt] * len(params), params)
    for i, out in enumerate(outs):
        c, schema = out.outputs[0], SCHEMAS[i % len(SCHEMAS)]
        assert c.finish_reason == "stop", (i, c.text)
        check_json(c.text, schema)
    assert_no_leaks(llm)
