"""The eager runtime's parts: the recorded graph, forward recording, backward replay,
and statistics. ``sac_compile.eager`` is the entry point."""
