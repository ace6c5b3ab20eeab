"""Request traces: seeded ones of the workloads inference servers see, and their replay.

Four workloads, each a list of :class:`TraceRequest` in arrival order:

* :func:`chat` — multi-turn conversations that grow by a user message and a reply per
  turn and come back while others are active, behind one shared system prompt;
* :func:`shared_system_prompt` — single-turn requests behind a few popular system prompts;
* :func:`rag` — a system prompt, one document drawn from a Zipf-popular set, a question;
* :func:`scans` — one-off long documents, never seen again.

:func:`mix` interleaves traces; :func:`standard_traces` builds the named set the bench
replays, including ``scan_polluted`` (chat and RAG traffic with long scans in between).

A prompt is a sequence of *segments* (a system prompt, a document, a message), each a
run of tokens named by an integer id. A chunk's key hashes the previous chunk's key with
the segment pieces the chunk covers, so keys are chained exactly like real chunk keys:
two prompts share the keys of the full chunks they have in common as a prefix, and
nothing after the first difference. Keys are 16 bytes (blake2b, cheap enough to build
traces of a million chunks in a second or two); each workload, and each ``salt`` (a
namespace, a tenant), has keys of its own.

:class:`PromptKeys` keys a prompt segment by segment; :mod:`tiered_kv.trace_file` uses it
to key the Mooncake-format traces it reads (one segment per hash id), so synthetic and
recorded traces are keyed alike. :func:`replay` runs a trace against one
:class:`~tiered_kv.interfaces.CachePolicy` at a capacity, with prefix semantics, and
reports the hit rate.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import struct
from collections.abc import Sequence

import msgspec

from tiered_kv.errors import ConfigError, PolicyError
from tiered_kv.interfaces import AdmissionFilter, CachePolicy
from tiered_kv.keys import KEY_BYTES, ChunkKey

#: Tokens per chunk unless a generator is told otherwise.
CHUNK_TOKENS = 256
#: The most tokens a chunk (or a segment's piece of one) may have: far more than any
#: engine's, and within what a key's pieces record.
MAX_CHUNK_TOKENS = 1 << 20

_PIECE = struct.Struct("<QII")


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt: which workload sent it, its chunk keys and its length in tokens."""

    workload: str
    #: Keys of the prompt's full chunks, in order; a trailing partial chunk has none.
    keys: tuple[ChunkKey, ...]
    prompt_tokens: int
    #: Arrival in milliseconds from the trace's start; ``None`` in synthetic traces.
    arrival_ms: float | None = None
    #: Tokens the request generated, where the trace says (it does not change its keys).
    output_tokens: int = 0


class PromptKeys:
    """A prompt being built segment by segment, with the keys of its full chunks.

    A segment is a run of tokens named by an integer id (below 2**64); two prompts share
    the keys of the full chunks they cover with the same segments in the same order, and
    nothing after the first difference.
    """

    __slots__ = ("_pieces", "_room", "chunk_tokens", "keys", "tokens", "workload")

    def __init__(self, workload: str, root: bytes, chunk_tokens: int) -> None:
        if not 0 < chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ConfigError(f"must be between 1 and {MAX_CHUNK_TOKENS:,}, got {chunk_tokens}", field="chunk_tokens")
        self.workload = workload
        self.chunk_tokens = chunk_tokens
        self.keys: list[ChunkKey] = [root]  # the root is dropped by ``request``
        self.tokens = 0
        self._pieces = bytearray()
        self._room = chunk_tokens

    @classmethod
    def rooted(cls, workload: str, salt: bytes, chunk_tokens: int) -> PromptKeys:
        """An empty prompt whose keys belong to ``workload`` and ``salt`` alone."""
        seed = b"tiered-kv/traces/v1\0" + workload.encode() + b"\0" + salt
        return cls(workload, hashlib.blake2b(seed, digest_size=KEY_BYTES).digest(), chunk_tokens)

    def copy(self) -> PromptKeys:
        other = PromptKeys.__new__(PromptKeys)
        other.workload, other.chunk_tokens = self.workload, self.chunk_tokens
        other.tokens, other._room = self.tokens, self._room
        other.keys = self.keys.copy()
        other._pieces = self._pieces.copy()
        return other

    def append(self, segment: int, length: int) -> None:
        """Append ``length`` tokens of segment ``segment``, keying every chunk it fills."""
        start = 0
        while start < length:
            take = min(self._room, length - start)
            self._pieces += _PIECE.pack(segment, start, take)
            start += take
            self._room -= take
            if self._room == 0:
                digest = hashlib.blake2b(self.keys[-1], digest_size=KEY_BYTES)
                digest.update(self._pieces)
                self.keys.append(digest.digest())
                self._pieces.clear()
                self._room = self.chunk_tokens
        self.tokens += length

    def request(self, *, arrival_ms: float | None = None, output_tokens: int = 0) -> TraceRequest:
        """The prompt as it stands, as a request."""
        return TraceRequest(
            workload=self.workload,
            keys=tuple(self.keys[1:]),
            prompt_tokens=self.tokens,
            arrival_ms=arrival_ms,
            output_tokens=output_tokens,
        )


