"""flowrt: a runtime for multi-step LLM programs (agents, RAG, self-consistency, tree search) on an
in-process engine whose KV cache is shared copy-on-write between branches.

```python
import flowrt as fr

wf = fr.Workflow("self-consistency")

@wf.step
async def solve(question: str, llm: fr.Model) -> list[str]:
    t = llm.thread(FEW_SHOT) + question
    return await fr.gather(*(b.gen(max_tokens=128, temperature=0.8) for b in t.fork(8)))

@wf.step
def vote(solve: list[str]) -> str: ...
```

Run it with ``flowrt run file.py --input question=...``, ``wf.run(question=...)`` or, embedded,
``async with fr.Runtime(model=...) as rt: await rt.run(wf, question=...)``.
"""

from __future__ import annotations

from typing import Any

from .aio import gather
from .executor import RunObserver, RunResult, StepError, StepFailed
from .model import Model
from .resources import register_resource
from .runtime import Runtime
from .thread import ChatThread, Thread
from .trace import Tracer
from .workflow import Workflow, WorkflowError

__version__ = "0.1.0"

__all__ = [
    "Workflow", "WorkflowError", "Model", "Runtime", "Thread", "ChatThread", "gather",
    "RunResult", "StepError", "StepFailed", "RunObserver", "Tracer", "register_resource",
    "Retriever", "rag", "__version__",
]

_LAZY = {"Retriever": ("flowrt.retrieval", "Retriever"), "rag": ("flowrt.retrieval", "rag")}


def __getattr__(name: str) -> Any:
    # flowrt.retrieval pulls in faiss / sentence-transformers: import it only when used.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flowrt' has no attribute {name!r}")
