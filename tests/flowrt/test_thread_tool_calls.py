"""c.assistant(max_tool_calls=N) bounds the calls of one reply (default toolcalls.MAX_CALLS), as the server's
max_tool_calls does (issue 27, item 9). A tiny random chat model: the constraint guarantees the bound."""

import anyio
import pytest
from support import make_chat_model

import flowrt as fr
from flowrt.llm import toolcalls

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@fr.tool
def pick(n: int) -> int:
    """Pick a number."""
    return n


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from flowrt.engine import AsyncLLM

    eng = AsyncLLM(model=str(make_chat_model(tmp_path_factory.mktemp("chat"), CHATML, max_position_embeddings=1024)),
                   dtype="float32", num_kv_blocks=256, seed=0)
    yield eng
    eng.shutdown()


def test_max_tool_calls_bounds_a_reply(engine):
    llm = fr.Model(engine)

    async def main():
        counts = []
        for seed in range(3):
            c = llm.chat()
            c.user("Pick numbers.")
            reply = await c.assistant(tools=[pick], tool_choice="required", max_tool_calls=2, temperature=1.0,
                                      seed=seed, max_tokens=400)
            counts.append(len(reply.tool_calls))
            c.close()
        c = llm.chat()
        c.user("Pick.")
        with pytest.raises(ValueError, match="max_tool_calls must be a positive integer"):
            await c.assistant(tools=[pick], tool_choice="required", max_tool_calls=0)
        c.close()
        return counts

    counts = anyio.run(main)
    assert all(1 <= n <= 2 for n in counts), counts
    assert toolcalls.MAX_CALLS == 8
