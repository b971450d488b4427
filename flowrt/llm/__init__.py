"""The LLM handles steps use: ``Model`` (one engine), ``Thread`` / ``ChatThread`` (prompt states on it),
structured output, tools and tool calls. They read the run they are part of from flowrt.context only."""
