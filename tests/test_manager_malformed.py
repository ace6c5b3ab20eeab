"""Malformed calls at the public API, as a buggy or hostile tenant makes them.

Each call must end in a typed :class:`TieredKVError` or a documented miss (``lookup`` and
``load`` return fewer chunks or tokens, ``store`` skips), never a native exception and never
a background failure; and afterwards the manager must go on serving every tenant correct
bytes. The rules are written down in docs/design.md ("Errors at the public API"). The
same holds with a remote tier configured (a real valkey-server), where lookups also queue
probes and stores also write to the server.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from conftest import make_namespace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_support import remote_config, requires_valkey, valkey
from test_manager_data import engine_cache, same_blocks

from tiered_kv import (
    CpuTierConfig,
    NamespacePolicyConfig,
    NvmeTierConfig,
    StoreResult,
    TieredKV,
    TieredKVConfig,
    TieredKVError,
    chunk_keys,
)
from tiered_kv.arguments import require_keys
from tiered_kv.config import RemoteTierConfig
from tiered_kv.errors import BlockTableError, ChunkKeyError, ConfigError
from tiered_kv.testing.valkey_server import ValkeyServer

__all__ = ["valkey"]  # fixture
NS = make_namespace()
OTHER_MODEL = make_namespace(model_id="acme/other")
TENANT = msgspec.structs.replace(NS, cache_salt="tenant-b")
CHUNK = NS.geometry.chunk_size
K = NS.geometry.blocks_per_chunk
GOOD_KEYS = chunk_keys(NS, list(range(4 * CHUNK)))  # 4 chunks, stored from blocks 0..15
NUM_BLOCKS = 64

bad_key = st.sampled_from(
    [b"", b"x" * 15, b"x" * 17, b"k" * 300, "a string key", 123, None, 1.5, bytearray(16), [b"x" * 16]]
)
foreign_key = st.sampled_from(chunk_keys(OTHER_MODEL, list(range(CHUNK))) + chunk_keys(TENANT, list(range(CHUNK))))
good_key = st.sampled_from(GOOD_KEYS + chunk_keys(NS, list(range(9000, 9000 + 2 * CHUNK))))
any_key = st.one_of(good_key, bad_key, foreign_key)
bad_block = st.sampled_from(
    [-5, NUM_BLOCKS, 10**9, 1.5, "3", None, True, 2**70, np.True_, np.array(False), torch.tensor(True)]
)
good_block = st.integers(16, NUM_BLOCKS - 1)
any_block = st.one_of(good_block, bad_block)
bad_tokens = st.sampled_from([-1, 10**20, 1.5, None, "7", True, 17 * CHUNK])
any_tokens = st.one_of(st.integers(0, 6 * CHUNK), bad_tokens)


class LyingLength(list):  # type: ignore[type-arg]
    """A sequence whose ``len()`` is not what iterating it yields."""

    def __init__(self, items: Any, length: int) -> None:
        super().__init__(items)
        self.length = length

    def __len__(self) -> int:
        return self.length


class ArrayOfNothing(np.ndarray):  # type: ignore[type-arg]
    """An integer array whose ``tolist`` reads out no list."""

    def tolist(self) -> Any:  # type: ignore[override]
        return None


class TensorOfNothing(torch.Tensor):
    def tolist(self) -> Any:  # type: ignore[override]
        return None


class TensorAnsweringNothing(torch.Tensor):
    """A tensor subclass whose torch functions (``Tensor.tolist`` among them) answer ``None``."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.tolist:
            return None
        return super().__torch_function__(func, types, args, kwargs or {})


def lying(draw: Any, groups: list[Any]) -> LyingLength:
    """``groups`` claiming one group more or fewer than it holds."""
    return LyingLength(groups, len(groups) + draw(st.sampled_from([-1, 1])))


