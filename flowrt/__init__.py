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

Every public name is imported on first use (PEP 562), so ``import flowrt.engine`` / ``flowrt.kernels``
load only the engine / kernels, never the runtime above them (executor, workflows, threads, anyio).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_LAZY: dict[str, tuple[str, str | None]] = {
    "Workflow": ("flowrt.graph.workflow", "Workflow"),
    "WorkflowError": ("flowrt.graph.workflow", "WorkflowError"),
    "Model": ("flowrt.llm.model", "Model"),
    "Runtime": ("flowrt.runner.runtime", "Runtime"),
    "Thread": ("flowrt.llm.thread", "Thread"),
    "ChatThread": ("flowrt.llm.chat", "ChatThread"),
    "gather": ("flowrt.aio", "gather"),
    "RunResult": ("flowrt.runner.executor", "RunResult"),
    "StepError": ("flowrt.runner.executor", "StepError"),
    "StepFailed": ("flowrt.runner.executor", "StepFailed"),
    "RunObserver": ("flowrt.runner.executor", "RunObserver"),
    "Tracer": ("flowrt.runner.trace", "Tracer"),
    "register_resource": ("flowrt.graph.resources", "register_resource"),
    "goto": ("flowrt.graph.routing", "goto"),
    "Cache": ("flowrt.graph.cache", "Cache"),
    "Goto": ("flowrt.graph.routing", "Goto"),
    "interrupt": ("flowrt.runner.interrupts", "interrupt"),
    "subflow": ("flowrt.runner.executor", "subflow"),
    "Interrupt": ("flowrt.runner.interrupts", "Interrupt"),
    "events": ("flowrt.events", None),
    "tool": ("flowrt.llm.tools", "tool"),
    "Tool": ("flowrt.llm.tools", "Tool"),
    "AssistantReply": ("flowrt.llm.tools", "AssistantReply"),
    "IncompleteOutputError": ("flowrt.llm.structured", "IncompleteOutputError"),
    # flowrt.retrieval pulls in faiss / sentence-transformers
    "Retriever": ("flowrt.retrieval", "Retriever"),
    "rag": ("flowrt.retrieval", "rag"),
}

__all__ = [
    "Workflow", "WorkflowError", "Model", "Runtime", "Thread", "ChatThread", "gather",
    "RunResult", "StepError", "StepFailed", "RunObserver", "Tracer", "register_resource",
    "Retriever", "rag", "goto", "Goto", "interrupt", "Interrupt", "subflow", "events", "tool", "Tool", "AssistantReply",
    "IncompleteOutputError", "Cache",
    "__version__",
]

if TYPE_CHECKING:
    from .aio import gather
    from .runner.executor import RunObserver, RunResult, StepError, StepFailed, subflow
    from .llm.model import Model
    from . import events
    from .runner.interrupts import Interrupt, interrupt
    from .graph.resources import register_resource
    from .graph.cache import Cache
    from .graph.routing import Goto, goto
    from .retrieval import Retriever, rag
    from .runner.runtime import Runtime
    from .llm.chat import ChatThread
    from .llm.thread import Thread
    from .llm.structured import IncompleteOutputError
    from .llm.tools import AssistantReply, Tool, tool
    from .runner.trace import Tracer
    from .graph.workflow import Workflow, WorkflowError


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'flowrt' has no attribute {name!r}")
    module, attr = target
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
