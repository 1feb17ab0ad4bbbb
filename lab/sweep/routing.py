"""Spreading a sweep's requests over the replicas of a pool, as a router would.

``kvscope sweep --url A --url B --routing POLICY`` sends each request to one of the
given servers, chosen by one of :data:`POLICIES`:

* ``round-robin``: replicas in turn, whatever the request (the default of most load
  balancers and of a Kubernetes Service);
* ``least-loaded``: the replica with the fewest of this load generator's requests in
  flight (ties in turn);
* ``prefix-affine``: a hash of the prompt's first ``affinity_words`` words picks the
  replica, so requests that share a prefix meet the replica that cached it (the
  policy of prefix-aware routers, without their load bound).

The router sees only this load generator's own requests; it is a model of a
gateway policy for experiments, not a production router.
"""

from __future__ import annotations

import zlib

POLICIES: tuple[str, ...] = ("round-robin", "least-loaded", "prefix-affine")


class Router:
    """Choose a replica per request (index into the sweep's URL list) and track in-flight."""

    def __init__(self, n_targets: int, policy: str = "round-robin", affinity_words: int = 32):
        if n_targets < 1:
            raise ValueError("a router needs at least one target")
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")
        if affinity_words < 1:
            raise ValueError("affinity_words must be >= 1")
        self.policy = policy
        self.affinity_words = affinity_words
        self.in_flight = [0] * n_targets
        self.sent = [0] * n_targets
        self._next = 0

    def choose(self, prompt: str) -> int:
        """The replica for a request with ``prompt``; counts it as in flight there."""
        n = len(self.in_flight)
        if self.policy == "prefix-affine":
            key = " ".join(prompt.split(" ", self.affinity_words)[: self.affinity_words])
            index = zlib.crc32(key.encode("utf-8")) % n
        elif self.policy == "least-loaded":
            order = [(self._next + k) % n for k in range(n)]
            index = min(order, key=lambda i: self.in_flight[i])
            self._next = (index + 1) % n
        else:
            index = self._next
            self._next = (self._next + 1) % n
        self.in_flight[index] += 1
        self.sent[index] += 1
        return index

    def done(self, index: int) -> None:
        """The request sent to ``index`` finished (or failed)."""
        self.in_flight[index] -= 1
