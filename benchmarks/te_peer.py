"""The peer: TransformerEngine's own intermediate sharding (``fsdp_group`` via ``prepare_te_modules_for_fsdp``) under
PyTorch FSDP1, on a model with the linear shapes of the litgpt config that ``bench_litgpt.py`` uses.

The model is a stack of ``te.Linear`` modules with the shapes of litgpt's Llama linears (per layer: qkv, attention
proj, fc_1, fc_2, mlp proj; then the lm head), residual adds and a SiLU gate, on random bf16 activations that differ
per rank, under ``te.autocast`` / ``fp8_autocast`` with the DelayedScaling recipe. Every ``te.Linear`` is its own
FSDP1 unit (``use_orig_params=True``). Two runs from the same weights and data: plain FSDP1, and FSDP1 after
``prepare_te_modules_for_fsdp`` (which scatters each module's saved input and FP8 weight copy over the FSDP group in
forward and gathers them in backward). Written as JSON: max abs / max relative error of every rank's local gradient
shard (sharded run against plain run), and both runs' per-rank ``torch.cuda.max_memory_allocated``. If TE's API
fails, the error text is recorded instead.

Runs two gloo ranks on one GPU by default (``--world-size``), or under ``torchrun`` with ``--backend nccl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def linear_shapes(a) -> list[tuple[str, int, int]]:
    """(name, in, out) of the litgpt config's linears, per layer then the head."""
    from benchmarks.bench_litgpt import RunConfig, litgpt_config

    c = litgpt_config(RunConfig(model_name=a.model_name, n_layer=a.n_layer, n_embd=a.n_embd,
                                intermediate_size=a.intermediate_size, n_head=a.n_head, vocab_size=a.vocab_size,
                                seq_len=a.seq_len))
    qkv = (c.n_head + 2 * c.n_query_groups) * c.head_size
    shapes = []
    for i in range(c.n_layer):
        shapes += [(f"h{i}.qkv", c.n_embd, qkv), (f"h{i}.attn_proj", c.n_head * c.head_size, c.n_embd),
                   (f"h{i}.fc_1", c.n_embd, c.intermediate_size), (f"h{i}.fc_2", c.n_embd, c.intermediate_size),
                   (f"h{i}.mlp_proj", c.intermediate_size, c.n_embd)]
    shapes.append(("lm_head", c.n_embd, c.padded_vocab_size))
    return shapes, c


class TEStack(torch.nn.Module):
    def __init__(self, shapes, n_embd, device):
        import transformer_engine.pytorch as te

        super().__init__()
        self.n_embd = n_embd
        self.lin = torch.nn.ModuleDict({n.replace(".", "_"): te.Linear(i, o, bias=False, params_dtype=torch.bfloat16,
                                                                       device=device) for n, i, o in shapes})
        self.n_layer = (len(shapes) - 1) // 5

    def forward(self, x):
        L = self.lin
        for i in range(self.n_layer):
            qkv = L[f"h{i}_qkv"](x)
            x = x + L[f"h{i}_attn_proj"](qkv[..., : self.n_embd].contiguous())  # attention's linears, no attention
            h = torch.nn.functional.silu(L[f"h{i}_fc_1"](x)) * L[f"h{i}_fc_2"](x)
            x = x + L[f"h{i}_mlp_proj"](h)
        return L["lm_head"](x)


