"""Defining workflows: the graph (``Workflow``, steps, edges), its inputs, routing, resources, loading a
workflow from a file, and drawing it. Nothing here runs a workflow (that is flowrt.runner)."""