def key_lists(draw: Any) -> Any:
    shape = draw(st.sampled_from(["ok", "groups", "flat", "not-a-list", "lying"]))
    keys = draw(st.lists(any_key, min_size=0, max_size=6))
    if shape == "lying":
        return lying(draw, draw(st.sampled_from([[keys], [keys, keys]])))
    if shape == "groups":
        return [keys, keys]
    if shape == "flat":
        return keys
    if shape == "not-a-list":
        return draw(st.sampled_from([None, 5, b"x" * 16, "keys"]))
    return [keys]


def block_tables(draw: Any) -> Any:
    shape = draw(
        st.sampled_from(
            [
                *("ok", "ok", "groups", "flat", "not-a-list", "duplicates", "array", "tensor", "matrix", "bytes"),
                *("lying", "array-subclass", "tensor-subclass"),
            ]
        )
    )
    table = draw(st.lists(any_block, min_size=0, max_size=6 * K))
    if shape == "lying":
        return lying(draw, draw(st.sampled_from([[table], [table, table]])))
    if shape == "array-subclass":
        return [np.arange(16, 16 + 4 * K).view(ArrayOfNothing)]
    if shape == "tensor-subclass":
        subclass = draw(st.sampled_from([TensorOfNothing, TensorAnsweringNothing]))
        return [torch.arange(16, 16 + 4 * K).as_subclass(subclass)]
    if shape == "groups":
        return [table, table]
    if shape == "flat":
        return table
    if shape == "not-a-list":
        return draw(st.sampled_from([None, 5, "blocks"]))
    if shape in ("array", "tensor"):  # as engines keep block tables: any integer dtype, or not
        ids = draw(st.lists(st.integers(-8, 2 * NUM_BLOCKS), min_size=0, max_size=6 * K))
        dtype = draw(st.sampled_from(["int64", "int32", "uint8", "float32", "bool", "datetime64[ns]"]))
        array = np.array(ids).astype(dtype)
        if shape == "array" or dtype == "datetime64[ns]":
            return [array]
        return [torch.from_numpy(array)]
    if shape == "matrix":
        return [np.arange(4 * K).reshape(2, 2 * K)]
    if shape == "bytes":
        return [draw(st.sampled_from([bytes, memoryview]))(bytes(range(16, 16 + 4 * K)))]
    if shape == "duplicates":
        return [[16] * (4 * K)]
    return [table]


namespaces = st.sampled_from([NS, NS, TENANT, OTHER_MODEL, "acme/tiny", None])


async def malformed_call(kv: TieredKV, data: Any) -> None:
    kind = data.draw(st.sampled_from(["lookup", "load", "store", "store_nowait", "finish", "flush"]))
    namespace = data.draw(namespaces)
    try:
        if kind == "lookup":
            result: Any = kv.lookup(namespace, key_lists(data.draw))
            assert isinstance(result, int) and result >= 0
        elif kind == "load":
            result = await kv.load(
                namespace,
                request_id=data.draw(st.sampled_from(["l", "", 7])),
                keys=key_lists(data.draw),
                block_ids=block_tables(data.draw),
                num_tokens=data.draw(any_tokens),
            )
            assert isinstance(result, int) and result >= 0
        elif kind in ("store", "store_nowait"):
            call = dict(
                request_id=data.draw(st.sampled_from(["s", "", 7, None])),
                keys=key_lists(data.draw),
                block_ids=block_tables(data.draw),
            )
            result = await kv.store(namespace, **call) if kind == "store" else kv.store_nowait(namespace, **call)
            assert isinstance(result, StoreResult)
        elif kind == "finish":
            await kv.finish_request(data.draw(st.sampled_from(["s", "never-seen", 7, None])))
        else:
            flushed = data.draw(
                st.sampled_from(
                    [
                        *(None, [1, 2], [1.5], "blocks", [10**9], b"\x01\x02", np.arange(3), [torch.tensor(True)]),
                        *(np.arange(3).view(ArrayOfNothing), torch.arange(3).as_subclass(TensorAnsweringNothing)),
                    ]
                )
            )
            await kv.flush(flushed, namespace=namespace)
    except TieredKVError:
        pass


