"""KV caches that can always be cut back: one sequence's (kv: a rollback cache and the forward that reads and extends
it, the check that refuses a model whose cache holds state that cannot be cut) and a batch's (rows: each row's text
in masked columns of one padded cache, rolled back by masking, packed now and then)."""

from decode.cache.kv import UnservableModel, check_servable, crop_cache, forward, rollback_cache
from decode.cache.rows import RowCache, compaction, windowed

__all__ = ["RowCache", "UnservableModel", "check_servable", "compaction", "crop_cache", "forward", "rollback_cache",
           "windowed"]
