"""`firstlight eval ppl|kl`: perplexity of a model (optionally quantized) on an offline text, its
ratio to the unquantized model, and the mean KL divergence of the quantized model from it."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Quality: perplexity and KL divergence against a reference.", no_args_is_help=True)

MODEL = typer.Option("smollm2-135m", help="Model name (`firstlight models list`) or checkpoint dir.")
CORPUS = typer.Option("hamlet-sample", help="hamlet-sample, shakespeare, python-stdlib or a UTF-8 text file.")
MAX_TOKENS = typer.Option(4096, min=2, help="Score the first N tokens of the corpus.")
WINDOW = typer.Option(512, min=2, help="Tokens per forward pass.")
STRIDE = typer.Option(256, min=1, help="New tokens scored per window after the first (context = window - stride).")
DTYPE = typer.Option("float32", help="Weights' dtype before quantization: float32, bfloat16 or float16.")
THREADS = typer.Option(0, help="torch threads (0 = torch's default).")
GROUP_SIZE = typer.Option(32, help="int4 only: input channels per scale (32, 64, 128, 256).")
SKIP_LM_HEAD = typer.Option(False, help="Keep the output projection unquantized.")
JSON_OUT = typer.Option(False, "--json", help="Print one JSON object instead of a table.")
METHOD = typer.Option("auto", help="auto (each format's best measured: GPTQ for int8 and fp8, round-to-nearest for int4), rtn or gptq.")
CALIBRATION = typer.Option("shakespeare", help="GPTQ calibration corpus (any part sharing a line with hamlet-sample is dropped).")


def _formats(quantization: str) -> list[str]:
    from firstlight.quant import list_formats

    names = [q.strip() for q in quantization.split(",") if q.strip()]
    if names == ["all"]:
        return list(list_formats())
    return [n for n in names if n != "none"]


def _run(model: str, quantization: str, corpus: str, max_tokens: int, window: int, stride: int, dtype: str,
         threads: int, group_size: int, skip_lm_head: bool, with_kl: bool, as_json: bool,
         method: str = "auto", calibration: str = "shakespeare") -> None:
    import torch

    from firstlight.errors import FirstlightError
    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant import get_format
    from firstlight.quant.calibrated import DEFAULT_METHODS, calibration_token_ids, default_cache_dir
    from firstlight.quant.quality import corpus_ids, evaluate_formats

    if not 1 <= stride < window:
        raise FirstlightError(f"--stride {stride} must be in 1..{window - 1} (below --window {window})")
    if method not in ("auto", "rtn", "gptq"):
        raise FirstlightError(f"--method '{method}' must be auto, rtn or gptq")
    if threads:
        torch.set_num_threads(threads)
    formats = _formats(quantization)
    for f in formats:  # fail on a bad format before loading anything
        if f.startswith("kv-"):
            from firstlight.quant.kv import check_kv_format

            check_kv_format(f.removeprefix("kv-"))
            continue
        get_format(f, **({"group_size": group_size} if f == "int4" else {}))
    path = hub.resolve(model)
    net, tokenizer = load_model(path, dtype=dtype)
    ids = corpus_ids(tokenizer, corpus, max_tokens)
    opts = {"int4": {"group_size": group_size}}
    methods = {f: "rtn" if f.startswith("kv-") else DEFAULT_METHODS.get(f, "rtn") if method == "auto" else method
               for f in formats}
    cal = calibration_token_ids(tokenizer, calibration) if "gptq" in methods.values() else []
    gptq = {"calibration_ids": cal, "calibration_name": calibration, "cache_dir": default_cache_dir()}
    opts = {f: {**opts.get(f, {}), "skip_lm_head": skip_lm_head, "method": methods[f],
                **(gptq if methods[f] == "gptq" else {})} for f in formats}
    from firstlight.core.progress import progress

    with progress("eval", total=1 + len(formats), unit="models") as advance:
        base, results = evaluate_formats(net, ids, formats, window=window, stride=stride, with_kl=with_kl,
                                         quant_opts=opts, progress=advance)
    rows = [base, *results]
    if as_json:
        print(json.dumps({"model": str(path), "corpus": corpus, "dtype": dtype, "window": window, "stride": stride,
                          "threads": torch.get_num_threads(), "results": [r.to_dict() for r in rows]}, indent=2))
        return
    table = Table(title=f"{path.name} on {corpus}: {base.num_tokens} tokens scored, window {window}, stride {stride}")
    for col in ("quantization", "method", "perplexity", "ratio", "goal", "mean KL (nats)", "weights MiB", "kernel"):
        table.add_column(col)
    for r in rows:
        goal = "" if r.goal is None else f"<= {r.goal} " + ("[green]ok[/]" if r.passed else "[red]missed[/]")
        kl = "" if r.format == "none" or not with_kl else f"{r.mean_kl:.5f}"
        table.add_row(r.format if r.format != "none" else f"none ({dtype})", "" if r.format == "none" else r.method,
                      f"{r.perplexity:.4f}",
                      f"{r.ppl_ratio:.5f}", goal, kl, f"{r.weight_bytes / 2**20:.1f}", r.kernel)
    Console().print(table)


@app.command()
def ppl(
    model: str = MODEL,
    quantization: str = typer.Option("none", help="none, int8, int4, fp8, w8a8, kv-int8, kv-fp8, kv-bf16, kv-fp16 (KV cache), a comma list, or 'all'."),
    corpus: str = CORPUS,
    max_tokens: int = MAX_TOKENS,
    window: int = WINDOW,
    stride: int = STRIDE,
    dtype: str = DTYPE,
    threads: int = THREADS,
    group_size: int = GROUP_SIZE,
    skip_lm_head: bool = SKIP_LM_HEAD,
    kl: bool = typer.Option(True, help="Also compute mean KL vs the unquantized model."),
    as_json: bool = JSON_OUT,
    method: str = METHOD,
    calibration: str = CALIBRATION,
) -> None:
    """Perplexity on an offline text; with --quantization, also the ratio (and KL) vs unquantized."""
    _run(model, quantization, corpus, max_tokens, window, stride, dtype, threads, group_size, skip_lm_head, kl, as_json,
         method, calibration)


@app.command("kl")
def kl_cmd(
    model: str = MODEL,
    quantization: str = typer.Option(..., help="int8, int4, fp8, w8a8, kv-int8, kv-fp8, kv-bf16, kv-fp16 (KV cache), a comma list, or 'all'."),
    corpus: str = CORPUS,
    max_tokens: int = MAX_TOKENS,
    window: int = WINDOW,
    stride: int = STRIDE,
    dtype: str = DTYPE,
    threads: int = THREADS,
    group_size: int = GROUP_SIZE,
    skip_lm_head: bool = SKIP_LM_HEAD,
    as_json: bool = JSON_OUT,
    method: str = METHOD,
    calibration: str = CALIBRATION,
) -> None:
    """Mean KL(unquantized || quantized) per token, with both perplexities and their ratio."""
    from firstlight.errors import FirstlightError

    if not _formats(quantization):
        raise FirstlightError("--quantization must name a format (int8, int4, fp8, w8a8 or 'all'), not 'none'")
    _run(model, quantization, corpus, max_tokens, window, stride, dtype, threads, group_size, skip_lm_head, True, as_json,
         method, calibration)
