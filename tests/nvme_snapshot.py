"""What a crash of a process holding an nvme store leaves on disk, for tests: a copy of
the store's files taken while it is open (page cache included, the lock left out)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tiered_kv.tiers.nvme import NvmeTier


def crash_copy(tier: NvmeTier, root: Path) -> Path:
    """Copy ``tier``'s store into ``root`` (same directory name); the copy's directory.

    Journals are copied before checkpoints: compaction renames a new checkpoint into
    place before the new journal, so a copy racing a compaction still reads a pair a
    crash could leave (a journal no newer than its checkpoint).
    """
    target = root / tier.directory.name
    target.mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    names = sorted(path.name for path in tier.directory.iterdir() if not path.name.endswith(".lock"))
    for name in sorted(names, key=lambda name: (not name.endswith(".journal"), name)):
        shutil.copyfile(tier.directory / name, target / name)
        (target / name).chmod(0o600)
    return target
