import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from support import STORIES  # noqa: E402  (after the offline switches: support's helpers import transformers)


@pytest.fixture(scope="session")
def stories_path() -> str:
    return str(STORIES)
