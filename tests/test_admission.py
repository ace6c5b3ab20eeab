"""The seen-k admission filter: store a chunk only once it has been seen k times."""

from __future__ import annotations

import pytest
from tiered_kv.policies import SeenK

from tiered_kv.errors import PolicyError
from tiered_kv.interfaces import AdmissionFilter
from tiered_kv.policy_factory import make_admission_filter
from tiered_kv.registry import ADMISSION_FILTERS
from tiered_kv.testing import chunk_key


def test_a_key_is_admitted_on_its_kth_sighting_and_not_before() -> None:
    admission = SeenK(16, k=3)
    assert [admission.admit(chunk_key(1)) for _ in range(3)] == [False, False, True]


def test_sightings_of_other_keys_do_not_count() -> None:
    admission = SeenK(16, k=2)
    assert not admission.admit(chunk_key(1))
    assert not admission.admit(chunk_key(2))
    assert admission.admit(chunk_key(1))


def test_an_admitted_key_must_be_seen_k_times_again() -> None:
    admission = SeenK(16, k=2)
    admission.admit(chunk_key(1))
    assert admission.admit(chunk_key(1))
    assert len(admission) == 0
    assert not admission.admit(chunk_key(1))


def test_the_table_forgets_the_key_seen_longest_ago() -> None:
    admission = SeenK(3, k=2)
    for i in range(10):
        admission.admit(chunk_key(i))
    assert len(admission) == 3
    assert not admission.admit(chunk_key(0))  # forgotten: a first sighting again
    assert admission.admit(chunk_key(9))  # remembered


def test_k_of_one_admits_everything_and_counts_nothing() -> None:
    admission = SeenK(3, k=1)
    assert all(admission.admit(chunk_key(i)) for i in range(10))
    assert len(admission) == 0


@pytest.mark.parametrize(("capacity", "k"), [(0, 2), (4, 0), (4, -1)])
def test_a_bad_table_size_or_k_is_an_error(capacity: int, k: int) -> None:
    with pytest.raises(PolicyError):
        SeenK(capacity, k=k)


def test_it_is_registered_and_speaks_the_protocol() -> None:
    assert ADMISSION_FILTERS.names() == ["seen_k"]
    admission = make_admission_filter("seen_k", 8, k=4)
    assert isinstance(admission, SeenK) and isinstance(admission, AdmissionFilter)
    assert admission.k == 4 and admission.capacity == 8
