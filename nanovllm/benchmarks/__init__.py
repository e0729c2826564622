"""Benchmarks (chapters 10 and 11). ``serve``: a load generator for the OpenAI-compatible
server (``python -m nanovllm.benchmarks.serve``). The engine benchmarks (``nanovllm.bench``,
``profiling``, ``tuning``) are to move here too."""