def _autocast(recipe):
    import transformer_engine.pytorch as te

    fn = getattr(te, "autocast", None)
    if fn is not None:
        return fn(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def run_rank(rank: int, world: int, a: dict) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch.distributed import prepare_te_modules_for_fsdp

    args = argparse.Namespace(**a)
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    shapes, c = linear_shapes(args)
    out = {"rank": rank, "fp8": args.fp8}
    import transformer_engine.pytorch.module.linear as te_linear

    scattered: list = []  # what TE's scatter is handed, and whether it shards it
    orig_scatter = te_linear._fsdp_scatter_tensors

    def spy(group, *tensors):
        shapes = orig_scatter(group, *tensors)
        if group is not None:
            scattered.append([(type(t).__name__, isinstance(t, torch.Tensor)) for t in tensors])
        return shapes

    te_linear._fsdp_scatter_tensors = spy
    for mode in ("plain", "te_fsdp_group"):
        scattered.clear()
        torch.manual_seed(0)
        model = TEStack(shapes, c.n_embd, device)
        fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({te.Linear}), device_id=device, use_orig_params=True,
                    sync_module_states=False)
        rec = {}
        try:
            if mode == "te_fsdp_group":
                prepare_te_modules_for_fsdp(fsdp)
                rec["fsdp_group_set"] = sum(1 for m in fsdp.modules()
                                            if isinstance(m, te.Linear) and getattr(m, "fsdp_group", None) is not None)
            gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
            recipe = DelayedScaling()
            grads = []
            torch.cuda.reset_peak_memory_stats(device)
            for step in range(args.steps):
                x = torch.randn(args.micro_batch_size, args.seq_len, c.n_embd, generator=gen).to(device, torch.bfloat16)
                x.requires_grad_(True)
                if args.fp8:
                    with _autocast(recipe):
                        y = fsdp(x)
                else:
                    y = fsdp(x)
                loss = y.float().pow(2).mean()
                loss.backward()
                grads.append({n: p.grad.detach().float().cpu().clone() for n, p in fsdp.named_parameters()
                              if p.grad is not None})
                grads[-1]["__input__"] = x.grad.detach().float().cpu().clone()
                for p in fsdp.parameters():
                    p.grad = None
            torch.cuda.synchronize()
            rec["peak_bytes"] = torch.cuda.max_memory_allocated(device)
            rec["loss_last"] = float(loss.detach())
            seen = {}
            for call in scattered:
                for name, is_tensor in call:
                    key = f"{name} ({'sharded: a torch.Tensor' if is_tensor else 'skipped by TE: not a torch.Tensor'})"
                    seen[key] = seen.get(key, 0) + 1
            rec["scatter_calls"] = len(scattered)
            rec["scatter_saw"] = seen
            rec["grads"] = grads
        except Exception as e:  # TE's API for this may not work: report what happens
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-4000:]
        out[mode] = rec
        del fsdp, model
        torch.cuda.empty_cache()
    return out


def _errors(plain: list[dict], shard: list[dict]) -> dict:
    max_abs, max_rel, worst = 0.0, 0.0, None
    per = {}
    for step, (gp, gs) in enumerate(zip(plain, shard)):
        for n in gp:
            if n not in gs:
                continue
            d = (gp[n] - gs[n]).abs().max().item()
            rel = d / max(gp[n].abs().max().item(), 1e-30)
            per[f"step{step}:{n}"] = {"max_abs": d, "rel_to_max": rel}
            if rel > max_rel:
                worst = f"step{step}:{n}"
            max_abs, max_rel = max(max_abs, d), max(max_rel, rel)
    return {"max_abs_error": max_abs, "max_rel_error": max_rel, "worst": worst, "bitwise_equal": max_abs == 0.0,
            "per_tensor": per}


def main(argv=None):
    from benchmarks.bench_litgpt import add_model_args

    p = argparse.ArgumentParser(description="TE fsdp_group peer under PyTorch FSDP1")
    add_model_args(p)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True, help="DelayedScaling autocast")
    p.add_argument("--out")
    p.add_argument("--dry-run", action="store_true", help="print the linear shapes and exit (no GPU needed)")
    a = p.parse_args(argv)
    if a.dry_run:
        print(json.dumps(linear_shapes(a)[0]))
        return
    if a.backend == "gloo":
        from thunder_fp8shard.testing.harness import run_on_ranks

        ranks = run_on_ranks(run_rank, a.world_size, vars(a))
    else:
        dist.init_process_group("nccl")
        mine = run_rank(dist.get_rank(), dist.get_world_size(), vars(a))
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() != 0:
            return
    from benchmarks.bench_litgpt import device_info

    res = {"device": device_info(), "args": vars(a), "backend": a.backend,
           "what": "PyTorch FSDP1 + te.Linear (DelayedScaling); prepare_te_modules_for_fsdp vs plain; different data "
                   "per rank; errors are of each rank's local gradient shards and input gradients", "ranks": []}
    for r in ranks:
        entry = {"rank": r["rank"]}
        for mode in ("plain", "te_fsdp_group"):
            entry[mode] = {k: v for k, v in r[mode].items() if k != "grads"}
        if "grads" in r["plain"] and "grads" in r["te_fsdp_group"]:
            e = _errors(r["plain"]["grads"], r["te_fsdp_group"]["grads"])
            entry["error"] = {k: v for k, v in e.items() if k != "per_tensor"}
            entry["error_per_tensor"] = e["per_tensor"]
        res["ranks"].append(entry)
    text = json.dumps(res, indent=1, default=str)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text)
    print(json.dumps([{k: v for k, v in e.items() if k != "error_per_tensor"} for e in res["ranks"]], indent=1,
                     default=str)[:6000])


if __name__ == "__main__":
    main()
