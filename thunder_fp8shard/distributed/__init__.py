"""Stages 2 and 4, the ranks: the distributed setups the pass recognizes, the shard group the shards travel on, and
the agreement that makes every rank plan, and check that it planned, the same collectives."""
