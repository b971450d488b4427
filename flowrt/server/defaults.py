"""Server defaults shared by ``create_app`` and ``flowrt serve`` (importing this loads nothing heavy,
so registering the ``serve`` subcommand keeps ``flowrt --help`` fast)."""

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_CHAT_TEMPLATE_TIMEOUT = 10.0  # seconds a chat template may take to render
DEFAULT_GRACEFUL_TIMEOUT = 30.0  # seconds in-flight requests get on SIGTERM
DEFAULT_RESPONSES_MAX = 1024  # stored /v1/responses (responses_store.py)
DEFAULT_RESPONSES_MAX_BYTES = 256 * 1024 * 1024