async def serves_correct_bytes(kv: TieredKV, cache: list[torch.Tensor], tag: int) -> None:
    """The good prefix still loads bit-exact, and a new store round-trips."""
    assert kv.lookup(NS, [GOOD_KEYS]) == 4
    dest = list(range(16, 32))
    assert await kv.load(NS, request_id=f"check-{tag}", keys=[GOOD_KEYS], block_ids=[dest], num_tokens=4 * CHUNK) == (
        4 * CHUNK
    )
    assert same_blocks(cache, range(16), dest)
    fresh = chunk_keys(NS, list(range(50_000 + tag * 100, 50_000 + tag * 100 + CHUNK)))
    await kv.store(NS, request_id=f"fresh-{tag}", keys=[fresh], block_ids=[list(range(32, 36))])
    await kv.finish_request(f"fresh-{tag}")
    assert kv.lookup(NS, [fresh]) == 1
    dest = list(range(40, 44))
    assert await kv.load(NS, request_id=f"back-{tag}", keys=[fresh], block_ids=[dest], num_tokens=CHUNK) == CHUNK
    assert same_blocks(cache, range(32, 36), dest)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_malformed_calls_are_typed_errors_or_misses_and_the_manager_keeps_serving(data: Any) -> None:
    run_malformed_calls(data, remote=None)


@requires_valkey
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_malformed_calls_with_a_remote_tier_are_typed_errors_or_misses(valkey: ValkeyServer, data: Any) -> None:
    run_malformed_calls(data, remote=remote_config(valkey))


def run_malformed_calls(data: Any, remote: RemoteTierConfig | None) -> None:
    async def scenario() -> None:
        cache = engine_cache(NUM_BLOCKS)
        chunk = NS.geometry.chunk_bytes()
        with tempfile.TemporaryDirectory() as root:
            config = TieredKVConfig(
                cpu=CpuTierConfig(capacity_bytes=chunk * 24),
                nvme=NvmeTierConfig(root=root, capacity_bytes=chunk * 48, io_depth=2),
                remote=remote,
                namespaces={NS.model_id: NamespacePolicyConfig(cpu_bytes=chunk * 16, nvme_bytes=chunk * 32)},
            )
            kv = TieredKV(config)
            try:
                await kv.register(NS, [cache])
                await kv.register(OTHER_MODEL, [engine_cache(NUM_BLOCKS, seed=1, ns=OTHER_MODEL)])
                await kv.store(NS, request_id="good", keys=[GOOD_KEYS], block_ids=[list(range(16))])
                await kv.finish_request("good")
                for _ in range(data.draw(st.integers(1, 4))):
                    await malformed_call(kv, data)
                    await kv.drain()  # any background failure surfaces here
                    await serves_correct_bytes(kv, cache, data.draw(st.integers(0, 10**6)))
                kv.check_invariants()
            finally:
                await kv.close()

    asyncio.run(scenario())


async def test_a_closed_manager_refuses_every_call_with_a_typed_error(tmp_path: Any) -> None:
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 4)))
    await kv.register(NS, [engine_cache(NUM_BLOCKS)])
    await kv.close()
    calls = [
        lambda: kv.lookup(NS, [GOOD_KEYS]),
        lambda: kv.store_nowait(NS, request_id="s", keys=[GOOD_KEYS], block_ids=[list(range(16))]),
        lambda: kv.finish_request_nowait("s"),
        lambda: kv.flush_nowait(),
    ]
    for call in calls:
        try:
            call()
        except TieredKVError as exc:
            assert "closed" in str(exc)
        else:
            raise AssertionError("a closed manager answered")


async def test_a_lookup_stops_at_a_value_that_is_not_a_chunk_key_and_raises_nothing() -> None:
    """``lookup`` does not check its keys one by one (it is the engine's per-step call):
    a value that is not 16 ``bytes`` matches no chunk, hashable or not."""
    from test_manager_control import NS as NULL_NS
    from test_manager_control import config, keys_for, open_harness

    harness = await open_harness(config())
    keys = keys_for(3)
    await harness.store(keys)
    await harness.kv.finish_request("r")
    assert harness.lookup(keys) == 3
    for bad in (None, "k" * 16, bytearray(keys[1]), memoryview(keys[1]), keys[1][:8], [1, 2], {"a": 1}, 17):
        assert harness.kv.lookup(NULL_NS, [[keys[0], bad, keys[2]]]) == 1, bad
    assert harness.lookup(keys) == 3  # and the manager goes on serving
    await harness.kv.close()


