"""nanovllm: a small, fast LLM inference engine, and the textbook that builds it.

The public API mirrors vLLM's offline API::

    from nanovllm import LLM, SamplingParams, smollm2_path
    llm = LLM(smollm2_path())
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].text)
"""

from nanovllm.config import EngineConfig
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_output import StructuredOutputsParams


def smollm2_path(dtype: str = "float32"):
    """Local folder of SmolLM2-135M-Instruct, converted on first use (see ``weights.smollm2``)."""
    from nanovllm.weights.smollm2 import smollm2_path as _path

    return _path(dtype)


__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "smollm2_path",
]
__version__ = "0.1.0"
