"""ShardIntermediates' options: the signature (ShardOptions' fields, keyword-only, with their defaults, as the README
shows them), each option reaching ShardOptions, and invalid or unknown options refused at construction with a clear
message."""

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from thunder_fp8shard import CompactSavedViews, ShardIntermediates, ShardOptions


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"candidate": "fp8"}, TypeError, r"unknown option\(s\) \['candidate'\]; the options are \['candidates'"),
        ({"candidates": "bf16"}, ValueError, r"candidates must be one of \('auto', 'fp8', 'all'\), got 'bf16'"),
        ({"method": "all_reduce"}, ValueError, r"method must be one of \('slice', 'reduce_scatter'\)"),
        ({"policy": "fastest"}, ValueError, r"policy must be one of \('all', 'peak', 'budget'\)"),
        ({"policy": "budget"}, ValueError, r"policy='budget' needs budget_bytes"),
        ({"policy": "budget", "budget_bytes": 10}, ValueError,
         r"policy='budget' needs optimizer_states \(the optimizer's state tensors per trained parameter: Adam, AdamW: 2"),
        ({"optimizer_states": "adamw"}, ValueError, r"optimizer_states must be a non-negative int, got 'adamw'"),
        ({"budget_bytes": 10}, ValueError, r"budget_bytes is only used with policy='budget'"),
        ({"min_bytes": -1}, ValueError, r"min_bytes must be a non-negative int, got -1"),
        ({"prefetch": 1.5}, ValueError, r"prefetch must be a non-negative int, got 1.5"),
        ({"verify": "yes"}, TypeError, r"verify must be a bool"),
        ({"bucket_bytes": -1}, ValueError, r"bucket_bytes must be a non-negative int, got -1"),
        ({"comm": "nccl"}, ValueError, r"comm must be one of \('shared', 'dedicated'\), got 'nccl'"),
        ({"group": "world"}, TypeError, r"group must be a torch.distributed.ProcessGroup .*got str"),
        ({"fp8_forward_gather": 1}, TypeError, r"fp8_forward_gather must be a bool, got 1"),
        ({"reschedule": 1}, TypeError, r"reschedule must be a bool, got 1"),
    ],
)
def test_invalid_options_fail_at_construction(options, error, message):
    with pytest.raises(error, match=message):
        ShardIntermediates(**options)


def test_the_signature_is_shard_options_fields_keyword_only_with_their_defaults():
    fields = dataclasses.fields(ShardOptions)
    params = list(inspect.signature(ShardIntermediates).parameters.values())
    assert [(p.name, p.kind, p.default, p.annotation) for p in params] == [
        (f.name, inspect.Parameter.KEYWORD_ONLY, f.default, f.type) for f in fields
    ]
    assert str(inspect.signature(ShardIntermediates)).startswith("(*, candidates: 'str' = 'auto', min_bytes: 'int' = 1")
    doc = ShardIntermediates.__doc__  # the options are written once: the docstring points to them
    assert "ShardOptions" in doc and "docs/options.md" in doc and not any(f"- ``{f.name}``: " in doc for f in fields)
    compact = list(inspect.signature(CompactSavedViews).parameters)
    assert compact == list(CompactSavedViews.OPTIONS) and set(compact) < {f.name for f in fields}


def test_the_readme_shows_the_signature_and_docs_options_every_option():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    options_page = (Path(__file__).parents[1] / "docs" / "options.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("`ShardIntermediates(*,"))
    args = ast.parse(f"def f{line.strip('`').removeprefix('ShardIntermediates')}: pass").body[0].args
    shown = [(a.arg, eval(compile(ast.Expression(d), "README", "eval"))) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    assert shown == [(f.name, f.default) for f in dataclasses.fields(ShardOptions)]
    assert all(f"| `{f.name}` |" in options_page for f in dataclasses.fields(ShardOptions))


def test_every_option_reaches_shard_options(single_rank_group):
    given = dict(candidates="all", min_bytes=7, compact="off", method="reduce_scatter", verify=True, policy="budget", budget_bytes=10,
                 prefetch=3, bucket_bytes=5, comm="dedicated", resident_bytes=11, optimizer_states=2, loss_bytes=13,
                 group=single_rank_group, shard_group_size=1, fp8_forward_gather=True, reschedule=False)
    assert sorted(given) == sorted(f.name for f in dataclasses.fields(ShardOptions))
    assert all(v != f.default for f in dataclasses.fields(ShardOptions) for v in [given[f.name]])
    assert ShardIntermediates(**given).options == ShardOptions(**given)
    assert ShardIntermediates().options == ShardOptions()


def test_unknown_options_and_positional_arguments_raise_type_errors():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bucket', 'candidate'\]; the options are \['candidates', "
                                        r"'min_bytes', .*'shard_group_size', 'fp8_forward_gather', 'reschedule'\]"):
        ShardIntermediates(candidate="fp8", bucket=1, prefetch=0)
    with pytest.raises(TypeError, match="positional argument"):
        ShardIntermediates("fp8")


def test_the_defaults_do_the_most_that_is_exact_at_the_least_cpu():
    """Issue #45: the FP8 copies and the all-gathered parameters whose shards are inputs ("auto"), Thunder FSDP's
    collectives rescheduled where that lowers the predicted peak; issue #43: not the FP8 forward all-gather (a
    saving of communication, about 27 us of CPU a weight)."""
    o = ShardIntermediates().options
    assert (o.candidates, o.reschedule, o.compact, o.fp8_forward_gather) == ("auto", True, "auto", False)


def test_budget_plans_once_optimizer_states_is_given():
    for states in (0, 2):
        assert ShardIntermediates(policy="budget", budget_bytes=10, optimizer_states=states).options.optimizer_states == states
