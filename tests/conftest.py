import functools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that find no work sleep at once instead of spinning for a while first (GNU OpenMP's default): on a
# shared 2-core machine a spinning thread takes the core the other one needs, and the CPU-kernel tests ran twice as
# long (tests/engine/test_cpu_ops.py at load 5: 23 s against 11 s). Read when torch loads libgomp, so before any
# test module imports torch; the subprocesses the tests start inherit it. Results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from support import STORIES  # noqa: E402  (after the offline switches: support's helpers import transformers)


def _share_httpx_default_ssl_context() -> None:
    """Every ``httpx.get/post`` (and every new ``httpx.Client``) builds its transport's SSL context, and the default
    one parses certifi's whole CA bundle: tens of ms each, well over a hundred times in the fast tier, for test
    servers that speak plain HTTP on 127.0.0.1. One default context, built on first use, serves them all (an
    SSLContext is meant to be shared); any other ``verify=`` or ``cert=`` still builds its own."""
    try:
        from httpx._transports import default
    except ImportError:  # httpx absent, or moved: only the speed-up is lost
        return
    make = getattr(default, "create_ssl_context", None)
    if make is None:
        return
    shared = functools.cache(lambda trust_env: make(verify=True, cert=None, trust_env=trust_env))

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        return shared(trust_env) if verify is True and cert is None else make(verify=verify, cert=cert,
                                                                               trust_env=trust_env)

    default.create_ssl_context = create_ssl_context


_share_httpx_default_ssl_context()


@pytest.fixture(scope="session")
def stories_path() -> str:
    return str(STORIES)


@pytest.fixture
def bf16_kernel_cpu(monkeypatch):
    """The CPU presented without AMX, so a bfloat16 model runs flowrt's packed kernels (PackedLinearBF16, the one-call
    decode step) wherever they are compiled, as on a Zen4: with AMX the model keeps oneDNN (llama._packed_bf16).
    The kernels themselves still run the loaded variant (AMX tiles from a few rows on an AMX build)."""
    from flowrt.engine.model.models import llama

    monkeypatch.setattr(llama, "_onednn_on_amx", lambda: False)


SLOW_FIXTURES = {"pg_server"}  # fixtures of the conftests that start a server process (PostgreSQL)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    """A test module may name the fixtures that make a test slow (`SLOW_FIXTURES = {"engine"}`: they build the
    135M model or start Ray): its tests that use one are marked `slow`, the others stay in the fast tier."""
    for item in items:
        slow = SLOW_FIXTURES | set(getattr(getattr(item, "module", None), "SLOW_FIXTURES", ()))
        if slow & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