class _Builder:
    """Fresh segment ids and prompts rooted in one workload and salt.

    Segment ids count from 0 in every builder; the root binds them to the workload and
    salt, so traces of different workloads or salts never share a key.
    """

    def __init__(self, workload: str, salt: bytes, chunk_tokens: int) -> None:
        self._empty = PromptKeys.rooted(workload, salt, chunk_tokens)
        self._ids = itertools.count()

    def segment(self) -> int:
        return next(self._ids)

    def prompt(self) -> PromptKeys:
        return self._empty.copy()


def _popular(
    rng: random.Random,
    build: _Builder,
    bases: Sequence[PromptKeys],
    *,
    requests: int,
    exponent: float,
    suffix_tokens: tuple[int, int],
) -> list[TraceRequest]:
    """Requests that each extend one of ``bases``, drawn Zipf(``exponent``) by popularity
    (the first most popular), with a fresh suffix of ``suffix_tokens`` (inclusive range)."""
    weights = [1.0 / (rank**exponent) for rank in range(1, len(bases) + 1)]
    out: list[TraceRequest] = []
    for base in rng.choices(bases, weights, k=requests):
        prompt = base.copy()
        prompt.append(build.segment(), rng.randint(*suffix_tokens))
        out.append(prompt.request())
    return out


def chat(
    rng: random.Random,
    *,
    requests: int = 4000,
    active: int = 32,
    mean_turns: float = 6.0,
    system_tokens: int = 600,
    salt: bytes = b"",
    chunk_tokens: int = CHUNK_TOKENS,
) -> list[TraceRequest]:
    """Multi-turn chat: ``active`` conversations at a time, each growing per turn.

    Each request is a conversation's whole history plus a new user message (50 to 400
    tokens); its reply (100 to 600 tokens) joins the history for the next turn. A
    conversation ends with probability ``1 / mean_turns`` after each turn and a new one
    takes its place; which active conversation speaks next is uniform.
    """
    build = _Builder("chat", salt, chunk_tokens)
    system = build.prompt()
    system.append(build.segment(), system_tokens)
    conversations = [system.copy() for _ in range(active)]
    out: list[TraceRequest] = []
    for _ in range(requests):
        slot = rng.randrange(active)
        history = conversations[slot]
        history.append(build.segment(), rng.randint(50, 400))
        out.append(history.request())
        history.append(build.segment(), rng.randint(100, 600))
        if rng.random() < 1.0 / mean_turns:
            conversations[slot] = system.copy()
    return out


def shared_system_prompt(
    rng: random.Random,
    *,
    requests: int = 4000,
    prompts: int = 8,
    exponent: float = 1.0,
    salt: bytes = b"",
    chunk_tokens: int = CHUNK_TOKENS,
) -> list[TraceRequest]:
    """Single-turn requests behind ``prompts`` system prompts of 1k to 4k tokens.

    The system prompt is drawn Zipf(``exponent``) by popularity; the user's message
    (50 to 1,000 tokens) is new every time.
    """
    build = _Builder("system_prompt", salt, chunk_tokens)
    bases = []
    for _ in range(prompts):
        base = build.prompt()
        base.append(build.segment(), rng.randint(1024, 4096))
        bases.append(base)
    return _popular(rng, build, bases, requests=requests, exponent=exponent, suffix_tokens=(50, 1000))


def rag(
    rng: random.Random,
    *,
    requests: int = 4000,
    documents: int = 400,
    exponent: float = 1.0,
    system_tokens: int = 300,
    salt: bytes = b"",
    chunk_tokens: int = CHUNK_TOKENS,
) -> list[TraceRequest]:
    """Retrieval-augmented generation over ``documents`` documents of 1k to 8k tokens.

    Each request is a shared system prompt, one document drawn Zipf(``exponent``) by
    popularity, and a new question (20 to 200 tokens).
    """
    build = _Builder("rag", salt, chunk_tokens)
    system = build.prompt()
    system.append(build.segment(), system_tokens)
    bases = []
    for _ in range(documents):
        base = system.copy()
        base.append(build.segment(), rng.randint(1024, 8192))
        bases.append(base)
    return _popular(rng, build, bases, requests=requests, exponent=exponent, suffix_tokens=(20, 200))


def scans(
    rng: random.Random,
    *,
    requests: int = 200,
    min_tokens: int = 16_384,
    max_tokens: int = 65_536,
    salt: bytes = b"",
    chunk_tokens: int = CHUNK_TOKENS,
) -> list[TraceRequest]:
    """One-off long documents (summarise this contract): every chunk is seen once."""
    build = _Builder("scan", salt, chunk_tokens)
    out: list[TraceRequest] = []
    for _ in range(requests):
        prompt = build.prompt()
        prompt.append(build.segment(), rng.randint(min_tokens, max_tokens))
        out.append(prompt.request())
    return out


