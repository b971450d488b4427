import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from support import STORIES  # noqa: E402  (after the offline switches: support's helpers import transformers)


@pytest.fixture(scope="session")
def stories_path() -> str:
    return str(STORIES)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    """A test module may name the fixtures that make a test slow (`SLOW_FIXTURES = {"engine"}`: they build the
    135M model or start Ray): its tests that use one are marked `slow`, the others stay in the fast tier."""
    for item in items:
        slow = getattr(getattr(item, "module", None), "SLOW_FIXTURES", ())
        if slow and set(slow) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
