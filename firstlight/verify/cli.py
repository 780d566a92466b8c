"""`firstlight verify`: exit 0 = matches the reference, 1 = mismatch found, 2 = could not run."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import typer


def verify(
    model: str = typer.Option("smollm2-135m", help="Model name or checkpoint dir."),
    target: str = typer.Option(
        "eager", help="eager | inductor | onnxruntime | faulty:k=v,... | emulate:CHIP | path/to/file.py:ClassName "
                      "(a plugin file is imported and run as Python code: only pass files you trust)."),
    overrides: Path | None = typer.Option(
        None, help="Numerics overrides YAML for an emulate:CHIP target (docs/EMULATION.md 'Overrides')."),
    dtype: str = typer.Option("float32", help="Target dtype: float32, bfloat16, float16."),
    prompt_file: Path | None = typer.Option(None, help="Text file with the prompt (default: a built-in sentence)."),
    out: Path | None = typer.Option(None, help="Write result.json and index.html here."),
    json_out: bool = typer.Option(False, "--json", help="Print result.json to stdout instead of the summary."),
    new_tokens: int = typer.Option(16, help="Greedy tokens the reference generates (free-running check)."),
    ppl_tokens: int = typer.Option(256, help="Tokens of the bundled text for perplexity (0: skip)."),
    tolerance: Path | None = typer.Option(None, help="JSON tolerance overrides (see docs/VERIFY.md)."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)."),
    quantization: str = typer.Option("none", help="Quantize our model first: none, int8, int4, fp8, w8a8."),
    decode_steps: int = typer.Option(
        2, help="Serving path: one-token decode steps through the target's KV cache after a chunked prefill (0: none)."),
    batch_path: bool = typer.Option(
        True, "--batch-path/--no-batch-path",
        help="Serving path over 3 prompts of different lengths (padding, masks, block tables); off: the prompt alone."),
    reference_cache: bool = typer.Option(
        True, "--reference-cache/--no-reference-cache",
        help="Reuse the reference's greedy continuation from $FIRSTLIGHT_HOME/verify-cache (--no-reference-cache "
             "regenerates it)."),
) -> None:
    """Check a model on a target against the HF reference; localize the first failing op."""
    from rich.console import Console

    from firstlight.core.progress import status
    from firstlight.errors import FirstlightError
    from firstlight.verify.refcache import ReferenceCacheWarning

    err = Console(stderr=True)
    try:
        with warnings.catch_warnings(), status(f"verify {model} on {target}") as _:
            warnings.simplefilter("ignore", ReferenceCacheWarning)  # printed below, one line each
            result = _run(model, target, dtype, prompt_file, new_tokens, ppl_tokens, tolerance, threads, quantization,
                          reference_cache=reference_cache, decode_steps=decode_steps, batch_path=batch_path,
                          overrides=overrides)
    except FirstlightError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    for w in result.reference_continuation.get("warnings", []):
        err.print(f"[yellow]warning:[/] {w}", highlight=False, soft_wrap=True)
    from firstlight.verify.report import print_summary, write_verify_report

    data = result.to_dict()
    if out is not None:
        write_verify_report(out, data, seed=0)
    if json_out:
        sys.stdout.write(json.dumps(data, default=str) + "\n")
    else:
        print_summary(data)
        if out is not None:
            Console().print(f"report: {out / 'index.html'}", highlight=False)
    raise typer.Exit(code=0 if result.verdict == "match" else 1)


def _run(model: str, target: str, dtype: str, prompt_file: Path | None, new_tokens: int, ppl_tokens: int,
         tolerance: Path | None, threads: int, quantization: str = "none",
         reference_cache: bool = True, decode_steps: int = 2, batch_path: bool = True,
         overrides: Path | None = None):  # -> VerifyResult
    import torch

    from firstlight.data import load_text
    from firstlight.errors import FirstlightError
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model, load_tokenizer, parse_dtype
    from firstlight.targets.registry import get_target
    from firstlight.verify.harness import DEFAULT_PROMPT, VerifyConfig, run_verify
    from firstlight.verify.refcache import ContinuationCache
    from firstlight.verify.tolerance import TolerancePolicy

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = parse_dtype(dtype)
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise FirstlightError(f"prompt file '{prompt_file}' not found; give a UTF-8 text file")
        prompt = prompt_file.read_text(errors="replace")
        if not prompt.strip():
            raise FirstlightError(f"prompt file '{prompt_file}' is empty; put at least a sentence in it")
    else:
        prompt = DEFAULT_PROMPT
    if overrides is not None:
        if not target.startswith("emulate:"):
            raise FirstlightError(f"--overrides applies to emulate:CHIP targets, not '{target}'")
        target = f"{target},overrides={overrides}"
    tgt = get_target(target, torch_dtype)  # before the model: a bad target fails fast
    path = resolve(model)
    tok = load_tokenizer(path)
    prompt_ids = tok(prompt)["input_ids"]
    if len(prompt_ids) < 2:
        raise FirstlightError(f"prompt '{prompt[:40]}' has fewer than 2 tokens; give a longer prompt")
    policy = TolerancePolicy.for_dtype(tgt.tolerance_dtype)
    if tolerance is not None:
        policy = policy.with_file(tolerance)
    ppl_ids = tok(load_text("hamlet-sample"), verbose=False)["input_ids"] if ppl_tokens else None
    if decode_steps < 0:
        raise FirstlightError(f"--decode-steps {decode_steps} is negative; give 0 (no decode steps) or more")
    cfg = VerifyConfig(new_tokens=new_tokens, ppl_tokens=ppl_tokens, decode_steps=decode_steps, batch_path=batch_path)
    ours = None
    if quantization != "none":
        from firstlight.quant import apply_quantization

        ours, _ = load_model(path, dtype=torch_dtype, with_tokenizer=False)
        apply_quantization(ours, quantization, tokenizer=tok)
    cache = ContinuationCache.default() if reference_cache else None
    return run_verify(path, tgt, target, prompt_ids, cfg, policy, ppl_ids=ppl_ids, model=ours, reference_cache=cache)
