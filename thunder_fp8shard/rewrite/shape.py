"""Every rewrite in one shape: pure functions that :func:`~thunder_fp8shard.pipeline.compile_plan` runs over
``pipeline.REWRITES`` (or the rewrites given in ``Seams.rewrites``, one's own among them) in order, one phase at a time
(all sites, then the memory model from all effects, then the decisions, then the rewrites of the traces). A rewrite
gives only those it has; one that changes the program itself gives a ``variant``, which the pipeline plans too and keeps
where the rewrite's ``keep`` says."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from thunder.core.trace import TraceCtx

from thunder_fp8shard.analysis.program import ProgramFacts
from thunder_fp8shard.options import ShardOptions
from thunder_fp8shard.plan import Compaction, ShardPlan
from thunder_fp8shard.planning.planner import Analysis, Choice
from thunder_fp8shard.rewrite.traces import ForwardRewrite


@dataclass(frozen=True)
class Program:
    """One program as the rewrites see it: its facts and setup, then the sites found so far, then the analysis as the
    ranks agreed it, the planner's inputs and its one choice among every rewrite's items (``choice``)."""

    facts: ProgramFacts
    options: ShardOptions
    setup: Any = None  # an Integration; None: compaction alone
    shard_ranks: tuple[int, ...] = ()
    k: int = 1
    group: Any = None  # the shard group's
    name: str = "ShardIntermediates"
    together: bool = True  # False: a program the ranks did not compile together (no rewrite may add a collective)
    variant: str = ""  # the rewrite whose variant of the program this is ("": the program as Thunder made it)
    sites: Mapping[str, Any] = field(default_factory=dict)  # by rewrite name
    analysis: Analysis | None = None
    agreed: tuple = ()
    choice: Choice | None = None

    def found(self, name: str, sites) -> Program:
        return replace(self, sites={**self.sites, name: sites})


@dataclass(frozen=True)
class Effect:
    """What the rewrites' sites put into the memory model."""

    candidates: tuple = ()
    sources: Mapping[str, str] = field(default_factory=dict)  # candidate -> the forward input that is its shard
    # the forward rewrite's resize items, by key: the bytes moved they change, the new bytes of the proxies they resize
    resized: Mapping[str, tuple[int, Mapping[str, int]]] = field(default_factory=dict)
    compactions: tuple[Compaction, ...] = ()
    defaults: frozenset[str] | None = None  # candidates="all": the candidates the default ("auto") would consider


@dataclass(frozen=True)
class Rewritten:
    """The traces as far as the rewrites have gone (``forward`` None before the shard rewrite)."""

    forward: ForwardRewrite | None
    backward: TraceCtx


class Rewrite(NamedTuple):
    name: str
    sites: Callable[[Program], Any] | None = None  # where it applies, from the facts (and the sites found before it)
    effect: Callable[[Program, Effect], Effect] | None = None  # its sites' effect on the memory model
    # the plan's fields it decides (its ``notes`` follow those before it), and the warnings to give
    decide: Callable[[Program], tuple[Mapping[str, Any], tuple[str, ...]]] | None = None
    apply: Callable[[Program, ShardPlan, Rewritten], Rewritten] | None = None
    # another program (forward, backward) to plan as well, None where there is none or the option is off
    variant: Callable[[Program], tuple[TraceCtx, TraceCtx] | None] | None = None
    # (the program, its variant, their plans): the note with which the variant's plan is kept (None: the program's)
    keep: Callable[[Program, tuple[TraceCtx, TraceCtx], ShardPlan, ShardPlan], str | None] | None = None
    # the rewritten forward's calls of its operators, and the plan's fields counted from it
    count: Callable[[Program, TraceCtx], tuple[Mapping[str, int], Mapping[str, Any]]] | None = None
