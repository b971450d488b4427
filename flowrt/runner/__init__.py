"""Running workflows: the executor, interrupts, tracing and the ``Runtime`` that builds the engine and
Models, checkpoints runs (flowrt.checkpoint) and runs workflows."""
