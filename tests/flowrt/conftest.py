import pytest

from support import STORIES


@pytest.fixture(scope="module")
def engine():
    """An AsyncLLM on stories260K for the thread tests (a module that needs another model overrides it)."""
    from flowrt.engine import AsyncLLM

    eng = AsyncLLM(model=str(STORIES), dtype="float32", num_kv_blocks=512, seed=0)
    yield eng
    eng.shutdown()
