"""``python -m nanovllm.bench``: the short name of ``python -m nanovllm.benchmarks.throughput``
(chapter 11)."""

from nanovllm.benchmarks.throughput import main

if __name__ == "__main__":
    main()
