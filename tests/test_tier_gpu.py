"""The gpu tier: the contract for every way an engine holds its KV cache, the tensor-major
chunk layout, sliding-window sub-ranges, cancellation mid-copy, CUDA specifics."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv.errors import TierIOError
from tiered_kv.interfaces import TransferOp
from tiered_kv.testing import TierDriverContract
from tiered_kv.tiers import gpu
from tiered_kv.tiers.gpu import GpuTier, _runs, _stretches
from tiered_kv.tiers.pinned_cpu import PinnedCpuTier

BPC = 4  # blocks per chunk
CHUNKS = 5
BLOCKS = BPC * CHUNKS + 2  # two blocks no chunk uses
LAYERS, BLOCK_TOKENS, HEADS, DIM = 3, 2, 2, 8

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

#: How engines hold a KV cache: (tensors, block_dim) for a dtype and device.
Layout = Callable[[torch.dtype, str], tuple[list[torch.Tensor], int]]


def _filled(shape: Sequence[int], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    count = int(torch.tensor(shape).prod()) * dtype.itemsize
    bits = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return bits.view(dtype).view(*shape).to(device)


def per_layer(dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], int]:
    """K and V of each layer as separate tensors ``[num_blocks, block, heads, dim]``."""
    shape = (BLOCKS, BLOCK_TOKENS, HEADS, DIM)
    return [_filled(shape, dtype, device, i) for i in range(2 * LAYERS)], 0


def per_layer_kv(dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], int]:
    """One tensor per layer, ``[2, num_blocks, block, heads, dim]`` (vLLM's FlashAttention)."""
    return [_filled((2, BLOCKS, BLOCK_TOKENS, HEADS, DIM), dtype, device, i) for i in range(LAYERS)], 1


def fused_blocks_first(dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], int]:
    """One tensor, ``[num_blocks, layers, 2, block, heads, dim]``: a block holds every layer."""
    return [_filled((BLOCKS, LAYERS, 2, BLOCK_TOKENS, HEADS, DIM), dtype, device, 0)], 0


def fused_layers_first(dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], int]:
    """One tensor, ``[layers, 2, num_blocks, block, heads, dim]``."""
    return [_filled((LAYERS, 2, BLOCKS, BLOCK_TOKENS, HEADS, DIM), dtype, device, 0)], 2


def views_of_one_buffer(dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], int]:
    """K and V of each layer as views of one allocation, with a gap after each."""
    big = _filled((LAYERS, 2, BLOCKS + 1, BLOCK_TOKENS, HEADS, DIM), dtype, device, 0)
    return [big[layer, kv, :BLOCKS] for layer in range(LAYERS) for kv in range(2)], 0


