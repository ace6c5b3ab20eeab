from __future__ import annotations

import pytest
import structlog

from tiered_kv import AttentionKind, KVGeometry, KVGroup, Namespace
from tiered_kv.log import reset_loggers


def make_namespace(**overrides: object) -> Namespace:
    """A small full-attention namespace: 4-token blocks, 16-token chunks."""
    fields: dict[str, object] = {
        "model_id": "acme/tiny",
        "model_revision": "r1",
        "geometry": KVGeometry(
            dtype="float16",
            block_size=4,
            chunk_size=16,
            groups=(KVGroup(num_layers=2, num_kv_heads=2, head_dim=8),),
        ),
    }
    fields.update(overrides)
    return Namespace(**fields)  # type: ignore[arg-type]


def mla_geometry() -> KVGeometry:
    return KVGeometry(
        dtype="bfloat16",
        block_size=4,
        chunk_size=16,
        groups=(KVGroup(kind=AttentionKind.MLA, num_layers=2, num_kv_heads=1, head_dim=16),),
    )


@pytest.fixture
def namespace() -> Namespace:
    return make_namespace()


@pytest.fixture(autouse=True)
def _restore_structlog_defaults():
    """The CLI configures structlog globally; each test starts from the defaults, and the
    library's loggers bind again to whatever the next test configures."""
    yield
    structlog.reset_defaults()
    reset_loggers()
