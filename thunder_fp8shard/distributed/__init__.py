"""Stages 2 and 4, the ranks: the distributed setups the pass recognizes, the shard group, and the agreement that makes
every rank plan, and check it planned, the same collectives."""
