"""Unit tests of the server's pieces that need no engine: request models, errors, SSE, deltas, metrics."""

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from flowrt.server import protocol as P
from flowrt.server.errors import OpenAIError, from_exception, from_validation_errors
from flowrt.server.metrics import ServerMetrics
from flowrt.server.outputs import Delta
from flowrt.server.state import default_model_name


def test_completion_prompts_forms():
    assert P.CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert P.CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert P.CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert P.CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    with pytest.raises(OpenAIError) as e:
        P.CompletionRequest(prompt=[]).prompts()
    assert e.value.status == 400 and e.value.param == "prompt"


def test_sampling_kwargs_defaults_and_extensions():
    req = P.CompletionRequest(prompt="x", stop="\n", top_k=5, seed=3)
    kw = req.sampling_kwargs(max_tokens=7)
    assert kw == {"n": 1, "max_tokens": 7, "temperature": 1.0, "stop": ["\n"], "top_k": 5, "seed": 3}


def test_unsupported_fields_are_refused():
    with pytest.raises(OpenAIError, match="logit_bias"):
        P.CompletionRequest(prompt="x", logit_bias={"1": 2.0}).check_unsupported()
    with pytest.raises(OpenAIError, match="best_of"):
        P.CompletionRequest(prompt="x", best_of=3).check_unsupported()
    # tools are supported now (server/structured.py); a malformed one is a 400 naming it
    from flowrt.server.structured import tools_of

    with pytest.raises(OpenAIError, match=r"tools\[0\]"):
        tools_of(P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]))


def test_validation_error_names_param():
    with pytest.raises(ValidationError) as e:
        P.CompletionRequest(prompt="x", temperature=3)
    err = from_exception(e.value)
    assert err.status == 400 and err.param == "temperature" and "temperature" in err.message
    body = err.body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


def test_invalid_json_error():
    err = from_validation_errors([{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                                   "ctx": {"error": "Expecting value"}}])
    assert err.status == 400 and err.code == "invalid_json"


def test_chat_message_text_parts():
    m = P.ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert m.for_template() == {"role": "user", "content": "ab"}
    with pytest.raises(OpenAIError):
        P.ChatMessage(role="user", content=[{"type": "image_url"}]).text()
    with pytest.raises(ValidationError):
        P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)


def test_sse_format():
    assert P.sse({"a": 1}) == 'data: {"a":1}\n\n'
    assert P.SSE_DONE == "data: [DONE]\n\n"
    err = OpenAIError("boom", 400)
    assert json.loads(err.sse()[len("data: "):]) == err.body()


def test_delta_holds_back_possible_stop_and_partial_utf8():
    d = Delta(holdback=2)
    assert d.text(0, "hello", finished=False) == "hel"
    assert d.text(0, "hello wor", finished=False) == "lo w"
    assert d.text(0, "hello world", finished=True) == "orld"
    d = Delta(holdback=0)
    assert d.text(1, "ab\ufffd", finished=False) == "ab"
    assert d.text(1, "abé", finished=False) == "é"


def test_metrics_render_parses():
    m = ServerMetrics(lambda: {"kv_blocks_used": 3, "num_kv_blocks": 10, "num_running": 1, "num_waiting": 0,
                               "prefix_cache_hit_tokens": 5, "weights_bytes": 96_576_768,
                               "weights_formats": {"embed": "Q8_0", "lm_head": "Q8_0 (tied)"}})
    m.requests.labels(endpoint="/v1/completions", status="200").inc()
    m.ttft.observe(0.01)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert fams["flowrt_kv_blocks_used"].samples[0].value == 3
    assert fams["flowrt_kv_blocks_total"].samples[0].value == 10
    assert fams["flowrt_engine_prefix_cache_hit_tokens"].type == "counter"
    assert fams["flowrt_engine_weights_bytes"].samples[0].value == 96_576_768  # weights_formats (a dict) is left out
    assert any(s.labels.get("status") == "200" for s in fams["flowrt_http_requests"].samples)
    assert "flowrt_time_to_first_token_seconds" in fams


def test_metrics_survive_a_failing_engine():
    def boom():
        raise RuntimeError("engine is gone")
    assert b"flowrt_http_requests" in ServerMetrics(boom).render()


def test_default_model_name():
    assert default_model_name("/a/b/stories260K/") == "stories260K"
    assert default_model_name("/a/m.Q8_0.gguf") == "m.Q8_0"
    assert default_model_name(None) == "flowrt"
