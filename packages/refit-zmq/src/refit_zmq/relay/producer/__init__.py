"""The producer side (a trainer rank): one payload to one relay, one shard's stream, and the
rank's tracker driven by the coordinator."""
