"""`dtrain plan`: the memory plan of a LoRA run before anything is rented (dtrain.lora.plan)."""

import dataclasses
import enum
import json
from typing import Annotated

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.common.choices import Precision
from dtrain.lora.choices import AdapterDtype, Attention, Optimizer, Sharding, Switch


class PlanQuant(str, enum.Enum):
    """dtrain.lora.config.Quant, plus auto (4bit if only that fits)."""

    AUTO = "auto"
    NONE = "none"
    NF4 = "4bit"


def plan(
    model: Annotated[
        str,
        typer.Option(
            "--model", help="a Hugging Face id (only config.json is read), a local model directory, or a dtrain preset"
        ),
    ],
    seq_len: Annotated[int, typer.Option("--seq-len", help="tokens per sequence")] = 2048,
    batch: Annotated[int, typer.Option("--batch", help="sequences per GPU per micro-batch")] = 1,
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="LoRA rank")] = 16,
    precision: Annotated[
        Precision, typer.Option("--precision", help="auto: bf16 where the card has it, else fp16")
    ] = Precision.AUTO,
    quant: Annotated[
        PlanQuant, typer.Option("--quant", help="base weights: none, 4bit (QLoRA), or auto (4bit if only that fits)")
    ] = PlanQuant.AUTO,
    strategy: Annotated[Sharding, typer.Option("--strategy", help="ddp, fsdp (sharded), or auto")] = Sharding.AUTO,
    checkpointing: Annotated[
        Switch, typer.Option("--activation-checkpointing", help="auto: on when needed")
    ] = Switch.AUTO,
    accelerator: Annotated[
        str, typer.Option("--accelerator", help="GCP accelerator type (default: the rules' default)")
    ] = "",
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs per node")] = 1,
    nodes: Annotated[int, typer.Option("--nodes", help="nodes")] = 1,
    adapter_dtype: Annotated[
        AdapterDtype, typer.Option("--adapter-dtype", help="LoRA weights, gradients and AdamW moments: fp32 or bf16")
    ] = AdapterDtype.FP32,
    optimizer: Annotated[
        Optimizer, typer.Option("--optimizer", help="adamw, or bitsandbytes' adamw-8bit / paged-adamw-8bit")
    ] = Optimizer.ADAMW,
    packed: Annotated[
        bool, typer.Option("--packed/--no-packed", help="instruction/chat rows packed with several examples each")
    ] = False,
    attention: Annotated[
        Attention,
        typer.Option(
            "--attention",
            help="packed rows, as `dtrain train lora --attention`: sdpa keeps a dense per-document mask; auto, "
            "sdpa_packed and flash_attention_2 keep none",
        ),
    ] = Attention.AUTO,
    as_json: o.Json = False,
) -> None:
    """Memory per GPU for LoRA fine-tuning MODEL: weights, adapter and optimizer state, activations with
    and without checkpointing, against the card's usable memory; whether it fits, the strategy, and
    the smallest dtrain cluster that runs it."""
    from dtrain.common.errors import ExitCode
    from dtrain.control.gcp import rules
    from dtrain.lora import plan as lp

    shape = lp.read_shape(model)
    settings = dict(
        seq_len=seq_len,
        batch=batch,
        lora_rank=lora_rank,
        precision=precision.value,
        quant=quant.value,
        strategy=strategy.value,
        checkpointing=checkpointing.value,
        adapter_dtype=adapter_dtype.value,
        optimizer=optimizer.value,
        packed=packed,
        # the plan tells the two apart by the mask alone: a dense B x L x L one (sdpa) or none
        attention="sdpa" if attention is Attention.SDPA else "flash",
    )
    if nodes < 1:
        from dtrain.common.errors import UserError

        raise UserError(f"--nodes must be at least 1, got {nodes}")
    p = lp.plan(shape, accelerator=accelerator or rules.default_accelerator(), gpus=gpus * nodes, **settings)
    cluster = lp.smallest_cluster(shape, **settings)
    if cluster is None:  # nothing dtrain can rent holds it: one line, naming the largest card
        lp.refuse_unplaceable(shape, **settings)
    if as_json:
        out = {
            "plan": _plan_dict(p),
            "fits": p.fits,
            "cluster": {
                "accelerator": cluster.accelerator,
                "gpus_per_node": cluster.per_node,
                "nodes": cluster.nodes,
                "machine_type": cluster.machine_type,
                "usd_per_hour": cluster.usd_per_hour,
                "spot_only": cluster.spot_only,
                "plan": _plan_dict(cluster.plan),
            },
        }
        console.out.print_json(json.dumps(out))
    else:
        _print(p, cluster, gpus, nodes)
    if not p.fits:
        console.state.exit_code = int(ExitCode.FAILURE)


def _plan_dict(p) -> dict:
    d = dataclasses.asdict(p)
    d["memory"] = {k: v for k, v in d["memory"].items()} | {"total": p.memory.total}
    d["method"] = p.method
    d["usable"] = p.usable
    return d


def _print(p, cluster, gpus: int, nodes: int) -> None:
    from rich.table import Table

    from dtrain.lora.plan import GIB

    m, mem = p.model, p.memory
    console.out.print(
        f"{m.name}: {m.model_type}, {m.layers} layers, hidden {m.hidden}, MLP {m.intermediate}, "
        f"{m.heads}/{m.kv_heads} heads, vocabulary {m.vocab:,}; {m.params() / 1e9:.2f}B parameters, "
        f"LoRA r={p.lora_rank}: {m.lora_params(p.lora_rank) / 1e6:.1f}M",
        highlight=False,
    )
    t = Table("per GPU", "GiB", title=f"{nodes} x {gpus} x {p.card_label}, {p.method}, {p.precision}")
    ckpt_mark = "(used)" if p.checkpointing else ""
    rows = [
        ("base weights" + (" (NF4)" if p.quant == "4bit" else ""), mem.weights),
        (f"LoRA weights ({p.adapter_dtype})", mem.adapter),
        ("LoRA gradients", mem.adapter_grads),
        ("AdamW moments" + (" (8-bit)" if p.optimizer != "adamw" else ""), mem.optimizer),
        ("low-precision copies", mem.casts),
        (f"activations, no checkpointing {'' if p.checkpointing else '(used)'}", mem.activations_no_ckpt),
        (f"activations, checkpointing {ckpt_mark}", mem.activations_ckpt),
        ("allocator and workspaces", mem.overhead),
        ("total", mem.total),
        ("usable on the card", p.usable),
    ]
    for name, value in rows:
        t.add_row(name, f"{value / GIB:,.2f}")
    console.out.print(t)
    verdict = "[green]fits[/]" if p.fits else "[red]does not fit[/]"
    console.out.print(
        f"{verdict}: {p.method}, activation checkpointing {'on' if p.checkpointing else 'off'}; "
        f"{mem.total / GIB:.1f} of {p.usable / GIB:.1f} GiB"
    )
    if cluster is not None:
        price = f", ~${cluster.usd_per_hour:,.2f}/h on demand" if cluster.usd_per_hour is not None else ""
        spot = " (Spot only)" if cluster.spot_only else ""
        console.out.print(
            f"smallest cluster: {cluster.nodes} node(s) x {cluster.per_node} {cluster.accelerator} "
            f"({cluster.machine_type}{spot}){price}: {cluster.plan.method}, checkpointing "
            f"{'on' if cluster.plan.checkpointing else 'off'}, {cluster.plan.memory.total / GIB:.1f} of "
            f"{cluster.plan.usable / GIB:.1f} GiB",
            highlight=False,
        )
