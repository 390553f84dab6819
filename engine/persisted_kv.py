"""PersistedKVCache: the engine's cached KV blocks saved to ``kv_cache_dir`` and loaded back at start-up.

It joins three owners: ``BlockOrigins`` (``engine.core.kv_persistence``) picks the KV cache manager's
blocks to save and registers restored ones, the model runner moves their K/V in and out of its tensors
(every rank's under tensor or pipeline parallelism: ``engine.distributed.runner``), and ``KVBlockStore``
(the same module) owns the files and their checks. The engine calls it between
steps only, so no step runs while blocks are read or written.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import TYPE_CHECKING

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_persistence import ANOTHER_FORMAT, BlockOrigins, KVBlockStore
from engine.errors import KVTransferFailed, ParameterError

if TYPE_CHECKING:
    from engine.worker.model_runner import ModelRunner

# NOTE: the whole KV cache (pool, manager, persistence) logs under one documented logger name.
logger = logging.getLogger("engine.core.kv_cache_manager")

_BATCH = 64  # blocks moved into the KV tensors at a time on load
_NOT_ON_EVERY_RANK = "not taken by every rank"  # a rank failed to write a batch: it and the blocks after it
# skips that are no damage: logged at INFO
_BENIGN = ("another layout", ANOTHER_FORMAT, "cached already", "no room in the KV cache")


class PersistedKVCache:
    """Loads a directory's matching blocks into the KV cache, and saves pinned and hot blocks to it.

    Args:
        directory: ``EngineConfig.kv_cache_dir``; created if missing.
        kv: the engine's KV cache manager (its origins are tracked from now on).
        runner: owns the KV tensors.
        num_hot: blocks saved besides pinned prefixes (``kv_cache_save_hot_blocks``).
        interval_s: seconds between saves by ``save_if_due``; None = none.

    Raises:
        ParameterError: ``directory`` cannot be created or written (``param`` is ``kv_cache_dir``).
    """

    def __init__(
        self, directory: str | os.PathLike[str], kv: KVCacheManager, runner: ModelRunner, num_hot: int,
        interval_s: float | None,
    ) -> None:  # fmt: skip
        try:
            self.store = KVBlockStore(directory, runner.kv_layout())
        except OSError as exc:
            message = f"kv_cache_dir {str(directory)!r} is not a writable directory: {exc}"
            raise ParameterError("kv_cache_dir", message) from None
        self.kv = kv
        self.origins = BlockOrigins(kv)
        self.runner = runner
        self.num_hot = num_hot
        self.interval_s = interval_s
        self._next_save = time.monotonic() + interval_s if interval_s is not None else None

    def load(self) -> int:
        """Restores the directory's valid blocks as cached (evictable) blocks; logs one line.

        Call before any request: restored blocks take free blocks only.

        Returns:
            The blocks restored.
        """
        start = time.perf_counter()
        blocks, skipped = self.store.load(self.kv.block_pool.num_free_blocks)
        block_ids: list[int] = []
        payloads: list[memoryview] = []
        num_loaded = 0
        for block in blocks:
            block_id = self.origins.restore_cached_block(block.block_hash, block.origin)
            if block_id is None:
                skipped["cached already"] += 1
                continue
            block_ids.append(block_id)
            payloads.append(block.payload)
            if len(block_ids) == _BATCH:
                if not self._write(block_ids, payloads, skipped):
                    skipped[_NOT_ON_EVERY_RANK] += sum(1 for _ in blocks)
                    break
                num_loaded += len(block_ids)
                block_ids, payloads = [], []
        else:
            if self._write(block_ids, payloads, skipped):
                num_loaded += len(block_ids)
        _log_load(str(self.store.dir), num_loaded, skipped, time.perf_counter() - start)
        return num_loaded

    def _write(self, block_ids: list[int], payloads: list[memoryview], skipped: Counter[str]) -> bool:
        """Writes restored blocks' K/V into the runner's cache (every rank's, under TP/PP); a block some rank did
        not take is evicted again, so that no prefix is served from part of its K/V. Returns whether all went in."""
        try:
            self.runner.write_kv_blocks(block_ids, payloads)
        except KVTransferFailed as exc:
            logger.warning("kv_cache_dir: %d restored blocks dropped: %s", len(block_ids), exc)
            self.kv.evict_restored_blocks(block_ids)
            skipped[_NOT_ON_EVERY_RANK] += len(block_ids)
            return False
        return True

    def save(self, pinned_req_ids: list[str]) -> int:
        """Makes the directory hold the pinned prefixes' cached blocks and the ``num_hot`` hottest others.

        Returns:
            The block files written (those already on disk are kept as they are).
        """
        start = time.perf_counter()
        blocks = self.origins.persistable_blocks(pinned_req_ids, self.num_hot)
        num_written = self.store.save(blocks, self.runner.read_kv_blocks)
        if self.interval_s is not None:
            self._next_save = time.monotonic() + self.interval_s
        logger.debug(
            "kv_cache_dir: %d blocks kept, %d written in %.3f s", len(blocks), num_written, time.perf_counter() - start
        )
        return num_written

    def save_if_due(self, pinned_req_ids: list[str]) -> None:
        """Saves when ``interval_s`` has passed since the last save; a failed save is logged, not raised."""
        if self._next_save is None or time.monotonic() < self._next_save:
            return
        try:
            self.save(pinned_req_ids)
        except Exception:  # noqa: BLE001 - a save that fails must not fail the step that follows
            logger.exception("kv_cache_dir: saving the KV cache failed; retrying in %.0f s", self.interval_s)
            self._next_save = time.monotonic() + (self.interval_s or 0.0)


def _log_load(directory: str, num_loaded: int, skipped: Counter[str], seconds: float) -> None:
    skipped = +skipped  # NOTE: only the reasons that occurred
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(skipped.items()))
    corrupt = sum(n for why, n in skipped.items() if why not in _BENIGN)
    level = logging.WARNING if corrupt else logging.INFO
    logger.log(
        level, "kv_cache_dir %s: loaded %d blocks in %.2f s, skipped %d%s",
        directory, num_loaded, seconds, skipped.total(), f" ({reasons})" if reasons else "",
    )  # fmt: skip
