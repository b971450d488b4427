"""The run viewer: ``flowrt ui --checkpoint runs.db`` (and ``/ui`` under ``flowrt serve``).

A page of plain HTML, JavaScript and CSS (flowrt/ui/static, no build step) over a JSON API (flowrt.ui.api) that
reads the checkpoint store: the runs, a run's graph with each step's state (live over Server-Sent Events while it
runs), its LLM calls and fork tree (flowrt.runner.activity), its history; an interrupted run is answered and a
run forked from a step through the same claim and lease path as ``flowrt resume`` and the HTTP resume."""