def test_a_key_of_a_bytes_subclass_is_refused_with_a_message_that_names_why() -> None:
    """Regression (adversarial test): a 16-byte key of a bytes subclass was refused as
    "a chunk key must be 16 bytes, got 16 bytes"."""

    class Key(bytes):
        pass

    with pytest.raises(ChunkKeyError, match=r"got a Key \(a subclass of bytes\) of 16 bytes"):
        require_keys([Key(16)])


class _BrokenIndex:
    """An "integer" whose ``__index__`` raises something other than ``TypeError``."""

    def __index__(self) -> int:
        raise ValueError("no index")


@pytest.mark.parametrize(
    "make",
    [
        np.array,
        torch.tensor,
        lambda ids: np.array(ids, dtype=np.int32),
        lambda ids: np.array(ids).view(ArrayOfNothing),
        lambda ids: torch.tensor(ids).as_subclass(TensorOfNothing),
    ],
    ids=["numpy", "torch", "int32", "ndarray-subclass", "tensor-subclass"],
)
async def test_block_tables_as_engines_keep_them_numpy_or_torch_store_and_load_like_lists(make: Any) -> None:
    """Regression (adversarial test): a group's block table as a numpy array or a torch
    tensor was refused with "block_ids must be one list per KV group (1), got 1 items",
    which names neither the group nor the type, while ``flush`` took the same arrays.
    Regression (adversarial test): a subclass whose ``tolist()`` returned ``None`` gave a
    plain ``TypeError``; its ids are read with the base type's ``tolist``."""
    cache = engine_cache(NUM_BLOCKS)
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [cache])
    result = await kv.store(NS, request_id="s", keys=[GOOD_KEYS], block_ids=[make(list(range(16)))])
    assert result.submitted == 4
    await kv.flush(make([0, 1]), namespace=NS)
    await kv.finish_request("s")
    dest = list(range(16, 32))
    assert (
        await kv.load(NS, request_id="l", keys=[GOOD_KEYS], block_ids=[make(dest)], num_tokens=4 * CHUNK) == 4 * CHUNK
    )
    assert same_blocks(cache, range(16), dest)
    await kv.close()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (np.arange(16).reshape(2, 8), r"block_ids\[0\] must be 1-D, got a ndarray of shape \(2, 8\)"),
        (torch.zeros(4, 4, dtype=torch.int64), r"block_ids\[0\] must be 1-D, got a Tensor of shape \(4, 4\)"),
        ({1, 2, 3}, r"block_ids\[0\] must be a list, a 1-D numpy array or a 1-D torch tensor, got set"),
        (np.arange(16, dtype=np.float32), r"block_ids\[0\] must hold integers, got an array of float32"),
        (np.ones(16, dtype=bool), r"must hold integers, got an array of bool"),
        # Regression (review): these were taken, or raised torch's or numpy's own errors
        (np.arange(16).astype("datetime64[ns]"), r"must hold integers, got an array of datetime64\[ns\]"),
        (torch.arange(16).to_sparse(), r"must be a tensor on the CPU, got one on cpu \(torch.sparse_coo\)"),
        (torch.empty(16, dtype=torch.int64, device="meta"), r"must be a tensor on the CPU, got one on meta"),
        (torch.ones(16, dtype=torch.bool), r"must hold integers, got a tensor of torch.bool"),
        (memoryview(bytes(range(16))), r"block_ids\[0\] must be a list, .*, got memoryview"),
        ([_BrokenIndex()] * 16, r"a block id must be an integer, got _BrokenIndex"),
    ],
)
async def test_a_block_table_that_is_no_list_of_ids_is_refused_with_a_message_that_names_it(
    table: Any, message: str
) -> None:
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [engine_cache(NUM_BLOCKS)])
    with pytest.raises(BlockTableError, match=message):
        await kv.store(NS, request_id="s", keys=[GOOD_KEYS], block_ids=[table])
    await kv.close()


