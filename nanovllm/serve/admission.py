"""Admission control: who may send a request, and whether it may enter now (chapter 10).

Three gates, each taken as early as its inputs are known, so work turned away still counts:

1. **API keys** (``Authorization: Bearer <key>``): with keys configured, a missing or
   unknown key is a 401. A key names a tenant (its ``name``: the fair policy's user) and a
   key class (its priority and limits).
2. **Per-key token buckets**: requests per second (a bucket of ``burst`` requests,
   refilled at ``requests_per_second``) and tokens per minute (a bucket of
   ``tokens_per_minute`` tokens refilled evenly over the minute). ``enter`` takes the
   request from its bucket before the body is even read (so a key sending six huge,
   malformed prompts at once gets 429s, not six 400s), and turns the key away while its
   token bucket is in debt; ``charge`` takes the prompt's tokens once it is tokenized, and
   ``release`` the generated ones when it ends (the bucket may go into debt, which delays
   the key's next requests). A bucket that cannot pay: 429 with ``Retry-After``, the
   seconds until it will hold enough.
3. **Queue depth** (``admit``, before tokenizing): at most ``max_num_seqs +
   max_queue_depth`` sequences (a request with ``n`` samples of each of its prompts counts
   that many) in the server at once, tokenizing or in the engine; beyond that 429 with
   ``Retry-After`` (a request larger than that on its own is a 400: it could never enter).
   429, not 503: the server is healthy and the client should come back, which the
   official clients do after ``Retry-After``; 503 means this server will not serve
   (draining, or its engine has died).

The event loop runs every check and update, one request at a time, so no locks are needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.serve.config import Limits, ServeConfig
from nanovllm.serve.errors import APIError


class TokenBucket:
    """``rate`` tokens per second flow into a bucket that holds at most ``capacity``; it
    starts full. ``take`` may leave it below zero: a debt that refills like any deficit."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.capacity, self.clock = float(rate), float(capacity), clock
        self.level, self.updated = float(capacity), clock()

    def _refill(self) -> None:
        """Bring ``level`` up to the clock's present: add what flowed in since ``updated``.

        Handout (chapter 10 §4, assignment ``10.token_bucket``): the bucket is lazy, nothing
        ticks in the background; every ``wait_time`` and ``take`` first calls this method.
        ``self.clock()`` returns the time in seconds (a fake clock in the tests), ``self.rate``
        is tokens per second, ``self.capacity`` the most the bucket holds, ``self.level`` what
        it holds (below zero after a ``take`` beyond it: a debt) and ``self.updated`` the time
        of the previous refill. Add ``rate`` times the seconds elapsed since ``updated`` to
        ``level``, never going above ``capacity`` (an idle key does not hoard tokens), and
        record the present time in ``updated`` so the same interval is never counted twice.
        Hint: read the clock once; a debt refills like any other deficit.
        """
        # >>> assignment 10.token_bucket (4 points)
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        # <<< assignment 10.token_bucket

    def wait_time(self, amount: float) -> float:
        """Seconds until the bucket holds ``amount`` (at most ``capacity``); 0: now."""
        self._refill()
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


@dataclass
class Tenant:
    """Who sent a request: the key's name (None without keys) and its class's limits."""

    name: str | None
    key_class: str
    limits: Limits
    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass
class Ticket:
    """An admitted request's place in the server; ``Admission.release`` gives it back."""

    tenant: Tenant
    size: int  # sequences (n samples of each prompt)
    released: bool = False


class Admission:
    def __init__(
        self, config: ServeConfig, max_num_seqs: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.clock = clock
        self.classes = config.key_classes
        self.keys = {k.key: k for k in config.api_keys}
        self.tenants: dict[str | None, Tenant] = {}
        depth = config.max_queue_depth
        self.capacity = None if depth is None else max_num_seqs + depth  # (None: unlimited)
        self.in_flight = 0  # sequences admitted and not yet released

    @property
    def requires_key(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant behind an ``Authorization`` header; 401 when keys are configured and
        it names none of them."""
        if not self.keys:
            return self._tenant(None, "default")
        scheme, _, token = (authorization or "").partition(" ")
        key = self.keys.get(token.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            message = ("Incorrect API key provided." if authorization else
                       "You didn't provide an API key (Authorization: Bearer <key>).")
            raise APIError(401, message, "invalid_api_key")
        return self._tenant(key.name, key.key_class)

    def _tenant(self, name: str | None, key_class: str) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            limits = self.classes[key_class]
            rps, tpm = limits.requests_per_second, limits.tokens_per_minute
            requests = TokenBucket(rps, limits.request_burst, self.clock) if rps else None
            tokens = TokenBucket(tpm / 60, tpm, self.clock) if tpm else None
            tenant = self.tenants[name] = Tenant(name, key_class, limits, requests, tokens)
        return tenant

    def enter(self, tenant: Tenant) -> None:
        """A request arrives (nothing read yet): take it from the key's request bucket, or
        raise a 429 and change nothing. A key in token debt is turned away here too."""
        waits = []
        if tenant.requests is not None:
            waits.append(("requests per second", tenant.requests.wait_time(1)))
        if tenant.tokens is not None:
            waits.append(("tokens per minute", tenant.tokens.wait_time(1)))
        self._refuse_if_waiting(tenant, waits)
        if tenant.requests is not None:
            tenant.requests.take(1)

    def admit(self, tenant: Tenant, size: int) -> Ticket:
        """Give a request of ``size`` sequences its place, or raise a 429 (a 400 if it can
        never fit) and change nothing."""
        if self.capacity is not None and size > self.capacity:
            raise APIError(400, f"This request needs {size} sequences (n times its prompts); "
                           f"the server holds at most {self.capacity}.", "too_many_sequences",
                           "n")
        if self.capacity is not None and self.in_flight + size > self.capacity:
            raise APIError(
                429, f"The server is at capacity ({self.in_flight} sequences in flight, "
                f"at most {self.capacity}); retry later.", "queue_full", retry_after=1,
            )
        self.in_flight += size
        return Ticket(tenant, size)

    def charge(self, ticket: Ticket, prompt_tokens: int) -> None:
        """Take an admitted request's prompt tokens from its key's bucket, or raise a 429
        (the caller releases the ticket)."""
        tokens = ticket.tenant.tokens
        if tokens is not None:
            wait = tokens.wait_time(prompt_tokens)
            self._refuse_if_waiting(ticket.tenant, [("tokens per minute", wait)])
            tokens.take(prompt_tokens)

    @staticmethod
    def _refuse_if_waiting(tenant: Tenant, waits: list[tuple[str, float]]) -> None:
        limit, wait = max(waits, key=lambda w: w[1], default=(None, 0.0))
        if wait > 0:
            who = f"key {tenant.name!r}" if tenant.name else "this server"
            raise APIError(
                429, f"Rate limit reached for {who} on {limit}; retry in {wait:.2f} s.",
                "rate_limit_exceeded", retry_after=wait,
            )

    def release(self, ticket: Ticket, generated_tokens: int = 0) -> None:
        """The request has ended: free its place and charge what it generated (once)."""
        if ticket.released:
            return
        ticket.released = True
        self.in_flight -= ticket.size
        if ticket.tenant.tokens is not None:
            ticket.tenant.tokens.take(generated_tokens)
