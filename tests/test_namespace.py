"""Namespaces: fingerprints separate every byte-deciding field and stay stable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import make_namespace, mla_geometry
from hypothesis import given
from hypothesis import strategies as st

from tiered_kv import AttentionKind, GeometryError, KVGeometry, KVGroup, NamespaceError

BASE_GEOMETRY = make_namespace().geometry

VARIANTS = {
    "model_id": {"model_id": "acme/tiny2"},
    "model_revision": {"model_revision": "r2"},
    "dtype": {"geometry": KVGeometry(dtype="bfloat16", block_size=4, chunk_size=16, groups=BASE_GEOMETRY.groups)},
    "kv_layout": {
        "geometry": KVGeometry(
            dtype="float16", block_size=4, chunk_size=16, groups=BASE_GEOMETRY.groups, kv_layout="HND"
        )
    },
    "block_size": {"geometry": KVGeometry(dtype="float16", block_size=8, chunk_size=16, groups=BASE_GEOMETRY.groups)},
    "chunk_size": {"geometry": KVGeometry(dtype="float16", block_size=4, chunk_size=32, groups=BASE_GEOMETRY.groups)},
    "layers": {
        "geometry": KVGeometry(
            dtype="float16", block_size=4, chunk_size=16, groups=(KVGroup(num_layers=3, num_kv_heads=2, head_dim=8),)
        )
    },
    "attention_kind": {
        "geometry": KVGeometry(
            dtype="float16",
            block_size=4,
            chunk_size=16,
            groups=(KVGroup(kind=AttentionKind.SLIDING_WINDOW, window=64, num_layers=2, num_kv_heads=2, head_dim=8),),
        )
    },
    "window": {
        "geometry": KVGeometry(
            dtype="float16",
            block_size=4,
            chunk_size=16,
            groups=(KVGroup(kind=AttentionKind.SLIDING_WINDOW, window=65, num_layers=2, num_kv_heads=2, head_dim=8),),
        )
    },
    "runner_layout_version": {"runner_layout_version": 2},
    "tp_size": {"tp_size": 2},
    "tp_rank": {"tp_size": 2, "tp_rank": 1},
    "lora_id": {"lora_id": "X"},
    "cache_salt": {"cache_salt": "X"},
    "empty_salt": {"cache_salt": ""},
}


def test_every_byte_deciding_field_changes_the_fingerprint() -> None:
    fingerprints = {"base": make_namespace().fingerprint}
    for name, overrides in VARIANTS.items():
        fingerprints[name] = make_namespace(**overrides).fingerprint
    assert len(set(fingerprints.values())) == len(fingerprints), fingerprints


def test_lora_named_x_and_salt_x_do_not_collide() -> None:
    assert make_namespace(lora_id="X").fingerprint != make_namespace(cache_salt="X").fingerprint
    # Moving characters between adjacent string fields must not collide either.
    assert (
        make_namespace(model_id="ab", model_revision="c").fingerprint
        != make_namespace(model_id="a", model_revision="bc").fingerprint
    )


def test_equal_namespaces_share_a_fingerprint() -> None:
    assert make_namespace().fingerprint == make_namespace().fingerprint
    assert len(make_namespace().fingerprint) == 32


def test_replicated_layout_leaves_the_rank_out() -> None:
    ranks = [make_namespace(geometry=mla_geometry(), tp_size=4, tp_rank=r) for r in range(4)]
    assert len({ns.fingerprint for ns in ranks}) == 1
    sharded = [make_namespace(tp_size=4, tp_rank=r) for r in range(4)]
    assert len({ns.fingerprint for ns in sharded}) == 4


# Pinned value of spec v1 (docs/keys.md): any change here breaks every cache on disk.
BASE_FINGERPRINT = "89e9b8d18c0761b684bdc9a67e2cb98adb763adff4c1d132b396442cb9a016d1"


def test_fingerprint_is_pinned_by_spec_v1() -> None:
    assert make_namespace().fingerprint_hex == BASE_FINGERPRINT


def test_fingerprint_is_stable_across_processes_and_hash_seeds() -> None:
    code = "from conftest import make_namespace; print(make_namespace(lora_id='l', cache_salt='s').fingerprint_hex)"
    tests_dir = os.path.dirname(__file__)
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=tests_dir,
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert outputs == {make_namespace(lora_id="l", cache_salt="s").fingerprint_hex}


@pytest.mark.parametrize(
    "model_id", ["../../etc", "/abs/path", "a/b\\c", "ünïcödé/模型", "x" * 1000, ".", "..", "-rf", "a\0b"]
)
def test_dir_name_is_safe_for_any_model_id(model_id: str) -> None:
    name = make_namespace(model_id=model_id).dir_name
    assert "/" not in name and "\\" not in name and "\0" not in name
    assert name not in (".", "..") and not name.startswith((".", "-"))
    assert name.isascii() and len(name) <= 100
    assert name.endswith(make_namespace(model_id=model_id).fingerprint_hex[:32])


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model_id": ""}, "model_id"),
        ({"model_revision": ""}, "model_revision"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"runner_layout_version": 0}, "runner_layout_version"),
    ],
)
def test_bad_namespace_is_a_typed_error_naming_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(NamespaceError) as caught:
        make_namespace(**overrides)
    assert caught.value.field == field


def test_namespace_is_frozen() -> None:
    ns = make_namespace()
    with pytest.raises(AttributeError):
        ns.model_id = "other"  # type: ignore[misc]
    assert ns.model_id == "acme/tiny"


def test_base_drops_only_the_tenant_fields() -> None:
    tenant = make_namespace(lora_id="adapter", cache_salt="salt")
    assert tenant.base == make_namespace()
    assert tenant.base.fingerprint != tenant.fingerprint
    plain = make_namespace()
    assert plain.base is plain


WRONG_TYPES = st.sampled_from([5, 0.0, 1.5, b"bytes", None, True, ["list"], {"a": 1}, ""])
NOT_INTS = [0.0, 1.0, 1.5, "1", b"1", None, True, [1]]
NOT_STRINGS = [5, 0.0, b"bytes", True, ["list"], {"a": 1}]
WRONG_VALUES = {
    "model_id": [*NOT_STRINGS, None, ""],
    "model_revision": [*NOT_STRINGS, None, ""],
    "lora_id": NOT_STRINGS,
    "cache_salt": NOT_STRINGS,
    "tp_rank": [*NOT_INTS, -1],
    "tp_size": [*NOT_INTS, 0],
    "runner_layout_version": [*NOT_INTS, 0],
    "geometry": [None, "geometry", 5, {"dtype": "float16"}],
}


@given(st.sampled_from(sorted(WRONG_VALUES)).flatmap(lambda f: st.tuples(st.just(f), st.sampled_from(WRONG_VALUES[f]))))
def test_a_field_of_the_wrong_type_is_refused_at_construction(case: tuple[str, object]) -> None:
    # Regression (issue 9.6): Namespace(model_revision=5) used to work once, then the store
    # was refused on restart as CorruptStore; model_id=123 or tp_rank=0.0 failed only at
    # register.
    field, value = case
    with pytest.raises(NamespaceError):
        make_namespace(**{field: value})


@given(dtype=WRONG_TYPES, layout=st.sampled_from([5, None, ""]))
def test_geometry_fields_of_the_wrong_type_are_a_geometry_error(dtype: object, layout: object) -> None:
    with pytest.raises(GeometryError):
        KVGeometry(dtype=dtype, block_size=4, chunk_size=16, groups=BASE_GEOMETRY.groups)  # type: ignore[arg-type]
    with pytest.raises(GeometryError):
        KVGeometry(dtype="float16", block_size=4, chunk_size=16, groups=BASE_GEOMETRY.groups, kv_layout=layout)  # type: ignore[arg-type]
    with pytest.raises(GeometryError):
        KVGeometry(dtype="float16", block_size=4, chunk_size=16, groups=list(BASE_GEOMETRY.groups))  # type: ignore[arg-type]


def test_base_and_fingerprints_are_derived_once() -> None:
    tenant = make_namespace(lora_id="a")
    assert tenant.base is tenant.base
    assert tenant.fingerprint_hex is tenant.fingerprint_hex
    assert tenant.base == make_namespace()