@pytest.mark.parametrize(
    "blocks",
    [
        b"\x01\x02",
        bytearray(b"\x01"),
        "12",
        memoryview(b"\x01\x02"),
        np.array(3),
        torch.tensor(3),
        torch.ones(2, dtype=torch.bool),
        [_BrokenIndex()],
    ],
)
async def test_flush_refuses_what_is_no_list_of_block_ids_with_a_typed_error(blocks: Any) -> None:
    """Regression (adversarial test): ``flush(b"\\x01\\x02")`` waited for blocks 1 and 2;
    a 0-d array raised numpy's ``TypeError``, a broken ``__index__`` its own error, and a
    bool tensor was taken as ids."""
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [engine_cache(NUM_BLOCKS)])
    with pytest.raises(BlockTableError):
        await kv.flush(blocks)
    with pytest.raises(BlockTableError):
        kv.flush_nowait(blocks)
    await kv.flush(np.arange(3, dtype=np.int32))  # a 1-D integer array is block ids
    await kv.close()


async def test_a_tensor_whose_tolist_reads_out_no_list_is_refused_as_a_block_table() -> None:
    table = torch.arange(16).as_subclass(TensorAnsweringNothing)
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [engine_cache(NUM_BLOCKS)])
    with pytest.raises(BlockTableError, match="cannot be read as block ids: tolist gave a NoneType"):
        await kv.store(NS, request_id="s", keys=[GOOD_KEYS], block_ids=[table])
    with pytest.raises(BlockTableError, match="cannot be read as block ids"):
        await kv.load(NS, request_id="l", keys=[GOOD_KEYS], block_ids=[table], num_tokens=4 * CHUNK)
    with pytest.raises(BlockTableError, match="cannot be read as block ids"):
        await kv.flush(table)
    await kv.close()


@pytest.mark.parametrize("truth", [torch.tensor(True), np.True_, np.array(True)], ids=["tensor", "np.bool_", "0-d"])
async def test_a_block_id_that_is_a_truth_value_of_numpy_or_torch_is_refused_as_a_bool(truth: Any) -> None:
    """Regression (adversarial test): ``flush([torch.tensor(True)])`` waited for block 1;
    only Python's ``bool`` was refused."""
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [engine_cache(NUM_BLOCKS)])
    with pytest.raises(BlockTableError, match="got a bool"):
        await kv.flush([truth])
    with pytest.raises(BlockTableError, match="got a bool"):
        await kv.store(NS, request_id="s", keys=[GOOD_KEYS[:1]], block_ids=[[truth, 2, 3, 4][:K]])
    await kv.close()


async def test_groups_are_what_iterating_them_yields_whatever_their_len_says() -> None:
    """Regression (adversarial test): a sequence of groups whose ``len()`` was one while it
    held two gave ``zip``'s ``ValueError`` from store and load. Groups are read once; two
    groups for a one-group namespace are refused, one group claiming two is one group."""
    cache = engine_cache(NUM_BLOCKS)
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [cache])
    two_claiming_one = LyingLength([GOOD_KEYS, GOOD_KEYS], 1)
    tables = LyingLength([list(range(16)), list(range(16))], 1)
    with pytest.raises(ChunkKeyError, match=r"one list per KV group \(1\), got 2 items"):
        await kv.store(NS, request_id="s", keys=two_claiming_one, block_ids=[list(range(16))])
    with pytest.raises(ChunkKeyError, match="one list per KV group"):
        await kv.load(NS, request_id="l", keys=two_claiming_one, block_ids=[list(range(16))], num_tokens=CHUNK)
    with pytest.raises(ChunkKeyError, match="one list per KV group"):
        kv.lookup(NS, two_claiming_one)
    with pytest.raises(BlockTableError, match="one list per KV group"):
        await kv.store(NS, request_id="s", keys=[GOOD_KEYS], block_ids=tables)
    with pytest.raises(BlockTableError, match="one list per KV group"):
        await kv.load(NS, request_id="l", keys=[GOOD_KEYS], block_ids=tables, num_tokens=CHUNK)
    with pytest.raises(ConfigError, match="one list per KV group"):
        await kv.register(OTHER_MODEL, LyingLength([[cache], [cache]], 1))

    one_claiming_two = LyingLength([GOOD_KEYS], 2)
    await kv.store(NS, request_id="s", keys=one_claiming_two, block_ids=LyingLength([list(range(16))], 2))
    await kv.finish_request("s")
    assert kv.lookup(NS, one_claiming_two) == 4
    dest = LyingLength([list(range(16, 32))], 2)
    assert await kv.load(NS, request_id="l", keys=one_claiming_two, block_ids=dest, num_tokens=4 * CHUNK) == 4 * CHUNK
    assert same_blocks(cache, range(16), range(16, 32))
    await kv.close()


