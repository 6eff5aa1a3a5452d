"""Shard replicated FP8 saved-for-backward tensors under Thunder FSDP or DDP, or PyTorch FSDP2 under
ThunderFX, and all-gather them in backward."""

from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import Compaction, Decision, ShardPlan
from thunder_fp8shard.transform import CompactSavedViews, ShardIntermediates

__all__ = ["Compaction", "CompactSavedViews", "Decision", "ShardIntermediates", "ShardOptions", "ShardPlan"]
