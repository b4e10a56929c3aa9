"""Producer side of sparse refits: the committed baseline, sharding, bucketed encoding."""

from refit_zmq.tracker.delta_tracker import DeltaCompressionTracker, TrackerConfig
from refit_zmq.tracker.plan import ItemSpan, plan_items, shard_items

__all__ = ["DeltaCompressionTracker", "ItemSpan", "TrackerConfig", "plan_items", "shard_items"]
