"""Decode tokens/s and weight memory of each quantization format vs the unquantized model, same run,
same threads, batch 1 and batch 32.

    .venv/bin/python benchmarks/quant_speed.py --model smollm2-135m --threads 2 --batch-sizes 1,32

Method: for each format, a fresh copy of the fp32 model is quantized; each batch row gets the same
--prompt-tokens prompt (one prefill), then --new-tokens greedy decode steps over a contiguous KV
cache; a step's time is one forward of [B, 1] tokens + argmax. tokens/s = B / median step time, the
median over all steps of --repeats runs. Next to each batch-1 figure: the weight bytes read per token
(every weight but the embedding table, of which one row is read) and the bandwidth that implies,
against this machine's measured memory bandwidth (decode at batch 1 is memory-bound:
tokens/s <= bandwidth / bytes read per token).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
from _common import memory_bandwidth_gbs


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """Weight bytes a batch-1 decode step reads: all but the embedding table (one row of it)."""
    from firstlight.quant import model_weight_bytes

    emb = model.embed_tokens
    table = [t for t in [*emb.parameters(), *emb.buffers()]]
    tied = any(t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
               for t in table for u in [*model.lm_head.parameters(), *model.lm_head.buffers()])
    emb_bytes = 0 if tied else sum(t.numel() * t.element_size() for t in table)
    return model_weight_bytes(model) - emb_bytes


@torch.inference_mode()
def decode_step_times(model: torch.nn.Module, prompt: list[int], batch: int, new_tokens: int) -> list[float]:
    from firstlight.models.kv_cache import ContiguousKVCache

    cfg = model.config
    total = len(prompt) + new_tokens
    cache = ContiguousKVCache(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, total)
    ids = torch.tensor([prompt] * batch)
    positions = torch.arange(len(prompt)).expand(batch, -1)
    token = model(ids, positions, cache)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    times = []
    for step in range(new_tokens):
        t0 = time.perf_counter()
        pos = torch.full((batch, 1), len(prompt) + step)
        token = model(token, pos, cache)[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="none,int8,int4,fp8")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant import model_weight_bytes, quantize_model

    path = hub.resolve(args.model)
    base, tok = load_model(path)
    prompt = tok.encode("The history of the city begins in the early middle ages, when " * 16)[: args.prompt_tokens]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = memory_bandwidth_gbs()
    rows = []
    for fmt in args.formats.split(","):
        model = copy.deepcopy(base)
        kernel = "float32 dense (F.linear)"
        if fmt != "none":
            name, _, opt = fmt.partition(":")  # e.g. int8:float32 = int8 with fp32 activations
            opts = {"compute_dtype": opt} if opt and name != "fp8" else {"kernel": opt} if opt else {}
            kernel = quantize_model(model, name, **opts).kernel
        row = {"format": fmt, "kernel": kernel, "weight_bytes": model_weight_bytes(model),
               "bytes_read_per_token": bytes_read_per_token(model)}
        for b in batches:
            times = [t for _ in range(args.repeats) for t in decode_step_times(model, prompt, b, args.new_tokens)]
            row[f"tokens_per_s_b{b}"] = b / statistics.median(times)
        rows.append(row)
        del model
    ref = rows[0]
    load = os.getloadavg()  # the machine may be shared: say how busy it was
    if args.json:
        print(json.dumps({"model": str(path), "threads": args.threads, "copy_bandwidth_gbs": bandwidth,
                          "load_average": load, "rows": rows}, indent=2))
        return
    print(f"{path.name}, {args.threads} threads, prompt {len(prompt)} tokens, {args.new_tokens} decode steps x "
          f"{args.repeats} runs (median step); memory bandwidth {bandwidth:.1f} GB/s; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    header = f"{'format':<14}{'weights MiB':>12}{'vs ' + ref['format']:>9}"
    for b in batches:
        header += f"{'tok/s b' + str(b):>12}{'speedup':>9}"
    print(header + f"{'GB/s b1 (bound ' + format(bandwidth, '.0f') + ')':>22}  kernel")
    for r in rows:
        line = f"{r['format']:<14}{r['weight_bytes'] / 2**20:>12.1f}{ref['weight_bytes'] / r['weight_bytes']:>8.2f}x"
        for b in batches:
            tps = r[f"tokens_per_s_b{b}"]
            line += f"{tps:>12.1f}{tps / ref[f'tokens_per_s_b{b}']:>8.2f}x"
        gbs = r["bytes_read_per_token"] * r.get("tokens_per_s_b1", 0) / 1e9
        print(line + f"{gbs:>22.1f}  {r['kernel']}")


if __name__ == "__main__":
    main()
