"""Which replica gets a request: round-robin, or the one most likely to hold its prefix
(chapter 17 §5).

Each replica's engine keeps a prefix cache (``BlockManager``): a full block of a prompt is found
by the chained hash of every token up to it. A router that sends a request to a replica
holding its first blocks saves that replica their prefill; one that ignores prefixes (a
Kubernetes Service, round-robin) makes every replica compute every popular prefix, and with
more prefixes than one replica's cache can keep, evict them again and again. SGLang's
router and vLLM's production stack route on prefixes; this one does it with the engine's own
block hashes:

- ``block_hashes`` hashes a prompt's first full blocks exactly as ``BlockManager`` does
  (``chain_hash``), so a router's key for block ``i`` is the key the replica's cache uses;
- ``PrefixAwareRouter`` remembers, per replica, the block hashes it sent there (an LRU of
  about the replica's cache size: a guess at what it still holds, never asked of it) and
  picks the replica with the longest remembered prefix among those whose load (requests in
  flight) is within ``slack`` of the least loaded; load breaks ties, then the lower index.

The router only counts: ``route`` when a request is sent, ``finished`` when it ends.
"""

from __future__ import annotations

from collections import OrderedDict

from nanovllm.engine.block_manager import chain_hash


def block_hashes(token_ids: list[int], block_size: int, max_blocks: int | None = None
                 ) -> list[int]:
    """The chained hashes of the prompt's full blocks (at most ``max_blocks``): the keys the
    engine's prefix cache finds them by (``BlockManager``'s ``chain_hash``)."""
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes, key = [], None
    for i in range(count):
        key = chain_hash(key, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(key)
    return hashes


class RoundRobinRouter:
    """Replica 0, 1, ..., n-1, 0, ...: what a load balancer does without looking inside."""

    name = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.loads = [0] * num_replicas  # requests sent and not finished, per replica
        self._next = 0

    def route(self, token_ids: list[int]) -> int:
        replica = self._next
        self._next = (self._next + 1) % self.num_replicas
        self.loads[replica] += 1
        return replica

    def finished(self, replica: int) -> None:
        self.loads[replica] -= 1


class PrefixAwareRouter(RoundRobinRouter):
    """The replica most likely to hold the request's prefix, load permitting (module
    docstring). ``capacity_blocks``: blocks remembered per replica (about its KV cache);
    ``max_blocks``: leading blocks of a prompt looked at; ``slack``: how many more requests
    in flight than the least loaded replica a replica may have and still be chosen."""

    name = "prefix-aware"

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int,
                 max_blocks: int = 64, slack: int = 4) -> None:
        super().__init__(num_replicas)
        self.block_size, self.max_blocks, self.slack = block_size, max_blocks, slack
        self.capacity_blocks = capacity_blocks
        # per replica: block hash -> None, least recently sent first
        self.held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def route(self, token_ids: list[int]) -> int:
        hashes = block_hashes(token_ids, self.block_size, self.max_blocks)
        replica = self.choose(hashes)
        self.loads[replica] += 1
        held = self.held[replica]
        for h in hashes:  # now (probably) cached there, and the most recently used
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)
        return replica

    def choose(self, hashes: list[int]) -> int:
        """The replica for a request whose leading blocks have chained hashes ``hashes``.

        Handout (chapter 17 §5, cache-aware routing). Read ``self.held[r]`` (the hashes
        replica ``r`` probably holds: a mapping whose keys you test with ``in``),
        ``self.loads[r]`` (its requests in flight) and ``self.slack``; change nothing.
        Return an int in ``range(self.num_replicas)``:

        - a replica is *eligible* if its load is at most the least load plus ``slack``;
        - a replica's *match* is the number of leading hashes it holds: ``hashes[0]``,
          ``hashes[1]``, ... up to the first it does not hold (the hashes are chained, so a
          later hash without the earlier ones is a different prefix's block: do not count
          past a miss);
        - among eligible replicas return the one with the longest match; on equal matches the
          least loaded; on equal loads too, the lowest index. With ``hashes`` empty (a prompt
          shorter than a block) this is the least loaded replica.
        """
        # >>> assignment 17.route (6 points)
        least = min(self.loads)
        best, best_score = 0, None
        for replica in range(self.num_replicas):
            load = self.loads[replica]
            if load > least + self.slack:
                continue  # too busy: a cache hit there would wait behind its queue
            held, match = self.held[replica], 0
            for h in hashes:
                if h not in held:
                    break
                match += 1
            score = (match, -load)
            if best_score is None or score > best_score:  # (strictly: lower index on ties)
                best, best_score = replica, score
        return best
        # <<< assignment 17.route
