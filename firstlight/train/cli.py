"""`firstlight train ...`: training recipes. Heavy imports happen inside the commands."""

from __future__ import annotations

import typer

app = typer.Typer(help="Train speculative-decoding heads (self-distillation, data-parallel with torchrun).",
                  no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Training recipes (a group even with one command, so `train heads` keeps its name)."""


@app.command("heads")
def heads(
    model: str = typer.Option(..., "--model", help="checkpoint dir or known model name (e.g. smollm2-135m)"),
    corpus: str = typer.Option("hamlet-sample", "--corpus", help="hamlet-sample | shakespeare | python-stdlib | a text file"),
    out: str | None = typer.Option(None, "--out", help="heads file (default: <model dir>/firstlight_heads.safetensors)"),
    num_heads: int = typer.Option(4, "--num-heads", help="Medusa heads = max tokens proposed per step"),
    steps: int = typer.Option(200, "--steps", help="optimizer steps"),
    batch_size: int = typer.Option(8, "--batch-size", help="prompts per step per process"),
    prefix_len: int = typer.Option(32, "--prefix-len", help="corpus tokens per prompt"),
    gen_len: int = typer.Option(64, "--gen-len", help="tokens the target writes per prompt (the training text)"),
    positions_per_row: int = typer.Option(32, "--positions-per-row", help="positions trained per sequence; 0 = all"),
    lr: float = typer.Option(1e-3, "--lr", help="learning rate (AdamW)"),
    checkpoint_every: int = typer.Option(25, "--checkpoint-every", help="save <out>.ckpt every N steps"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="continue from <out>.ckpt if it exists"),
    seed: int = typer.Option(0, "--seed", help="seed of prompt order and head initialization"),
    device: str = typer.Option("cpu", "--device", help="torch device: cpu, cuda, cuda:1, ..."),
    threads: int | None = typer.Option(None, "--threads", help="torch threads per process"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="print the loss every few steps"),
) -> None:
    """Self-distill Medusa heads for MODEL on CORPUS (launch with `torchrun --nproc_per_node N` for data parallel)."""
    import torch
    from rich.console import Console

    from firstlight.train.heads import HeadsTrainConfig, train_heads

    if threads:
        torch.set_num_threads(threads)
    cfg = HeadsTrainConfig(
        model=model, corpus=corpus, out=out, num_heads=num_heads, steps=steps, batch_size=batch_size,
        prefix_len=prefix_len, gen_len=gen_len, positions_per_row=positions_per_row or None, lr=lr,
        checkpoint_every=checkpoint_every, resume=resume, seed=seed, device=device, progress=progress,
    )
    summary = train_heads(cfg)
    if summary["world_size"] == 1 or __import__("os").environ.get("RANK", "0") == "0":
        acc = " ".join(f"{a:.2f}" for a in summary["head_top1_agreement"])
        Console().print(
            f"heads → {summary['heads_path']}  ({summary['steps_this_run']} steps in {summary['train_s']:.1f} s, "
            f"{summary['tokens_per_s']:,.0f} tok/s, {summary['world_size']} process(es), loss {summary['final_loss']:.3f}, "
            f"per-head top-1 agreement {acc})"
        )


if __name__ == "__main__":  # `torchrun ... -m firstlight.train.cli heads ...` works before registration too
    app()
