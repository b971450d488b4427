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
    "Workflow": ("flowrt.workflow", "Workflow"),
    "WorkflowError": ("flowrt.workflow", "WorkflowError"),
    "Model": ("flowrt.model", "Model"),
    "Runtime": ("flowrt.runtime", "Runtime"),
    "Thread": ("flowrt.thread", "Thread"),
    "ChatThread": ("flowrt.thread", "ChatThread"),
    "gather": ("flowrt.aio", "gather"),
    "RunResult": ("flowrt.executor", "RunResult"),
    "StepError": ("flowrt.executor", "StepError"),
    "StepFailed": ("flowrt.executor", "StepFailed"),
    "RunObserver": ("flowrt.executor", "RunObserver"),
    "Tracer": ("flowrt.trace", "Tracer"),
    "register_resource": ("flowrt.resources", "register_resource"),
    "goto": ("flowrt.routing", "goto"),
    "Goto": ("flowrt.routing", "Goto"),
    "interrupt": ("flowrt.interrupts", "interrupt"),
    "subflow": ("flowrt.executor", "subflow"),
    "Interrupt": ("flowrt.interrupts", "Interrupt"),
    "events": ("flowrt.events", None),
    "tool": ("flowrt.tools", "tool"),
    "Tool": ("flowrt.tools", "Tool"),
    "AssistantReply": ("flowrt.tools", "AssistantReply"),
    "IncompleteOutputError": ("flowrt.structured", "IncompleteOutputError"),
    # flowrt.retrieval pulls in faiss / sentence-transformers
    "Retriever": ("flowrt.retrieval", "Retriever"),
    "rag": ("flowrt.retrieval", "rag"),
}

__all__ = [
    "Workflow", "WorkflowError", "Model", "Runtime", "Thread", "ChatThread", "gather",
    "RunResult", "StepError", "StepFailed", "RunObserver", "Tracer", "register_resource",
    "Retriever", "rag", "goto", "Goto", "interrupt", "Interrupt", "subflow", "events", "tool", "Tool", "AssistantReply",
    "IncompleteOutputError",
    "__version__",
]

if TYPE_CHECKING:
    from .aio import gather
    from .executor import RunObserver, RunResult, StepError, StepFailed, subflow
    from .model import Model
    from . import events
    from .interrupts import Interrupt, interrupt
    from .resources import register_resource
    from .routing import Goto, goto
    from .retrieval import Retriever, rag
    from .runtime import Runtime
    from .thread import ChatThread, Thread
    from .structured import IncompleteOutputError
    from .tools import AssistantReply, Tool, tool
    from .trace import Tracer
    from .workflow import Workflow, WorkflowError


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