def _chunk_blocks() -> list[tuple[int, ...]]:
    """Each chunk's engine blocks: runs of two consecutive ids, in shuffled order."""
    pairs = [(2 * i, 2 * i + 1) for i in range(BLOCKS // 2)]
    random.Random(0).shuffle(pairs)
    flat = [b for pair in pairs for b in pair]
    return [tuple(flat[c * BPC : (c + 1) * BPC]) for c in range(CHUNKS)]


CHUNK_BLOCKS = _chunk_blocks()


def reference_chunk(tensors: Sequence[torch.Tensor], block_dim: int, blocks: Sequence[int]) -> torch.Tensor:
    """The tensor-major bytes of ``blocks``: per KV tensor, its slice of each block."""
    parts = []
    for tensor in tensors:
        for index in itertools.product(*map(range, tensor.shape[:block_dim])):
            for block in blocks:
                parts.append(tensor[index][block].contiguous().cpu().view(torch.uint8).flatten())
    return torch.cat(parts)


def pieces(tensors: Sequence[torch.Tensor], block_dim: int) -> list[int]:
    return [t[0].numel() * t.element_size() for t in tensors for t in _split(t, block_dim)]


def _split(tensor: torch.Tensor, block_dim: int) -> list[torch.Tensor]:
    return [tensor[index] for index in itertools.product(*map(range, tensor.shape[:block_dim]))]


class GpuContract(TierDriverContract):
    layout: Layout
    device = "cpu"

    async def make_tier(self, path: Path, dtype: str) -> GpuTier:
        tensors, block_dim = type(self).layout(getattr(torch, dtype), self.device)
        self.pieces = pieces(tensors, block_dim)
        return GpuTier(tensors, blocks_per_chunk=BPC, block_dim=block_dim)

    def chunk_bytes(self, tier: object) -> int:
        assert isinstance(tier, GpuTier)
        return tier.chunk_bytes

    def num_chunks(self, tier: object) -> int:
        return CHUNKS

    def op(self, tier: object, chunk: int, buffer: torch.Tensor, key: bytes) -> TransferOp:
        return TransferOp(buffer=buffer, key=key, blocks=CHUNK_BLOCKS[chunk])

    def partial_op(self, tier: object, chunk: int, buffer: torch.Tensor, key: bytes) -> tuple[TransferOp, torch.Tensor]:
        """Blocks 1 and 2 of the chunk: a run that starts (and ends) inside it."""
        first, n = 1, 2
        mask = torch.zeros(buffer.numel(), dtype=torch.bool)
        offset = 0
        for piece in self.pieces:
            mask[offset + first * piece : offset + (first + n) * piece] = True
            offset += BPC * piece
        return TransferOp(
            buffer=buffer, key=key, blocks=CHUNK_BLOCKS[chunk][first : first + n], first_block=first
        ), mask


class TestPerLayer(GpuContract):
    layout = staticmethod(per_layer)


class TestPerLayerKV(GpuContract):
    layout = staticmethod(per_layer_kv)


class TestFusedLayersFirst(GpuContract):
    layout = staticmethod(fused_layers_first)


@pytest.mark.cuda
@requires_cuda
class TestPerLayerKVOnCuda(GpuContract):
    layout = staticmethod(per_layer_kv)
    device = "cuda"


ALL_LAYOUTS = [per_layer, per_layer_kv, fused_blocks_first, fused_layers_first, views_of_one_buffer]


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda f: f.__name__)
async def test_a_chunk_is_laid_out_tensor_major(layout: Layout) -> None:
    tensors, block_dim = layout(torch.bfloat16, "cpu")
    tier = GpuTier(tensors, blocks_per_chunk=BPC, block_dim=block_dim)
    buffer = torch.zeros(tier.chunk_bytes, dtype=torch.uint8)
    await tier.read([TransferOp(buffer=buffer, blocks=CHUNK_BLOCKS[3])])
    assert torch.equal(buffer, reference_chunk(tensors, block_dim, CHUNK_BLOCKS[3]))
    await tier.close()


@pytest.mark.parametrize(
    ("layout", "copies"),
    [
        (per_layer, 2 * LAYERS),
        (per_layer_kv, LAYERS),
        (fused_blocks_first, 1),
        (fused_layers_first, 1),
        (views_of_one_buffer, 1),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_tensors_laid_out_alike_in_one_allocation_share_one_copy_per_run(layout: Layout, copies: int) -> None:
    tensors, block_dim = layout(torch.float16, "cpu")
    tier = GpuTier(tensors, blocks_per_chunk=BPC, block_dim=block_dim)
    assert f"copies_per_run={copies}>" in repr(tier)
    assert tier.slot_bytes == 2 * LAYERS * BLOCK_TOKENS * HEADS * DIM * 2
    assert tier.num_slots == BLOCKS


@pytest.mark.parametrize("gather_below", [0, 1 << 40], ids=["copy per run", "gather"])
@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=lambda f: f.__name__)
async def test_chunks_in_consecutive_slots_move_as_one_stretch_and_stay_exact(
    layout: Layout, gather_below: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ops alike whose buffers lie at equal steps in one slab are one stretch, whatever
    their blocks; its blocks move as a strided copy per run of consecutive blocks or as one
    gather/scatter per tensor group. Bytes are the same as chunk by chunk, both ways, and
    either way."""
    monkeypatch.setattr(gpu, "GATHER_BELOW_BYTES", gather_below)
    tensors, block_dim = layout(torch.bfloat16, "cpu")
    tier = GpuTier(tensors, blocks_per_chunk=BPC, block_dim=block_dim)
    slab = PinnedCpuTier(tier.chunk_bytes, CHUNKS)
    runs = [(0, 1, 2), (0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (16, 17, 18, 19), (12, 13, 14, 15)]
    ops = [TransferOp(buffer=slab.view(j), blocks=blocks) for j, blocks in zip([0, 1, 2, 3, 4], runs[1:], strict=True)]
    (stretch,) = _stretches(ops, tier.chunk_bytes)
    assert stretch.size == 5 and stretch.stride == slab.slot_stride
    assert len(_runs(stretch.blocks, 0)) == 3  # blocks 0..11, then 16..19, then 12..15
    ((_, m, stride, _),) = _stretches([ops[0], ops[2]], tier.chunk_bytes)  # slots 0 and 2: still equal steps
    assert (m, stride) == (2, 2 * slab.slot_stride)
    assert [s.size for s in _stretches([ops[0], TransferOp(buffer=slab.view(1), blocks=runs[0])], 0)] == [1, 1]
    await tier.read(ops)
    for op in ops:
        assert torch.equal(op.buffer, reference_chunk(tensors, block_dim, op.blocks))
    originals = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    await tier.write(ops)
    for t, original in zip(tensors, originals, strict=True):
        used = sorted(b for op in ops for b in op.blocks)
        index = tuple([slice(None)] * block_dim + [used])
        # Compared as bytes: the random bits include NaNs, which never equal themselves.
        assert torch.equal(t[index].contiguous().view(torch.uint8), original[index].contiguous().view(torch.uint8))
    await tier.close()
    await slab.close()


async def test_a_sliding_window_load_fills_only_its_blocks() -> None:
    """A load of blocks 1..3 of a chunk (the window starts inside it) writes exactly those
    engine blocks, from the matching ranges of every tensor's section."""
    tensors, block_dim = per_layer_kv(torch.bfloat16, "cpu")
    before = [t.clone() for t in tensors]
    tier = GpuTier(tensors, blocks_per_chunk=BPC, block_dim=block_dim)
    source = torch.randint(0, 256, (tier.chunk_bytes,), dtype=torch.uint8)
    targets = (7, 12, 13)
    await tier.write([TransferOp(buffer=source, blocks=targets, first_block=1)])
    piece = tier.slot_bytes // (2 * LAYERS)
    for layer, (tensor, old) in enumerate(zip(tensors, before, strict=True)):
        for kv in range(2):
            section = source[(2 * layer + kv) * BPC * piece :][: BPC * piece].view(BPC, piece)
            for block in range(BLOCKS):
                got = tensor[kv, block].contiguous().view(torch.uint8).flatten()
                want = (
                    section[1 + targets.index(block)]
                    if block in targets
                    else old[kv, block].view(torch.uint8).flatten()
                )
                assert torch.equal(got, want), (layer, kv, block)
    await tier.close()


def test_caches_it_cannot_address_are_refused() -> None:
    with pytest.raises(ValueError, match="same number of blocks"):
        GpuTier([torch.zeros(4, 8), torch.zeros(5, 8)], blocks_per_chunk=2)
    with pytest.raises(ValueError, match="contiguous"):
        GpuTier([torch.zeros(8, 4).t()], blocks_per_chunk=2)
    with pytest.raises(ValueError, match="block_dim"):
        GpuTier([torch.zeros(4)], blocks_per_chunk=2, block_dim=1)
    with pytest.raises(ValueError):
        GpuTier([], blocks_per_chunk=2)


async def test_ops_that_do_not_fit_a_chunk_are_refused() -> None:
    tier = GpuTier([torch.zeros(BLOCKS, 16, dtype=torch.uint8)], blocks_per_chunk=BPC)
    buffer = torch.zeros(tier.chunk_bytes, dtype=torch.uint8)
    for op in (
        TransferOp(buffer=buffer, blocks=()),
        TransferOp(buffer=buffer, blocks=(0, 1), first_block=3),
        TransferOp(buffer=buffer, blocks=(BLOCKS,)),
        TransferOp(buffer=buffer[:-1], blocks=(0,)),
    ):
        with pytest.raises(ValueError):
            await tier.read([op])
    await tier.close()


async def test_cancel_waits_until_the_copy_has_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    copying, release = threading.Event(), threading.Event()
    real = torch._foreach_copy_

    def held(*args: object, **kwargs: object) -> None:
        copying.set()
        release.wait(10)
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_foreach_copy_", held)
    tensors, block_dim = per_layer(torch.float16, "cpu")
    tier = GpuTier(tensors, blocks_per_chunk=BPC, block_dim=block_dim)
    buffer = torch.zeros(tier.chunk_bytes, dtype=torch.uint8)
    task = asyncio.ensure_future(tier.read([TransferOp(buffer=buffer, blocks=CHUNK_BLOCKS[0])]))
    await asyncio.to_thread(copying.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done(), "the cancellation went through while a copy still ran"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert torch.equal(buffer, reference_chunk(tensors, block_dim, CHUNK_BLOCKS[0]))  # the copy did finish
    monkeypatch.undo()
    await tier.close()


async def test_a_failed_copy_is_a_tier_io_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    tier = GpuTier([torch.zeros(BLOCKS, 64, dtype=torch.uint8)], blocks_per_chunk=BPC)
    monkeypatch.setattr(torch, "_foreach_copy_", broken)
    with pytest.raises(TierIOError, match="illegal memory access") as caught:
        await tier.write([TransferOp(buffer=torch.zeros(tier.chunk_bytes, dtype=torch.uint8), blocks=(0,))])
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert tier.statistics().errors == 1 and tier.statistics().writes == 0
    monkeypatch.undo()
    await tier.close()


async def test_the_event_loop_stays_responsive_during_a_large_copy() -> None:
    tier = GpuTier([torch.ones(BLOCKS, 1 << 20, dtype=torch.uint8)], blocks_per_chunk=BPC)
    buffers = [torch.zeros(tier.chunk_bytes, dtype=torch.uint8) for _ in range(CHUNKS)]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    beat = asyncio.ensure_future(ticker())
    for _ in range(3):
        await tier.read([TransferOp(buffer=b, blocks=CHUNK_BLOCKS[c]) for c, b in enumerate(buffers)])
    beat.cancel()
    assert ticks > 3, "the loop was blocked while the copies ran"
    await tier.close()


def cuda_tiers(block_bytes: int) -> tuple[torch.Tensor, GpuTier, PinnedCpuTier]:
    cache = torch.zeros(BLOCKS, block_bytes, dtype=torch.uint8, device="cuda")
    tier = GpuTier(cache, blocks_per_chunk=BPC)
    return cache, tier, PinnedCpuTier(tier.chunk_bytes, 1)


@pytest.mark.cuda
@requires_cuda
async def test_the_copy_stream_waits_for_the_compute_stream() -> None:
    """A store issued right after the engine wrote a block on its stream sees that write."""
    cache, tier, cpu = cuda_tiers(1 << 20)
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy ...
    cache[CHUNK_BLOCKS[0][0]].fill_(7)  # ... then the engine's write lands
    await tier.read([TransferOp(buffer=cpu.view(0), blocks=CHUNK_BLOCKS[0])])
    assert bool((cpu.view(0)[: 1 << 20] == 7).all())
    await tier.close()
    await cpu.close()


@pytest.mark.cuda
@requires_cuda
async def test_a_load_is_visible_to_the_compute_stream_once_awaited() -> None:
    cache, tier, cpu = cuda_tiers(1 << 16)
    cpu.view(0).fill_(9)
    await tier.write([TransferOp(buffer=cpu.view(0), blocks=CHUNK_BLOCKS[1])])
    assert int(cache[list(CHUNK_BLOCKS[1])].sum()) == 9 * BPC * (1 << 16)
    await tier.close()
    await cpu.close()


@st.composite
def scattered_jobs(draw: st.DrawFn) -> dict[str, object]:
    """A KV cache of random shape, element size and byte offset, and a job of ops over
    random slots of a slab, each with distinct random blocks from a random position."""
    bpc = draw(st.integers(1, 3))
    first = draw(st.integers(0, bpc - 1))
    n = draw(st.integers(1, bpc - first))
    chunks = draw(st.integers(1, 4))
    slots = draw(st.lists(st.integers(0, 5), min_size=chunks, max_size=chunks, unique=True))
    num_blocks = chunks * n + draw(st.integers(0, 3))
    return {
        "layers": draw(st.integers(1, 3)),
        "shape": (draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 5))),
        "dtype": draw(st.sampled_from([torch.uint8, torch.float16, torch.float32])),
        "offset": draw(st.sampled_from([0, 1, 2, 4])),  # elements before the cache in its allocation
        "fused": draw(st.booleans()),
        "bpc": bpc,
        "first": first,
        "slots": slots,
        "blocks": draw(st.permutations(range(num_blocks)))[: chunks * n],
        "num_blocks": num_blocks,
        "n": n,
        #: Buffers of the cpu slab (``None``), or of a storage at an odd address, this many bytes in.
        "odd_storage": draw(st.sampled_from([None, 0, 1, 4, 7])),
    }


@pytest.mark.parametrize("gather_below", [0, 1 << 40], ids=["copy per run", "gather"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=scattered_jobs())
async def test_a_job_of_any_layout_moves_the_same_bytes_as_a_copy_per_block(
    job: dict[str, Any], gather_below: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Randomized: whatever the element size and alignment of the cache (narrowed to bytes
    where a wider element does not fit), the slots of the job (one step apart or not) and the
    blocks per op, a job moved as strided copies per run, or as gathers and scatters, reads
    each op's buffer as the reference layout and writes exactly its blocks, leaving every
    other block as it was."""
    monkeypatch.setattr(gpu, "GATHER_BELOW_BYTES", gather_below)
    layers, dtype, nb = job["layers"], job["dtype"], job["num_blocks"]
    if job["fused"]:  # [layers, 2, num_blocks, ...] in one allocation after `offset` elements
        size = layers * 2 * nb * math.prod(job["shape"])
        flat = _filled((size + job["offset"],), dtype, "cpu", 1)
        tensors, block_dim = [flat[job["offset"] :].view(layers, 2, nb, *job["shape"])], 2
    else:
        size = 2 * nb * math.prod(job["shape"])
        flats = [_filled((size + job["offset"],), dtype, "cpu", 2 + i) for i in range(layers)]
        tensors, block_dim = [f[job["offset"] :].view(2, nb, *job["shape"]) for f in flats], 1
    tier = GpuTier(tensors, blocks_per_chunk=job["bpc"], block_dim=block_dim)
    slab = PinnedCpuTier(tier.chunk_bytes, 6)
    views = [slab.view(slot) for slot in range(6)]
    if job["odd_storage"] is not None:
        raw = torch.frombuffer(bytearray(6 * tier.chunk_bytes + 8), dtype=torch.uint8, offset=1)
        start = job["odd_storage"]
        views = [raw[start + j * tier.chunk_bytes :][: tier.chunk_bytes] for j in range(6)]
    n, first = job["n"], job["first"]
    ops = [
        TransferOp(buffer=views[slot], blocks=tuple(job["blocks"][i * n : (i + 1) * n]), first_block=first)
        for i, slot in enumerate(job["slots"])
    ]
    piece = tier.slot_bytes // (2 * layers)
    section = slice(first * piece, (first + n) * piece)

    def op_bytes(op: TransferOp) -> torch.Tensor:
        """The op's part of its buffer: its blocks' range of every tensor's section."""
        return op.buffer.view(2 * layers, job["bpc"] * piece)[:, section]

    await tier.read(ops)
    for op in ops:
        want = reference_chunk(tensors, block_dim, op.blocks).view(2 * layers, n * piece)
        assert torch.equal(op_bytes(op), want)
    before = [t.clone() for t in tensors]
    for i, op in enumerate(ops):
        op_bytes(op).copy_(torch.randint(0, 256, (2 * layers, n * piece), dtype=torch.uint8).add_(i))
    await tier.write(ops)
    moved = {block: op for op in ops for block in op.blocks}
    for block in range(nb):
        mover = moved.get(block)
        if mover is None:
            assert torch.equal(
                reference_chunk(tensors, block_dim, [block]), reference_chunk(before, block_dim, [block])
            )
        else:
            at = mover.blocks.index(block)
            want = op_bytes(mover).reshape(2 * layers, n, piece)[:, at].flatten()
            assert torch.equal(reference_chunk(tensors, block_dim, [block]), want)
    await tier.close()
    await slab.close()


def test_bytes_move_in_the_widest_element_both_sides_allow() -> None:
    flat = torch.zeros(64, dtype=torch.uint8)
    rows = flat[:48].view(3, 16)
    assert [t.dtype for t in gpu._widest(rows, flat[16:].view(3, 16))] == [torch.int64, torch.int64]
    assert [t.dtype for t in gpu._widest(rows, flat[4:52].view(3, 16))] == [torch.int32, torch.int32]
    assert [t.dtype for t in gpu._widest(rows, flat[1:49].view(3, 16))] == [torch.uint8, torch.uint8]
    assert gpu._widest(flat[:60].view(5, 12))[0].dtype == torch.int32  # 12-byte rows
    assert gpu._widest(flat[:30].as_strided((3, 8), (10, 1)))[0].dtype == torch.int16  # rows 10 bytes apart
    odd = torch.frombuffer(bytearray(80), dtype=torch.uint8, offset=1)  # a storage at an odd address
    skip = -odd.data_ptr() % 8  # an 8-byte aligned address, an odd offset in the storage
    assert gpu._widest(odd[skip : skip + 48].view(3, 16))[0].dtype == torch.uint8


async def test_buffers_aligned_but_at_an_odd_offset_in_their_storage_move_bit_exact() -> None:
    """Regression (adversarial review): a buffer of a storage that starts at an odd address
    (``torch.frombuffer`` at an offset) passed the alignment test on its address, and its
    wide view then failed: ``TierIOError`` where the bytes should have moved."""
    cache = torch.arange(8 * 64, dtype=torch.int32).view(8, 4, 16)  # 256 bytes a block
    tier = GpuTier([cache], blocks_per_chunk=1)
    slab = torch.frombuffer(bytearray(3 * 256 + 8), dtype=torch.uint8, offset=1)
    skip = -slab.data_ptr() % 8
    buffers = [slab[skip + i * 256 : skip + (i + 1) * 256] for i in range(3)]
    blocks = (5, 1, 3)  # scattered: one gather, one scatter
    ops = [TransferOp(buffer=b, blocks=(block,)) for b, block in zip(buffers, blocks, strict=True)]
    await tier.read(ops)
    for buffer, block in zip(buffers, blocks, strict=True):
        assert torch.equal(buffer, cache[block].view(torch.uint8).flatten())
    before = cache.clone()
    cache.zero_()
    await tier.write(ops)
    assert torch.equal(cache[list(blocks)], before[list(blocks)])
    await tier.close()


@st.composite
def jobs_over_buffers(draw: st.DrawFn) -> list[TransferOp]:
    """Runs of ops over views of two slabs at random equal steps (now and then one view
    out of step or unaligned), and ops over tensors of their own, with random numbers of
    blocks from random positions."""
    slabs = [torch.zeros(16 * 64, dtype=torch.uint8) for _ in range(2)]
    own = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        source, first = draw(st.integers(0, 2)), draw(st.integers(0, 1))
        blocks = tuple(range(draw(st.integers(1, 2 - first))))
        start, step = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        for i in range(draw(st.integers(1, 5))):
            if source == 2:
                buffer = own[draw(st.integers(0, 2))]
            else:
                at = (start + i * step) * 64 - draw(st.sampled_from([0, 0, 0, 0, 16, 64]))
                buffer = slabs[source][max(at, 0) :][:64]
            ops.append(TransferOp(buffer=buffer, blocks=blocks, first_block=first))
    return ops


@settings(max_examples=300, deadline=None)
@given(ops=jobs_over_buffers())
def test_ops_form_a_stretch_exactly_when_alike_and_at_equal_steps_in_one_storage(ops: list[TransferOp]) -> None:
    """Randomized, against the rule itself: an op joins the stretch before it when it has as
    many blocks from the same position, its buffer lies in the same storage, and its step
    from the stretch's first buffer is the stretch's step times its size (any step of at
    least a chunk, for a stretch of one)."""
    expected: list[list[TransferOp]] = []
    for op in ops:
        if expected:
            first, m = expected[-1][0], len(expected[-1])
            step = op.buffer.storage_offset() - first.buffer.storage_offset()
            stride = (expected[-1][1].buffer.storage_offset() - first.buffer.storage_offset()) if m > 1 else 0
            if (
                (len(op.blocks), op.first_block) == (len(first.blocks), first.first_block)
                and op.buffer.untyped_storage().data_ptr() == first.buffer.untyped_storage().data_ptr()
                and (step == m * stride if m > 1 else step >= 64)
            ):
                expected[-1].append(op)
                continue
        expected.append([op])
    stretches = _stretches(ops, 64)
    assert [(s.first, s.size) for s in stretches] == [(group[0], len(group)) for group in expected]
    for stretch, group in zip(stretches, expected, strict=True):
        assert stretch.blocks == [block for op in group for block in op.blocks]
        if len(group) > 1:
            assert stretch.stride == group[1].buffer.storage_offset() - group[0].buffer.storage_offset()


async def test_a_buffer_given_other_memory_is_not_taken_for_a_view_of_its_old_base() -> None:
    """A view given other memory (``set_``) keeps its base tensor: ops are one stretch only
    if their buffers lie in one storage, whatever base they were cut from."""
    cache = torch.arange(8 * 64, dtype=torch.uint8).reshape(8, 64)
    tier = GpuTier([cache], blocks_per_chunk=1)
    # The other memory above the slab: a step of at least a chunk, as a stretch asks.
    slab, other = sorted((torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(2)), key=torch.Tensor.data_ptr)
    moved = slab[64:128]
    moved.set_(other.untyped_storage(), 0, (64,), (1,))
    ops = [TransferOp(buffer=slab[0:64], blocks=(1,)), TransferOp(buffer=moved, blocks=(2,))]
    assert [s.size for s in _stretches(ops, tier.chunk_bytes)] == [1, 1]
    await tier.read(ops)
    assert torch.equal(ops[0].buffer, cache[1]) and torch.equal(other[:64], cache[2])
    await tier.close()
