"""The C key tables against ``OrderedDict``, the model they replace: every operation,
through many incremental growths, with the references they hold counted."""

from __future__ import annotations

import gc
import sys
import threading
import time
import tracemalloc
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tiered_kv._keytable import KeyInts, KeyOrder

KEYS = st.binary(min_size=0, max_size=3)


class TableMachine(RuleBasedStateMachine):
    """Random operations on a KeyOrder and a KeyInts beside two OrderedDicts."""

    def __init__(self) -> None:
        super().__init__()
        self.order, self.order_model = KeyOrder(), OrderedDict[bytes, bytes | None]()
        self.ints, self.ints_model = KeyInts(), OrderedDict[bytes, int]()
        self.dying = 0  # entries a clear_in_steps took out and has not let go of yet

    @rule(key=KEYS, value=st.one_of(st.none(), KEYS), number=st.integers(-(2**63), 2**63 - 1))
    def set(self, key: bytes, value: bytes | None, number: int) -> None:
        self.order[key] = value
        self.order_model[key] = value
        self.ints[key] = number
        self.ints_model[key] = number

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        for table, model in ((self.order, self.order_model), (self.ints, self.ints_model)):
            if key in model:
                del table[key]
                del model[key]
            else:
                with pytest.raises(KeyError):
                    del table[key]

    @rule(key=KEYS)
    def pop(self, key: bytes) -> None:
        for table, model in ((self.order, self.order_model), (self.ints, self.ints_model)):
            assert table.pop(key, "absent") == model.pop(key, "absent")  # type: ignore[call-overload]

    @rule(last=st.booleans())
    def popitem(self, last: bool) -> None:
        for table, model in ((self.order, self.order_model), (self.ints, self.ints_model)):
            if model:
                assert table.popitem(last=last) == model.popitem(last=last)  # type: ignore[attr-defined]
            else:
                with pytest.raises(KeyError):
                    table.popitem(last)

    @rule(key=KEYS, last=st.booleans())
    def move_to_end(self, key: bytes, last: bool) -> None:
        for table, model in ((self.order, self.order_model), (self.ints, self.ints_model)):
            if key in model:
                table.move_to_end(key, last=last)
                model.move_to_end(key, last=last)  # type: ignore[attr-defined]
            else:
                with pytest.raises(KeyError):
                    table.move_to_end(key, last)

    @rule(keys=st.lists(KEYS, max_size=6), value=st.one_of(st.none(), KEYS))
    def insert_new(self, keys: list[bytes], value: bytes | None) -> None:
        clash = next((k for i, k in enumerate(keys) if k in self.order_model or k in keys[:i]), None)
        if clash is None:
            self.order.insert_new(keys, value)
            self.order_model.update((k, value) for k in keys)
            self.ints.insert_new(keys, 7)
            self.ints_model.update((k, 7) for k in keys)
            return
        with pytest.raises(KeyError) as error:
            self.order.insert_new(keys, value)
        assert error.value.args == (clash,)

    @rule(keys=st.lists(KEYS, max_size=40), batch=st.booleans())
    def grow(self, keys: list[bytes], batch: bool) -> None:
        """Many fresh keys at once, so that the tables grow (and move buckets) often; in
        one batch (probed ahead, see set_many) or one by one."""
        fresh = [b"g" + k + bytes([i]) for i, k in enumerate(keys)]
        if batch:
            self.ints.set_many(fresh, [len(k) for k in fresh])
            self.order.set_many(fresh, fresh)
        else:
            self.ints.update((k, len(k)) for k in fresh)
            for k in fresh:
                self.order[k] = k
        self.ints_model.update((k, len(k)) for k in fresh)
        self.order_model.update((k, k) for k in fresh)

    @rule(
        keys=st.lists(KEYS, max_size=40),
        value=st.one_of(st.none(), KEYS),
        bad_at=st.one_of(st.none(), st.integers(0, 40)),
        short=st.booleans(),
    )
    def set_many(self, keys: list[bytes], value: bytes | None, bad_at: int | None, short: bool) -> None:
        """Keys listed twice or present (set again, in place), a key that is not bytes (the
        pairs before it set, as update does), or one value too few (nothing set)."""
        if bad_at is not None:
            keys = [*keys[:bad_at], "not bytes", *keys[bad_at:]]  # type: ignore[list-item]
        values = list(range(len(keys) - short))
        if short and keys:
            with pytest.raises(ValueError, match="a value per key"):
                self.ints.set_many(keys, values)
            with pytest.raises(ValueError, match="a value per key"):
                self.order.set_many(keys, [value] * len(values))
            return
        good = keys if bad_at is None else keys[: keys.index("not bytes")]  # type: ignore[arg-type]
        if len(good) < len(keys):
            with pytest.raises(TypeError):
                self.ints.set_many(keys, values)
            with pytest.raises(TypeError):
                self.order.set_many(keys, [value] * len(keys))
        else:
            self.ints.set_many(keys, values)
            self.order.set_many(keys, [value] * len(keys))
        self.ints_model.update(zip(good, values, strict=False))
        self.order_model.update((k, value) for k in good)

    @rule(n=st.integers(-1, 300))
    def reserve(self, n: int) -> None:
        """A hint that changes no content: the tables then fill (and grow) from it."""
        self.order.reserve(n)
        self.ints.reserve(n)

    @rule()
    def clear(self) -> None:
        for table, model in ((self.order, self.order_model), (self.ints, self.ints_model)):
            table.clear()
            model.clear()
        self.dying = 0

    @rule(n=st.integers(1, 30))
    def clear_in_steps(self, n: int) -> None:
        """A step of a clear: one that is not letting go of an earlier clear's entries
        empties the table; each lets go of at most n; true while any are left, taken out
        or not."""
        assert len(self.order_model) == len(self.ints_model)
        if not self.dying:
            self.dying = len(self.order_model)
            self.order_model.clear()
            self.ints_model.clear()
        self.dying = max(0, self.dying - n)
        more = self.dying > 0 or len(self.order_model) > 0
        assert self.order.clear_in_steps(n) is self.ints.clear_in_steps(n) is more

    @rule(keys=st.lists(st.one_of(KEYS, st.just("not bytes")), max_size=40))
    def contains_any(self, keys: list[bytes]) -> None:
        """Batches longer than the probes run ahead, with keys absent, present and not
        bytes (never present) anywhere in them."""
        for table, model in ((self.order, self.order_model), (self.ints, self.ints_model)):
            assert table.contains_any(keys) is any(k in model for k in keys)

    @invariant()
    def same_as_the_model(self) -> None:
        for table, model in ((self.order, self.order_model), (self.ints, self.ints_model)):
            assert len(table) == len(model)
            assert list(table) == list(model)
            assert list(reversed(table)) == list(reversed(model))
            assert list(table.items()) == list(model.items())
            assert list(table.values()) == list(model.values())
            for key in list(model)[:5]:
                assert key in table and table[key] == model[key] and table.get(key) == model[key]
            assert table.get(b"never a key " * 3) is None


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


