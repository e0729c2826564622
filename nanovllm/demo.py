"""``make demo``: nanovllm answers real prompts with real SmolLM2 weights (chapter 00).

python -m nanovllm.demo [--model PATH] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import time

from nanovllm import LLM, SamplingParams, smollm2_path

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water in Fahrenheit?",
]
PROMPTS = ["The three primary colors are", "Once upon a time, a little robot"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a Hugging Face model folder (default: SmolLM2)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    path = args.model or smollm2_path()
    start = time.perf_counter()
    llm = LLM(path)
    cfg = llm.config
    print(
        f"Loaded {path} on {cfg.device} ({cfg.dtype}) in {time.perf_counter() - start:.1f} s; "
        f"KV cache: {llm.engine.block_manager.num_blocks} blocks of {cfg.block_size} tokens\n"
    )

    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    chats = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy)
    texts = llm.generate(
        PROMPTS, SamplingParams(temperature=0.7, top_p=0.9, seed=0, max_tokens=args.max_tokens)
    )
    elapsed = time.perf_counter() - start
    for question, out in zip(QUESTIONS, chats):
        print(f"USER: {question}\nNANOVLLM: {out.text.strip()}\n")
    for prompt, out in zip(PROMPTS, texts):
        print(f"PROMPT: {prompt}\nCONTINUATION (T=0.7, top_p=0.9, seed=0): {out.text.strip()}\n")
    tokens = sum(len(o.token_ids) for o in chats + texts)
    print(
        f"{len(chats) + len(texts)} requests in one batch, {tokens} tokens generated in "
        f"{elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s)."
    )


if __name__ == "__main__":
    main()
