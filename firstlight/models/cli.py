"""`firstlight models list|pull|convert` and `firstlight generate`."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Known models: list them, pull them into the local cache, convert GGUF files.", no_args_is_help=True)
err = Console(stderr=True)


@app.command("list")
def list_cmd() -> None:
    """Show the known models and whether each is pulled, available or unavailable."""
    from firstlight.models import hub

    infos = hub.list_models()
    table = Table(title=f"models (cache: {hub.firstlight_home()})")
    rows = [dataclasses.asdict(i) for i in infos]
    for col in rows[0] if rows else []:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(v) if v is not None else "" for v in row.values()))
    Console().print(table)


@app.command()
def pull(
    name: str = typer.Argument(..., help="A name from `firstlight models list`."),
    force: bool = typer.Option(False, help="Rebuild even if already pulled."),
) -> None:
    """Make a local HF-format checkpoint dir for NAME and print its path."""
    from firstlight.core.progress import status
    from firstlight.models import hub

    with status(f"models pull {name}") as update:
        path = hub.pull(name, force=force, progress=update)
    print(path)


@app.command()
def convert(
    gguf_file: Path = typer.Argument(..., help="A .gguf file."),
    out_dir: Path = typer.Argument(..., help="Where to write the HF-format checkpoint dir."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
) -> None:
    """Convert a GGUF file into an HF-format checkpoint dir (safetensors + tokenizer)."""
    from firstlight.models.gguf import gguf_to_checkpoint

    print(gguf_to_checkpoint(gguf_file, out_dir, dtype=dtype))


def generate(
    model: str = typer.Option("smollm2-135m", help="Model name (`firstlight models list`) or checkpoint dir."),
    prompt: str = typer.Option(..., help="Prompt text."),
    max_tokens: int = typer.Option(64, min=1, help="Maximum new tokens."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling mass."),
    seed: int = typer.Option(0, help="Sampling seed."),
    chat: bool = typer.Option(False, help="Apply the tokenizer's chat template to the prompt."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    quantization: str = typer.Option("none", help="Weight quantization: none, int8, int4, fp8, w8a8."),
    threads: int = typer.Option(0, help="torch threads (0 = torch's default)."),
) -> None:
    """Generate a completion with our own implementation and stream it to stdout."""
    import torch

    from firstlight.models import hub
    from firstlight.models.generate import GenerationStats, TextStreamer, generate_tokens
    from firstlight.models.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    path = hub.resolve(model, progress=lambda msg: err.print(f"[dim]{msg}[/]"))
    net, tokenizer = load_model(path, dtype=dtype)
    if quantization != "none":
        # A CLI-level composition: the model library itself never imports the engine.
        from firstlight.quant import apply_quantization

        err.print(f"[dim]{apply_quantization(net, quantization, tokenizer=tokenizer).summary()}[/]")
    if chat:
        if not tokenizer.chat_template:
            raise typer.BadParameter(f"{path} has no chat template; drop --chat", param_hint="--chat")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(prompt)
    stats = GenerationStats()
    streamer = TextStreamer(tokenizer)
    t0 = time.perf_counter()
    if not chat:
        sys.stdout.write(prompt)
    for token in generate_tokens(
        net, ids, max_tokens, temperature=temperature, top_p=top_p, seed=seed,
        eos_token_ids=net.config.eos_token_ids, stats=stats,
    ):
        sys.stdout.write(streamer.push(token))
        sys.stdout.flush()
    sys.stdout.write("\n")
    err.print(
        f"[dim]{stats.num_prompt_tokens} prompt tokens, {stats.num_generated_tokens} generated in "
        f"{time.perf_counter() - t0:.2f}s | prefill {stats.prefill_tokens_per_s:.1f} tok/s, "
        f"decode {stats.decode_tokens_per_s:.1f} tok/s ({torch.get_num_threads()} threads, {dtype})[/]"
    )
