"""The measuring tools: each records a JSON file with ``metadata.run_metadata`` (device, date,
versions, commit, command) that a chapter reads from ``figures/data/``; ``timing`` holds how
they time. The engine's own folders hold only the engine.

Entry points, ``python -m nanovllm.benchmarks.<name>``:

- ``throughput``: output tokens/s on the nano-vllm workload, against transformers and the
  bandwidth bound (chapter 11; ``python -m nanovllm.bench`` is an alias); its requests (and
  the other workloads) and their timing live in ``workload``, transformers' side in
  ``hf_peer``, arrivals over time, concurrency caps and TTFT/TPOT percentiles in ``latency``;
- ``decode_step``: one engine decode step, eager and with CUDA graphs (chapters 07 and 11);
- ``profiling``: where the time of a decode step goes (chapter 11);
- ``tuning``: the workload under one changed engine knob at a time (chapter 11);
- ``decode_kernel``, ``prefill_kernel``: the attention kernels alone against the memory
  roofline and PyTorch's kernels (chapters 05 and 02);
- ``quantization`` (speed and memory; the matmuls alone in ``gemm``) and ``quant_eval``
  (accuracy) of the quantized engines (chapter 08);
- ``tensor_parallel``: all-reduce, parity and throughput by tensor-parallel size (chapter 09);
- ``serve``: a load generator for the OpenAI-compatible server (chapter 10);
- ``long_context``: perplexity by position past the trained length (chapter 12).
- ``peaks``: the device's copy bandwidth and bf16 matmul rate, the roofs every bound divides
  by (chapters 02, 05, 08, 11; read through ``nanovllm.viz.records``).
"""
