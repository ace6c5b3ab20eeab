"""Reference models of how other engines' offload caches order a prompt's chunks, for
comparisons only (the planner and the bench measure tiered-kv's policies against them).

Each peer is one of the registered policies replayed the way that engine drives it: its
cache does not know which chunk continues which (every chunk is an independent key, so
a prefix's head may go while its tail stays), and it orders a request's chunks its own
way. vLLM's offloading managers (LRU and ARC) touch a request's blocks from the last to
the first, so the head of a prompt is its most recent chunk; plain LRU touches them head
to tail, as tiered-kv's manager does. These are models of the ordering, not ports of
any engine's code.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tiered_kv.policy_factory import make_policy
from tiered_kv.traces import ReplayResult, TraceRequest, replay


class Peer(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    #: The registered policy that orders the chunks.
    policy: str
    #: Whether a request's chunks are stored and touched from the last to the first.
    tail_first: bool
    about: str


PEERS = (
    Peer(name="lru-plain", policy="lru", tail_first=False, about="LRU over independent chunks, touched head to tail"),
    Peer(name="vllm-lru", policy="lru", tail_first=True, about="vLLM offloading LRU: independent chunks, tail to head"),
    Peer(name="vllm-arc", policy="arc", tail_first=True, about="vLLM offloading ARC: independent chunks, tail to head"),
)


def replay_peer(requests: Sequence[TraceRequest], peer: Peer, capacity: int) -> ReplayResult:
    """``requests`` through a cache of ``capacity`` chunks ordered the way ``peer`` orders them."""
    policy = make_policy(peer.policy, capacity)
    result = replay(requests, policy, capacity, predecessors=False, tail_first=peer.tail_first)
    return msgspec.structs.replace(result, policy=peer.name)