@pytest.mark.parametrize("table_type", [KeyOrder, KeyInts])
def test_a_million_keys_through_growth_and_churn_stay_findable_in_order(table_type: type) -> None:
    table = table_type()
    value = (lambda i: i) if table_type is KeyInts else (lambda i: i.to_bytes(4, "little"))
    keys = [i.to_bytes(8, "little") for i in range(300_000)]
    for i, key in enumerate(keys):
        table[key] = value(i)
        if i % 3 == 2:  # churn while buckets move: drop an older key
            del table[keys[i // 2]]
    gone = {keys[i // 2] for i in range(2, len(keys), 3)}
    alive = [k for k in keys if k not in gone]
    assert len(table) == len(alive)
    assert list(table) == alive
    assert all(table[k] == value(i) for i, k in enumerate(keys) if k not in gone)
    assert not any(k in table for k in gone)


@pytest.mark.parametrize("table_type", [KeyOrder, KeyInts])
def test_a_reserved_table_fills_without_growing_its_buckets(table_type: type) -> None:
    value = None if table_type is KeyOrder else 0
    keys = [i.to_bytes(4, "little") for i in range(4097)]
    reserved, grown = table_type(), table_type()
    reserved.reserve(5000)
    for table in (reserved, grown):
        table.insert_new(keys, value)
    # The grown table has just doubled its 4,096 buckets and holds the old array while
    # it moves them; the reserved one was sized once. Same entries in both.
    assert sys.getsizeof(grown) - sys.getsizeof(reserved) == 4096 * 4
    assert list(reserved) == list(grown) == keys
    reserved.reserve(10**6)  # a table holding entries: no effect
    assert list(reserved) == keys and sys.getsizeof(grown) - sys.getsizeof(reserved) == 4096 * 4


@pytest.mark.parametrize("table_type", [KeyOrder, KeyInts])
def test_batches_set_and_inserted_with_their_probes_ahead_stay_findable_through_growth(table_type: type) -> None:
    """Batches far longer than the probes run ahead, into tables through their growths,
    keys listed again in later batches: each ends as a dict of the same pairs does."""
    value = (lambda i: i) if table_type is KeyInts else (lambda i: i.to_bytes(4, "little"))
    keys = [i.to_bytes(8, "little") for i in range(200_000)]
    by_set, by_insert, model = table_type(), table_type(), {}
    for at in range(0, len(keys), 5000):
        batch = keys[at : at + 5000]
        again = keys[at // 2 : at // 2 + 300]  # set again, in place, with other values
        by_set.set_many(batch + again, [value(i) for i in range(len(batch) + len(again))])
        model.update(zip(batch + again, [value(i) for i in range(len(batch) + len(again))], strict=True))
        by_insert.insert_new(batch, value(at))
    assert by_set == model and list(by_set) == keys
    assert list(by_insert) == keys and all(by_insert[k] == value(i // 5000 * 5000) for i, k in enumerate(keys))


def test_set_many_takes_a_sequence_of_keys_and_one_value_each() -> None:
    table = KeyInts()
    with pytest.raises(TypeError, match="not one key"):
        table.set_many(b"key", [1, 2, 3])
    with pytest.raises(TypeError, match="sequence of keys"):
        table.set_many(3, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of values"):
        table.set_many([b"a"], 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 values for 1 keys"):
        table.set_many([b"a"], [1, 2])
    with pytest.raises(TypeError, match="integers"):
        table.set_many([b"a", b"b"], [1, "2"])  # type: ignore[list-item]
    assert list(table.items()) == [(b"a", 1)]  # as update: the pairs before the bad one set
    table.set_many((k for k in [b"c", b"d"]), iter([3, 4]))  # any iterables, as lists
    assert list(table.items()) == [(b"a", 1), (b"c", 3), (b"d", 4)]


def test_contains_any_takes_any_iterable_of_keys_but_not_one_key() -> None:
    table = KeyOrder()
    table.set_many([b"a", b"b"], [None, None])
    assert table.contains_any(iter([b"x", b"b"])) and not table.contains_any(()) and not table.contains_any([b"ab"])
    with pytest.raises(TypeError, match="not one key"):
        table.contains_any(b"a")
    with pytest.raises(TypeError, match="sequence of keys"):
        table.contains_any(1)  # type: ignore[arg-type]


def test_reserve_refuses_more_than_a_table_holds() -> None:
    with pytest.raises(ValueError, match="at most"):
        KeyInts().reserve(2**40)
    with pytest.raises(TypeError):
        KeyOrder().reserve("many")  # type: ignore[arg-type]


def test_insert_new_changes_nothing_when_a_key_is_present_or_repeated() -> None:
    table = KeyOrder()
    table.insert_new([b"a", b"b"], None)
    for keys, clash in (([b"c", b"d", b"a"], b"a"), ([b"c", b"d", b"c"], b"c")):
        with pytest.raises(KeyError) as error:
            table.insert_new(keys, b"p")
        assert error.value.args == (clash,)
        assert list(table.items()) == [(b"a", None), (b"b", None)]


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [("text", None, TypeError), (bytearray(b"k"), None, TypeError), (b"k", "text", TypeError), (b"k", 3, TypeError)],
)
def test_a_key_order_takes_bytes_keys_and_bytes_or_none_values(key: object, value: object, error: type) -> None:
    table = KeyOrder()
    with pytest.raises(error):
        table[key] = value  # type: ignore[index, assignment]
    assert len(table) == 0 and key not in table


def test_key_ints_take_integers_of_64_bits() -> None:
    table = KeyInts()
    table[b"k"] = -(2**63)
    assert table[b"k"] == -(2**63)
    with pytest.raises(OverflowError):
        table[b"k"] = 2**63
    with pytest.raises(TypeError):
        table[b"k"] = 1.0  # type: ignore[assignment]
    assert table[b"k"] == -(2**63)


def test_lookups_of_other_types_miss_instead_of_raising() -> None:
    table = KeyInts()
    table[b"k"] = 1
    assert "k" not in table and table.get(object(), 5) == 5 and table.pop(None, 6) == 6
    with pytest.raises(KeyError):
        table["k"]  # type: ignore[index]


@pytest.mark.parametrize("mutate", ["insert", "delete", "move", "clear"])
def test_changing_the_order_while_iterating_raises(mutate: str) -> None:
    table = KeyOrder()
    table.update((bytes([i]), None) for i in range(10))
    it = iter(table)
    next(it)
    {
        "insert": lambda: table.__setitem__(b"new", None),
        "delete": lambda: table.__delitem__(bytes([5])),
        "move": lambda: table.move_to_end(bytes([2])),
        "clear": table.clear,
    }[mutate]()
    with pytest.raises(RuntimeError):
        next(it)


def test_replacing_a_value_keeps_its_place_and_iteration_valid() -> None:
    table = KeyOrder()
    table.update([(b"a", None), (b"b", None)])
    it = table.items()
    table[b"a"] = b"x"
    assert list(it) == [(b"a", b"x"), (b"b", None)]


def test_the_tables_hold_one_reference_per_key_and_value_and_drop_them() -> None:
    key, value = b"a key of its own" + bytes(8), b"a value of its own" + bytes(8)
    before = sys.getrefcount(key), sys.getrefcount(value)
    table = KeyOrder()
    table[key] = value
    assert (sys.getrefcount(key), sys.getrefcount(value)) == (before[0] + 1, before[1] + 1)
    table.move_to_end(key, last=False)
    assert table.popitem() == (key, value)
    assert (sys.getrefcount(key), sys.getrefcount(value)) == before
    for drop in (lambda t: t.pop(key), lambda t: t.clear(), lambda t: t.__delitem__(key), lambda t: None):
        table = KeyOrder()
        table.insert_new([key], value)
        drop(table)
        del table
        gc.collect()
        assert (sys.getrefcount(key), sys.getrefcount(value)) == before


@pytest.mark.parametrize("end", ["stepped to the end", "dropped midway", "cleared midway"])
def test_a_clear_in_steps_lets_go_of_a_step_of_references_per_call_and_of_all_in_the_end(end: str) -> None:
    keys = [i.to_bytes(20, "little") for i in range(100)]
    values = [i.to_bytes(24, "little") for i in range(100)]
    before = [sys.getrefcount(k) for k in keys] + [sys.getrefcount(v) for v in values]

    def held() -> int:
        return sum(sys.getrefcount(k) for k in keys) + sum(sys.getrefcount(v) for v in values) - sum(before)

    table = KeyOrder()
    for k, v in zip(keys, values, strict=True):
        table[k] = v
    for k in keys[::3]:  # entries on the free list, which the steps pass over
        del table[k]
    del k, v
    live = len(table)
    assert table.clear_in_steps(10) is True
    assert len(table) == 0 and list(table) == [] and keys[1] not in table  # empty at once
    assert held() == 2 * (live - 10)
    table[b"new"] = None  # usable meanwhile; the steps go on with what was taken out
    if end == "stepped to the end":
        while table.clear_in_steps(10):
            pass
        assert list(table) == []  # what came in meanwhile too, taken out once the rest had gone
    elif end == "cleared midway":
        table.clear()
    del table
    gc.collect()
    assert held() == 0


def test_a_clear_in_steps_frees_each_page_of_entries_once_it_has_passed_it() -> None:
    """A million entries' pages, all freed by the last step, held the interpreter (a
    closing manager's loop) for about 3 ms: each goes once the walk has passed it."""
    keys = [i.to_bytes(16, "little") for i in range(8 * 4096 + 100)]  # 8 whole pages of entries and a part
    tracemalloc.start()
    try:
        table = KeyInts()
        table.set_many(keys, range(len(keys)))
        for key in keys[::5]:  # entries on the free list, which the walk passes over
            del table[key]
        table.clear_in_steps(1)  # the entries taken out (and the buckets freed)
        held = [0] * 64  # made before it is measured: its growth would count
        held[0] = pages = tracemalloc.get_traced_memory()[0]
        steps = 1
        while table.clear_in_steps(1024):
            held[steps] = tracemalloc.get_traced_memory()[0]
            steps += 1
        after = tracemalloc.get_traced_memory()[0]
        del held[steps:]
    finally:
        tracemalloc.stop()
    page = (pages - after) // 8  # what a whole page of entries takes
    assert held[len(held) // 2] <= pages - 3 * page  # half the walk done: most of its pages gone
    assert held[-1] - after < 3 * page  # the last step frees what is left: the last pages


@settings(max_examples=25, deadline=None)
@given(
    size=st.integers(1, 3 * 4096 + 50),
    every=st.integers(2, 9),
    steps=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
    meanwhile=st.integers(0, 3),
)
def test_a_clear_in_steps_over_many_pages_lets_go_of_every_reference_once(
    size: int, every: int, steps: list[int], meanwhile: int
) -> None:
    """Pages freed as the walk passes them, whatever the steps, the entries on the free
    list and the keys set meanwhile: each reference let go of once, none kept."""
    keys = [i.to_bytes(12, "little") for i in range(size)]
    values = [i.to_bytes(20, "little") for i in range(size)]
    before = sum(map(sys.getrefcount, keys)) + sum(map(sys.getrefcount, values))
    table = KeyOrder()
    table.set_many(keys, values)
    for key in keys[::every]:
        del table[key]
    del key
    calls = 0
    while table.clear_in_steps(steps[calls % len(steps)]):
        if calls < meanwhile:
            table[keys[calls % size]] = values[calls % size]  # set while the walk goes on
        calls += 1
    assert len(table) == 0 and list(table) == []
    assert sum(map(sys.getrefcount, keys)) + sum(map(sys.getrefcount, values)) == before


def test_a_large_reserve_touches_its_pages_without_the_gil() -> None:
    """A warm restart's first batch into a table a reserve had sized touched its pages,
    one fault at a time, on the event loop (3 ms at a million entries). The reserve, made
    in a thread, writes them once without the GIL: the loop's thread runs meanwhile. The
    interpreter never forces a switch here; the main thread can only run during the
    reserve if the reserve lets go of the GIL. What it sets in the table meanwhile stays
    (a reserve that went on to swap its buckets in lost every entry's link)."""
    table = KeyOrder()
    started, done = threading.Event(), threading.Event()
    during: list[bytes] = []

    def reserve() -> None:
        started.set()
        table.reserve(1 << 25)  # 128 MiB of buckets
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        thread = threading.Thread(target=reserve)
        thread.start()
        while not done.is_set():
            if started.is_set() and not done.is_set():
                key = len(during).to_bytes(8, "little")
                table[key] = None
                during.append(key)
            time.sleep(0)
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert during
    assert len(table) == len(during) and all(key in table for key in during)
    table[b"k"] = None
    assert list(table) == [*during, b"k"]


def test_a_clear_in_steps_takes_a_positive_step() -> None:
    for n in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            KeyInts().clear_in_steps(n)
    assert KeyInts().clear_in_steps(1) is False  # nothing to let go of


def test_the_tables_stay_out_of_the_garbage_collector() -> None:
    table = KeyOrder()
    table[b"k"] = b"v"
    assert not gc.is_tracked(table)


def test_an_entry_costs_a_third_of_an_ordered_dicts() -> None:
    keys = [i.to_bytes(16, "little") for i in range(200_000)]

    def cost(make: type) -> float:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            table = make()
            for key in keys:
                table[key] = None
            return (tracemalloc.get_traced_memory()[0] - before) / len(keys)
        finally:
            tracemalloc.stop()

    ours, theirs = cost(KeyOrder), cost(OrderedDict)
    assert ours <= 48 and ours < theirs / 1.8, (ours, theirs)


@given(st.lists(st.binary(max_size=2), max_size=50))
def test_iteration_from_either_end_matches_insertion(keys: list[bytes]) -> None:
    table = KeyInts()
    model: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        table[key] = i
        model[key] = i
    assert list(table) == list(model) and list(reversed(table)) == list(reversed(model))


def test_a_table_equals_a_dict_or_table_of_the_same_items_in_any_order() -> None:
    table, other = KeyInts(), KeyInts()
    table.update([(b"a", 1), (b"b", 2)])
    other.update([(b"b", 2), (b"a", 1)])
    assert table == {b"b": 2, b"a": 1} and table == other and (table != other) is False
    assert table != {b"a": 1} and table != {b"a": 1, b"b": 3} and table != {b"a": 1, b"c": 2}
    assert table != KeyOrder() and KeyOrder() == {} and table != [(b"a", 1), (b"b", 2)]


def test_a_comparison_whose_other_side_changes_the_table_raises_instead_of_reading_freed_entries() -> None:
    table = KeyOrder()
    table.update((bytes([i]), None) for i in range(3))

    class Clears:
        def __eq__(self, other: object) -> bool:
            table.clear()
            return True

        __hash__ = None  # type: ignore[assignment]

    with pytest.raises(RuntimeError):
        _ = table == {bytes([i]): Clears() for i in range(3)}


def test_a_lookup_on_the_other_side_that_drops_our_key_raises_instead_of_reading_it_freed() -> None:
    """Regression (found by review under valgrind): comparing with a dict whose keys'
    ``__eq__`` deletes the key being looked up read the freed key."""
    table = KeyOrder()
    for key in (bytes([97, 98]), b"x", b"y"):
        table[key] = None
    armed = False

    class Collides:
        def __hash__(self) -> int:
            return hash(b"ab")

        def __eq__(self, other: object) -> bool:
            if armed and b"ab" in table:
                del table[b"ab"]
            return False

    other = {Collides(): None, Collides(): None, Collides(): None}
    armed = True
    with pytest.raises(RuntimeError):
        _ = table == other


_testcapi = pytest.importorskip("_testcapi")


def test_out_of_memory_in_clear_or_popitem_leaves_the_table_whole() -> None:
    """Regression: ``clear`` freed the buckets before allocating new ones (a later
    insert then crashed); ``popitem`` took the entry out before building its value."""
    order, ints = KeyOrder(), KeyInts()
    order.update([(b"a", None), (b"b", b"a")])
    ints.update([(b"a", 10**12), (b"b", 10**13)])  # not small ints: reading one allocates
    for table, operation in ((order, order.clear), (ints, ints.popitem)):
        before = list(table.items())
        failed = False
        _testcapi.set_nomemory(0, 1)  # the next allocation fails: the operation's own
        try:
            operation()
        except MemoryError:
            failed = True
        finally:
            _testcapi.remove_mem_hooks()
        assert failed
        assert list(table.items()) == before
        table[b"c"] = 1 if table is ints else None  # type: ignore[index]
        assert len(table) == 3


def test_a_small_table_costs_a_few_hundred_bytes_not_a_page() -> None:
    """Many tenants each have a policy of a few keys per tier: the first page grows."""
    table = KeyInts()
    table[b"k"] = 1
    assert sys.getsizeof(table) < 1024
    table.update((i.to_bytes(4, "little"), i) for i in range(10_000))
    assert len(table) == 10_001 and all(table[i.to_bytes(4, "little")] == i for i in range(10_000))