class _DtypeRaises:
    """An "integer" whose ``dtype`` property raises (a broken array-like)."""

    @property
    def dtype(self) -> Any:
        raise ValueError("no dtype")

    def __index__(self) -> int:
        return 3


async def test_a_block_id_whose_dtype_raises_is_refused_with_a_typed_error() -> None:
    """Regression (review): the bool check read ``dtype`` outside the ``try`` that turns a
    block id's own failure into a ``BlockTableError``, so its ``ValueError`` escaped."""
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [engine_cache(NUM_BLOCKS)])
    with pytest.raises(BlockTableError, match="got _DtypeRaises"):
        await kv.flush([_DtypeRaises()])
    with pytest.raises(BlockTableError, match="got _DtypeRaises"):
        await kv.store(NS, request_id="s", keys=[GOOD_KEYS[:1]], block_ids=[[_DtypeRaises()] * K])
    await kv.close()


class _TensorRaising(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError("a torch function of a broken subclass")


class _NdimRaising(np.ndarray):  # type: ignore[type-arg]
    @property
    def ndim(self) -> int:  # type: ignore[override]
        raise RuntimeError("no ndim")


class _IterRaising(list):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        raise ValueError("cannot iterate")


@pytest.mark.parametrize(
    "table",
    [
        torch.arange(16).as_subclass(_TensorRaising),
        np.arange(16).view(_NdimRaising),
        _IterRaising(range(16)),
    ],
    ids=["tensor-torch-function", "ndarray-ndim", "iter"],
)
async def test_a_group_whose_own_attributes_or_iteration_raise_is_a_typed_error(table: Any) -> None:
    """Regression (review): ``_array_ids`` read an array's ``ndim``, ``layout``, ``device``
    and ``dtype`` outside its guard, and ``per_group`` iterated a sequence unguarded: what
    they raised escaped from store, load, lookup and flush as native exceptions."""
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [engine_cache(NUM_BLOCKS)])
    with pytest.raises(BlockTableError):
        await kv.store(NS, request_id="s", keys=[GOOD_KEYS], block_ids=[table])
    with pytest.raises(BlockTableError):
        await kv.load(NS, request_id="l", keys=[GOOD_KEYS], block_ids=[table], num_tokens=4 * CHUNK)
    with pytest.raises(BlockTableError):
        await kv.flush(table)
    with pytest.raises(ChunkKeyError):
        kv.lookup(NS, _IterRaising([GOOD_KEYS]))
    await kv.close()


async def test_a_keys_group_whose_len_lies_is_read_as_what_it_holds_by_lookup() -> None:
    """Regression (review): a keys group (not the outer sequence) whose ``len()`` claimed
    100 keys gave the control plane's ``IndexError`` from ``lookup``."""
    kv = TieredKV(TieredKVConfig(cpu=CpuTierConfig(capacity_bytes=NS.geometry.chunk_bytes() * 8)))
    await kv.register(NS, [engine_cache(NUM_BLOCKS)])
    await kv.store(NS, request_id="s", keys=[GOOD_KEYS], block_ids=[list(range(16))])
    await kv.finish_request("s")
    assert kv.lookup(NS, [LyingLength(GOOD_KEYS, 100)]) == 4
    await kv.close()
