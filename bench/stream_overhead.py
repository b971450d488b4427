"""What token streaming costs a run: one forking workflow (8 forks of one prompt) run plainly with
`rt.run` and with every token delivered as an event through `rt.stream(..., tokens=True)`, alternated.

    python bench/stream_overhead.py [--model PATH] [--tokens 32] [--rounds 4]

Default model: the default SmolLM2-135M-Instruct. On a near-free model (tests/models/stories260K) the per-token
detokenize and event delivery show up; on a real one they vanish in the forward pass.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sysinfo import print_banner, resolve_dtype  # noqa: E402


def workflow(max_tokens: int):
    import flowrt as fr

    wf = fr.Workflow("forks")

    @wf.step
    async def branches(start: str, llm: fr.Model) -> list[str]:
        t = llm.thread(start)
        return await fr.gather(*(k.gen(max_tokens=max_tokens, temperature=0, ignore_eos=True) for k in t.fork(8)))

    return wf


async def main(a: argparse.Namespace) -> None:
    import flowrt as fr
    from flowrt.engine import AsyncLLM

    dtype = resolve_dtype(a.dtype)
    print_banner(dtype)
    wf = workflow(a.tokens)
    eng = AsyncLLM(model=a.model, dtype=dtype, seed=0)
    async with fr.Runtime(model=eng) as rt:
        async def plain() -> None:
            await rt.run(wf, start="Once upon a time")

        async def tokens() -> None:
            async for _ in rt.stream(wf, start="Once upon a time", tokens=True):
                pass

        modes = {"plain run": plain, "token events": tokens}
        await plain()  # warm-up
        times: dict[str, list[float]] = {k: [] for k in modes}
        for _ in range(a.rounds):
            for name, run in modes.items():
                t0 = time.perf_counter()
                await run()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            print(f"{name:>13}: best {min(ts) * 1e3:7.0f} ms   median {statistics.median(ts) * 1e3:7.0f} ms")
        ratio = statistics.median(times["token events"]) / statistics.median(times["plain run"])
        print(f"token events / plain (medians): {ratio:.3f}")
    eng.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per fork")
    ap.add_argument("--rounds", type=int, default=4)
    asyncio.run(main(ap.parse_args()))
