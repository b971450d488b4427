#!/usr/bin/env python
"""Prompt tokens the server computes for a tool-using conversation on /v1/responses: chained with
previous_response_id (the server continues the stored token sequence) vs re-sending the whole history each
request (as a client without server-side state does).

Workload: --turns (5) user turns over the openai client (or the OpenAI Agents SDK, --client agents) against an in-process `flowrt serve` app on the default
model. Each turn is two requests: the question with tool_choice "required" (one get_weather call), then the
call's output with tool_choice "none" (the answer). Both modes send the same questions and tool results, at
--temperature (0: greedy; else sampled with a seed per request); the prefix cache is emptied between modes.
Reported per mode: prompt tokens (usage input_tokens) and of them cached (usage cached_tokens), in all and for
the follow-ups (every request after the first): their prompt tokens not cached are what the engine computed of
the prompts. The engine's prefill_tokens_computed counter is shown too; it also counts output tokens that a
constraint forced (the fixed parts of a tool call), which are computed like a prompt (with --client agents it is
counted per Runner.run and shown on the run's first request).

    python bench/responses_turns.py [--turns 5] [--dtype float32] [--temperature 0] [--client openai|agents]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from sysinfo import banner  # noqa: E402

CITIES = ["Paris", "Rome", "London", "Madrid", "Berlin", "Vienna", "Lisbon"]
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                         "required": ["city"]}}]
INSTRUCTIONS = "You answer questions about the weather in cities. Use the get_weather tool, then answer briefly."


def converse(client, model: str, turns: int, chained: bool, engine, temperature: float) -> dict:
    history: list = []   # every item so far (what a client without server state re-sends)
    previous = out = None
    rows = []
    for t in range(turns):
        city = CITIES[t % len(CITIES)]
        for step in ("ask", "answer"):
            if step == "ask":
                new = [{"role": "user", "content": f"What is the weather in {city}?"}]
                choice = "required"
            else:
                call = out.output[-1]
                new = [{"type": "function_call_output", "call_id": call.call_id,
                        "output": json.dumps({"city": city, "sky": "sunny", "temp_c": 18 + t})}]
                choice = "none"
            before = engine.stats()["prefill_tokens_computed"]
            out = client.responses.create(
                model=model, instructions=INSTRUCTIONS, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                temperature=temperature, extra_body={"seed": len(rows)}, max_output_tokens=64,
                input=new if chained else history + new,
                previous_response_id=previous if chained else None, store=chained)
            computed = engine.stats()["prefill_tokens_computed"] - before
            history += new + [item.model_dump(exclude_none=True) for item in out.output]
            previous = out.id
            u = out.usage
            rows.append({"turn": t + 1, "step": step, "prompt": u.input_tokens,
                         "cached": u.input_tokens_details.cached_tokens, "computed": computed})
    return summary(rows)


def summary(rows: list[dict]) -> dict:
    follow = rows[1:]
    return {"requests": rows, "prompt_tokens": sum(r["prompt"] for r in rows),
            "cached_tokens": sum(r["cached"] for r in rows), "engine_prefill": sum(r["computed"] for r in rows),
            "follow_up_prompt": sum(r["prompt"] for r in follow),
            "follow_up_uncached": sum(r["prompt"] - r["cached"] for r in follow),
            "follow_up_engine_prefill": sum(r["computed"] for r in follow)}


def converse_agents(base_url: str, model: str, turns: int, chained: bool, engine, temperature: float) -> dict:
    """The same conversation through the OpenAI Agents SDK (its Responses model): one Runner.run per user turn,
    chained by previous_response_id (auto_previous_response_id within a run) or re-sending to_input_list().
    The first model call of a run must call the tool; a hook sets tool_choice "none" once it ran (the tools stay
    in the prompt, so the rendering of the history does not change)."""
    import asyncio
    import dataclasses

    import agents
    import openai

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return json.dumps({"city": city, "sky": "sunny", "temp_c": 21})

    class AnswerAfterTool(agents.RunHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    async def run() -> list[dict]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        agent = agents.Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], reset_tool_choice=False,
                             model=agents.OpenAIResponsesModel(model=model, openai_client=client))
        rows, result = [], None
        for t in range(turns):
            agent.model_settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                        temperature=temperature, max_tokens=64, store=chained,
                                                        extra_body={"seed": t})
            question = f"What is the weather in {CITIES[t % len(CITIES)]}?"
            before = engine.stats()["prefill_tokens_computed"]
            if chained:
                result = await agents.Runner.run(agent, question, hooks=AnswerAfterTool(), max_turns=4,
                                                 previous_response_id=result.last_response_id if result else None,
                                                 auto_previous_response_id=True)
            else:
                history = result.to_input_list() if result else []
                result = await agents.Runner.run(agent, history + [{"role": "user", "content": question}],
                                                 hooks=AnswerAfterTool(), max_turns=4)
            computed = engine.stats()["prefill_tokens_computed"] - before
            for i, r in enumerate(result.raw_responses):
                u = r.usage
                rows.append({"turn": t + 1, "step": "ask" if i == 0 else "answer", "prompt": u.input_tokens,
                             "cached": u.input_tokens_details.cached_tokens, "computed": computed if i == 0 else 0})
        return rows

    return summary(asyncio.run(run()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled (> 0, seeded per request) or greedy")
    ap.add_argument("--client", choices=["openai", "agents"], default="openai",
                    help="the openai client's responses.create, or the OpenAI Agents SDK")
    args = ap.parse_args()
    import openai

    from flowrt.engine import AsyncLLM, default_model_path
    from flowrt.server.app import create_app
    from flowrt.server.background import BackgroundServer

    print(banner(args.dtype))
    engine = AsyncLLM(model=default_model_path(), dtype=args.dtype, seed=0)
    srv = BackgroundServer(create_app(engine, served_model_name="smollm2")).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        result = {}
        for mode, chained in (("previous_response_id", True), ("resend history", False)):
            engine.engine.reset_prefix_cache()
            if args.client == "agents":
                result[mode] = converse_agents(srv.url + "/v1", "smollm2", args.turns, chained, engine,
                                               args.temperature)
            else:
                result[mode] = converse(client, "smollm2", args.turns, chained, engine, args.temperature)
        for mode, r in result.items():
            print(f"{mode:>22}: prompt tokens {r['prompt_tokens']}, cached {r['cached_tokens']}; the 2nd-last requests: "
                  f"{r['follow_up_prompt']} prompt tokens, {r['follow_up_uncached']} not cached, engine prefill "
                  f"{r['follow_up_engine_prefill']}")
            for row in r["requests"]:
                print(f"{'':>24}turn {row['turn']} {row['step']:<6} prompt {row['prompt']:>5} "
                      f"cached {row['cached']:>5} computed {row['computed']:>5}")
        print(json.dumps(result))
    finally:
        srv.stop()
        engine.shutdown()


if __name__ == "__main__":
    main()
