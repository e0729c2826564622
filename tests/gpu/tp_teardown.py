"""How long a tensor-parallel engine takes to shut down on GPUs (NCCL, CUDA graphs on), and
whether a second engine starts in the same process afterwards (issue 12). Prints one line per
engine; run on a machine with >= 2 GPUs: python tests/gpu/tp_teardown.py"""

import logging
import time

from nanovllm import LLM, SamplingParams
from nanovllm.configs import config_path

logging.basicConfig(level=logging.WARNING)
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
tokens = []
for attempt in range(2):
    start = time.perf_counter()
    llm = LLM(config_path("qwen3-0.6b"), load_format="dummy", tensor_parallel_size=2,
              dtype="float32", num_kv_blocks=512)
    built = time.perf_counter() - start
    tokens.append([o.token_ids for o in llm.generate([[1, 2, 3, 4]] * 8, params, use_tqdm=False)])
    start = time.perf_counter()
    llm.shutdown()
    print(f"engine {attempt}: started in {built:.1f} s, shut down in "
          f"{time.perf_counter() - start:.2f} s", flush=True)
print("same tokens from both engines:", tokens[0] == tokens[1])
