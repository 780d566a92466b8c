"""`firstlight serve`."""

from __future__ import annotations

from pathlib import Path

import typer


def serve(
    model: str = typer.Option(..., help="Model name (see `firstlight models list`) or checkpoint dir."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8000, help="Port to bind."),
    trace: Path | None = typer.Option(None, help="Write every engine step to this JSONL trace file."),
    dtype: str = typer.Option("float32", help="Weight and KV-cache dtype: float32, bfloat16, float16."),
    served_model_name: str | None = typer.Option(None, help="Name clients use in 'model' (default: --model)."),
    block_size: int = typer.Option(16, help="Tokens per KV-cache block."),
    kv_cache_gib: float = typer.Option(1.0, help="Memory for the KV cache, GiB."),
    max_num_seqs: int = typer.Option(64, help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(2048, help="Most tokens computed per step (chunked prefill)."),
    max_model_len: int | None = typer.Option(None, help="Context length (default: the model's)."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching",
                                        help="Reuse the KV blocks of shared prompt prefixes."),
    compile_decode: bool = typer.Option(False, help="torch.compile the decode forward (shape-bucketed: a bounded number of graphs)."),
    native_decode: bool = typer.Option(True, "--native-decode/--no-native-decode",
                                       help="Run a dense decoder's decode step in one native call (CPU, fp32 KV; "
                                            "other models and formats keep the modules: docs/ENGINE.md)."),
    quantization: str = typer.Option("none", help="Weight quantization: none, int8, int4, w4a8, fp8, w8a8."),
    threads: int | None = typer.Option(None, help="torch intra-op threads (default: torch's)."),
    speculative: str = typer.Option("none", help="Speculative decoding: none, ngram, draft, heads, mtp (the checkpoint's own MTP layer)."),
    num_spec_tokens: int = typer.Option(4, help="Tokens proposed and verified per step when speculating "
                                        "(with --adaptive-k: the most per step)."),
    adaptive_k: bool = typer.Option(False, help="Per request and step, propose the number of tokens with the most "
                                    "expected tokens per unit of measured pass cost (0 when guesses do not pay)."),
    draft_model: str | None = typer.Option(None, help="--speculative draft: a model with the same tokenizer "
                                           "(default: the target's first --draft-layers layers)."),
    draft_layers: int | None = typer.Option(None, help="Self-speculative draft depth (default: a quarter of the layers)."),
    heads: str | None = typer.Option(None, help="--speculative heads: heads file (default: next to the model)."),
    kv_cache_dtype: str = typer.Option("auto", help="KV-cache storage: auto (the model's dtype), bf16 or fp16 "
                                       "(half an fp32 model's bytes), int8 or fp8 (codes + a scale per token and "
                                       "head; docs/QUANT.md)."),
    api_key: str | None = typer.Option(None, envvar="FIRSTLIGHT_API_KEY", show_envvar=True,
                                       help="Require 'Authorization: Bearer KEY' on /v1/* and admin routes."),
    allowed_hosts: str | None = typer.Option(None, help="Comma-separated Host header names accepted (e.g. "
                                             "localhost,127.0.0.1), against DNS rebinding; default: any."),
    max_body_bytes: int = typer.Option(4 << 20, help="Largest request body, bytes (413 above; checked before "
                                       "parsing)."),
    max_tokens_limit: int = typer.Option(4096, help="Most tokens one prompt may generate; also what "
                                         "max_tokens: null means."),
    max_prompts_per_request: int = typer.Option(64, help="Most prompts in one /v1/completions request."),
    request_timeout_s: float = typer.Option(600.0, help="Time limit per request, s: then it ends with "
                                            "finish_reason 'length', stop_reason 'time_limit'."),
    header_timeout_s: float = typer.Option(10.0, help="A connection's request headers must arrive within this, "
                                           "s (slow clients are closed)."),
    body_timeout_s: float = typer.Option(30.0, help="A request body must arrive within this after its headers, "
                                         "s (408)."),
    chat_escape_special_tokens: bool = typer.Option(
        False, "--chat-escape-special-tokens/--no-chat-escape-special-tokens",
        help="Tokenize special-token text in chat messages (e.g. '<|im_end|>') as plain text, so a user cannot "
             "end their turn or write another role's (docs/SERVING.md)."),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API."""
    import torch

    from firstlight.engine.server import serve as run_server
    from firstlight.engine.server_guard import ServerLimits
    from firstlight.errors import FirstlightError

    if threads is not None:
        torch.set_num_threads(threads)
    if compile_decode:
        # inductor's FX graph cache (on by default) under the firstlight home rather than /tmp: compiled
        # decode graphs survive a reboot, and a warm start skips inductor's codegen (docs/PERFORMANCE.md)
        import os

        from firstlight.models.hub import firstlight_home

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(firstlight_home() / "cache" / "inductor"))
    if kv_cache_gib <= 0:
        raise FirstlightError(f"--kv-cache-gib must be > 0, got {kv_cache_gib}")
    hosts = tuple(h.strip() for h in allowed_hosts.split(",") if h.strip()) if allowed_hosts else None
    limits = ServerLimits(max_body_bytes=max_body_bytes, max_tokens=max_tokens_limit,
                          max_prompts_per_request=max_prompts_per_request, request_timeout_s=request_timeout_s,
                          header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s, api_key=api_key,
                          allowed_hosts=hosts, escape_special_tokens=chat_escape_special_tokens)
    spec = None
    if speculative != "none":
        from firstlight.engine.speculative.config import SpecConfig
        from firstlight.engine.speculative.medusa import default_heads_path
        from firstlight.models.hub import resolve

        if speculative == "heads" and heads is None:
            heads = str(default_heads_path(resolve(model)))
        spec = SpecConfig(speculative, num_spec_tokens=num_spec_tokens, adaptive_k=adaptive_k,
                          draft_model=draft_model, draft_layers=draft_layers, heads_path=heads)
    run_server(
        model,
        host=host,
        port=port,
        trace=str(trace) if trace else None,
        dtype=dtype,
        quantization=quantization,
        served_name=served_model_name,
        limits=limits,
        block_size=block_size,
        kv_cache_bytes=int(kv_cache_gib * (1 << 30)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        kv_cache_dtype=kv_cache_dtype,
        compile_decode=compile_decode,
        native_decode=native_decode,
        speculative=spec,
    )
