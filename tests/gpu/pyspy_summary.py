"""Summarize py-spy's raw (collapsed-stack) profiles: per file, the share of samples per
thread and the functions with the most samples on top of the stack (self) and anywhere on
it (inclusive). Usage: python tests/gpu/pyspy_summary.py api_profile.txt core_profile.txt"""

import json
import sys
from collections import Counter


def summarize(path: str, top: int = 25) -> dict:
    threads, leaf, inclusive, total = Counter(), Counter(), Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            threads[frames[0]] += n
            leaf[frames[-1]] += n
            for frame in set(frames[1:]):
                inclusive[frame] += n
    share = lambda c: [(k, round(v / total, 4)) for k, v in c.most_common(top)]  # noqa: E731
    return {"samples": total, "threads": share(threads), "self": share(leaf),
            "inclusive": share(inclusive)}


print(json.dumps({path: summarize(path) for path in sys.argv[1:]}, indent=1))