def mix(rng: random.Random, *traces: Sequence[TraceRequest]) -> list[TraceRequest]:
    """Interleave traces at random, keeping each trace's own order.

    Each next request comes from a trace chosen in proportion to the requests it has
    left, so the traces run side by side from start to end.
    """
    cursors = [0] * len(traces)
    left = [len(trace) for trace in traces]
    out: list[TraceRequest] = []
    for _ in range(sum(left)):
        which = rng.choices(range(len(traces)), left)[0]
        out.append(traces[which][cursors[which]])
        cursors[which] += 1
        left[which] -= 1
    return out


#: The names :func:`standard_traces` returns, in order.
STANDARD_TRACES = ("chat", "system_prompt", "rag", "scan", "scan_polluted")


def standard_traces(
    seed: int, *, scale: float = 1.0, chunk_tokens: int = CHUNK_TOKENS
) -> dict[str, list[TraceRequest]]:
    """The named traces the bench replays, from one seed; ``scale`` multiplies their length.

    Workloads that are mixed get different salts, as different tenants would.
    """

    def n(count: int) -> int:
        return max(1, round(count * scale))

    rng = random.Random(seed)
    c = chunk_tokens
    traces = {
        "chat": chat(rng, requests=n(4000), chunk_tokens=c),
        "system_prompt": shared_system_prompt(rng, requests=n(4000), chunk_tokens=c),
        "rag": rag(rng, requests=n(4000), chunk_tokens=c),
        "scan": scans(rng, requests=n(100), chunk_tokens=c),
    }
    traces["scan_polluted"] = mix(
        rng,
        chat(rng, requests=n(3000), salt=b"chat", chunk_tokens=c),
        rag(rng, requests=n(3000), salt=b"rag", chunk_tokens=c),
        scans(rng, requests=n(150), salt=b"scan", chunk_tokens=c),
    )
    return traces


def distinct_chunks(requests: Sequence[TraceRequest]) -> int:
    """How many different chunk keys a trace holds: its whole working set."""
    return len({key for request in requests for key in request.keys})


class ReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    policy: str
    capacity_chunks: int
    #: Chunks looked up (every full chunk of every prompt).
    lookups: int
    #: Chunks found: each prompt's leading run of resident chunks.
    hits: int
    #: Chunks stored after a miss.
    stored: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def replay(
    requests: Sequence[TraceRequest],
    policy: CachePolicy,
    capacity: int,
    *,
    admission: AdmissionFilter | None = None,
    predecessors: bool = True,
    tail_first: bool = False,
) -> ReplayResult:
    """Serve ``requests`` from a cache of ``capacity`` chunks ordered by ``policy``.

    Prefix semantics, as an engine reuses cached KV: a prompt's leading resident chunks
    are hits (and touched); from the first missing chunk on, every chunk is a miss, and
    the missing ones are stored in order (those ``admission`` refuses, and all after the
    first refusal, are not). Room is made with ``policy.evict`` while the request's own
    chunks are protected, as an owner pins what a request is using; a prompt longer than
    the cache stores as many of its chunks as fit.

    Each stored chunk is inserted with its predecessor, as tiered-kv's manager does;
    ``predecessors=False`` withholds them, so the policy orders chunks as unrelated keys.
    Hits are touched and chunks stored head to tail, as the manager does; ``tail_first``
    stores then touches each prompt's chunks from its last to its first, leaving the
    head most recent, as vLLM's offloading managers order a request's blocks.
    """
    if capacity <= 0:
        raise ConfigError(f"must be positive, got {capacity}", field="capacity")
    lookups = hits = stored = 0
    contains, touch, insert = policy.__contains__, policy.touch, policy.insert
    for request in requests:
        keys = request.keys
        lookups += len(keys)
        found = 0
        for key in keys:
            if not contains(key):
                break
            found += 1
        hits += found
        if not tail_first:
            for key in keys[:found]:
                touch(key)
        missing = [i for i in range(found, len(keys)) if not contains(keys[i])]
        resident_mine = len(keys) - len(missing)
        parents = (None, *keys[:-1]) if predecessors else (None,) * len(keys)
        if admission is not None:
            admitted = [admission.admit(keys[i], parents[i]) for i in missing]  # every chunk is sighted
            missing = missing[: admitted.index(False)] if False in admitted else missing
        missing = missing[: capacity - resident_mine]
        if missing:
            mine = set(keys)
            excess = len(policy) + len(missing) - capacity
            if excess > 0 and policy.evict(excess, mine.__contains__) is None:
                raise PolicyError(f"{policy.name} could not evict {excess} unprotected keys it holds")
            for i in reversed(missing) if tail_first else missing:
                insert(keys[i], parents[i])
            stored += len(missing)
        if tail_first:
            for key in reversed(keys[:found]):
                touch(key)
    return ReplayResult(policy=policy.name, capacity_chunks=capacity, lookups=lookups, hits=hits, stored=stored)
