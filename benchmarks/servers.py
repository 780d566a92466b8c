"""firstlight's server next to the servers a CPU user would otherwise run, one at a time, same threads,
same client (`firstlight bench run`), same workloads; every figure next to its roofline bound.

    PYTHONPATH=. .venv/bin/python benchmarks/servers.py --model smollm2-135m --threads 2 --out /tmp/servers

Servers (each optional; a missing one is reported with the reason and skipped):
  firstlight-{fp32,int8,int4,w4a8,w8a8}  `firstlight serve --quantization ...` (int8/w8a8: GPTQ, from its cache)
  firstlight-{...}-kv16             the same with `--kv-cache-dtype fp16` (llama.cpp's default cache storage)
  hf-serve                          `transformers serve --continuous-batching` (fp32)
  llama-cpp                         llama-cpp-python's server on the GGUF `models pull` fetched (`make bench-peers`)
  llama-server                      llama.cpp's own server, 32 parallel slots (`make bench-peers-server`)

Workloads (through `python -m firstlight.cli bench run`, streaming completions, random token prompts):
  single    1 request at a time, prompt 128, 128 output tokens: decode tok/s = 1000 / median TPOT, TTFT
  closed    closed loop at c = 1, 8, 32: 32 requests (c=1: --num-requests-c1), prompt 128, 32 output tokens
  poisson   Poisson arrivals swept over --rates, lognormal prompt (median 128) and output (median 32)
            lengths (sigma 0.5), goodput at --slo

--rounds N runs every server N times, the order alternating round by round (this machine's speed drifts by up
to 1.4x between runs minutes apart, so one run per server compares phases, not servers):
the tables print each figure's median over the rounds, and a per-round table each firstlight server's ratio to
the best peer of the same round, with the median and range of those ratios.

Every run busts prefix caches (`--cache-bust`: a per-run nonce starts every prompt). Without it the runs
share prompts (same seed), and a server with a prefix cache (firstlight's, on by default) prefills only
the first time: the closed-loop figures of a second run were up to 1.6x the first's.

Forcing the output length: firstlight gets `ignore_eos`; llama-cpp-python's server drops that field
silently, so it gets `min_tokens` = max_tokens; `transformers serve` rejects it (422), so it gets
`generation_config` with min_new_tokens = max_new_tokens (its completions endpoint reads that field).
The table reports the mean output tokens each server really produced (counted with the model's
tokenizer over the streamed text, so a token or two off from the server's own count).
llama-cpp-python runs `--interrupt_requests False` (by default a new request cuts the stream running).

Bounds (roofline, Williams et al. 2009), per server from its own weight format and kernel: a decode step
of batch c costs max(weight bytes / memory bandwidth, c x 2 x matmul params FLOPs / GEMM rate of the kernel
at M = c), the rate measured over the model's own linear shapes (one layer's and a slice of the head, in
their proportions of a forward's FLOPs, each hot in cache: `kernel_rates`); a prompt of P tokens (P: the
mean the client reports sending, 128 random tokens plus its cache-bust nonce) costs 2 x (P x the layers'
matmul params + the head's) / GEMM rate (only the last prompt token needs logits; the rate: the better of M = 128
and M = c x 128 up to the engine's 2,048-row step, where c prompts can share one GEMM) and yields the
first output token, so a request of n output tokens takes n - 1 decode steps. Attention is work too: its
FLOPs (4 x heads x head dim per query per visible key and layer: q.k and p.v) go with the matmuls' at the same
GEMM rate, and a decode step also reads every row's K and V (the server's KV element size: fp32 for ours and
transformers', f16 for llama.cpp and ours with `-kv16`), each key counted up to the layer's window. Rates and bandwidth are
measured in this process with the same thread count: once before the servers start (the Poisson sweep's and
old summaries' bounds), and just before and just after each single-stream and closed-loop run, whose bound
uses the mean of those two (this machine's GEMM rate moved from 255 to 433 GFLOP/s at M = 128 within an hour:
a bound measured once can sit in another phase than the run it bounds). llama.cpp's kernels are not
measured here: its bound uses the GGUF's bytes and our w4a8 GEMM rate (the Q4_1 x Q8_1 dot products it runs
are w4a8's int4 x int8 multiply-adds).

The instruction sets in use head the tables (`isas`): firstlight's kernel build, ATen's CPU capability, oneDNN's
limit and llama.cpp's build. An AVX2-only CPU (the issue's) is emulated on a wider one by limiting all of them,
each server inheriting the environment: `make bench-peers-avx2` (llama.cpp without AVX-512), then
`FIRSTLIGHT_CPU_KERNELS_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .../servers.py ...` (fbgemm, under
w8a8, keeps its own dispatch: it ignores all three).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from _common import median_time, memory_bandwidth_gbs

if TYPE_CHECKING:
    from collections.abc import Callable

    from firstlight.models.config import ModelConfig

PY = sys.executable
LLAMA_SERVER = Path(PY).with_name("llama-server")  # `make bench-peers-server` puts llama.cpp's server there
PROMPT_LEN, CLOSED_OUT, SINGLE_OUT = 128, 32, 128
MAX_PROMPT_ROWS = 2048  # the engine's default max_num_batched_tokens: the most prompt rows one step multiplies


def prompt_rows(c: int) -> int:
    """The rows a closed loop of c requests can give its prompts' matmuls at once: its c prompts, up to one step's
    (the bound's prompt rate is the better of this and one prompt's: a kernel may run faster at 2,048 rows)."""
    return min(c * PROMPT_LEN, MAX_PROMPT_ROWS)


def bound_ms(c: int) -> tuple[int, ...]:
    """The M values of the kernel rates a closed-loop bound of c requests reads: one prompt, c prompts, c rows."""
    return tuple(sorted({PROMPT_LEN, prompt_rows(c), c}))


def prompt_rate(rate: dict[int, float], c: int) -> float:
    """GFLOP/s the bound gives the prompts of a closed loop of c (rates recorded before 2,048 rows were measured:
    one prompt's)."""
    return max(rate[PROMPT_LEN], rate.get(prompt_rows(c), 0.0))


@dataclass
class Server:
    name: str
    cmd: list[str]
    model_name: str  # what requests send as "model"
    kernel: str  # key into the measured GEMM rates
    weight_bytes: int
    length_by: str = "ignore_eos"  # how the output length is forced: ignore_eos | min_tokens | generation_config
    extra_body: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    missing: str | None = None  # why it cannot run here
    workloads: tuple[str, ...] | None = None  # None: all that were asked for
    kv_bytes: int = 4  # bytes per cached K or V element


@dataclass(frozen=True)
class AttentionShape:
    """What a model's attention reads and computes per query: heads, KV heads, head dim, and the window of each
    layer (None: every earlier key)."""

    heads: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]

    @classmethod
    def of(cls, cfg: ModelConfig) -> AttentionShape:
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tuple(
            cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types
            if t in ("full_attention", "sliding_attention")))

    def keys(self, context: float) -> float:
        """Keys one query sees, summed over the layers, at `context` tokens (its own included)."""
        return sum(context if w is None else min(context, w) for w in self.windows)

    def flops(self, context: float) -> float:
        """q.k and p.v FLOPs of one query at `context` tokens, all layers."""
        return 4 * self.heads * self.head_dim * self.keys(context)

    def kv_bytes(self, context: float, elem_bytes: int) -> float:
        """K and V bytes one decode query reads at `context` tokens, all layers."""
        return 2 * self.kv_heads * self.head_dim * elem_bytes * self.keys(context)


# ---- measured rates ------------------------------------------------------------------------------
def isas() -> dict[str, str]:
    """The instruction sets each side runs here (the environment limits them: module docstring)."""
    from firstlight import kernels

    out = {"firstlight kernels": kernels.load_kernel() or "none (aten)",
           "ATen": torch.backends.cpu.get_cpu_capability(),
           "oneDNN max": os.environ.get("ONEDNN_MAX_CPU_ISA", "all")}
    if importlib.util.find_spec("llama_cpp") is not None:
        try:
            import llama_cpp

            info = llama_cpp.llama_print_system_info().decode()
            out["llama.cpp"] = " ".join(f for f in ("AVX2", "AVX512", "AVX512_VNNI", "AVX_VNNI")
                                        if f"{f} = 1" in info) or "none of AVX2 / AVX-512"
        except Exception as e:  # noqa: BLE001 - a broken peer install: say so, the run still reports it skipped
            out["llama.cpp"] = f"unknown ({type(e).__name__})"
    return out


KERNELS = ("fp32", "fp32-blas", "int8", "int4", "w4a8", "w8a8")


def kernel_rates(ms: tuple[int, ...], shapes: list[tuple[int, int, int]],
                 formats: tuple[str, ...] = KERNELS) -> dict[str, dict[int, float]]:
    """GFLOP/s of each kernel at M rows over the model's own linears, hot: shapes = (N, K, copies per forward
    token) of one layer's linears (copies: the number of layers) and a slice of the head (copies: the head's
    rows / the slice's); the rate = their FLOPs / the time of one pass, each shape timed on its own, repeated.
    A shape is timed as it is and with its rows repeated (`rows_rep`), and the faster per row counts: a small
    call (M = 1 x 576 x 576 is 0.7 MFLOP) pays ~20 us of Python module, dispatch and thread wake-up that the
    native decode step does not, and with the shape alone the int4 single-stream bound came out at 80 tok/s
    against a measured 102.5 (2026-12-04); repeated, the same kernel ran 1.6-3.2x faster per row."""
    import copy

    from firstlight.quant import get_format
    from firstlight.quant.f32 import use_f32_kernel

    flops = {m: 0.0 for m in ms}
    secs = {f: {m: 0.0 for m in ms} for f in formats}
    with torch.inference_mode():
        for n, k, copies in shapes:
            rep_of = {m: rows_rep(m, n, k) for m in ms}
            best = {f: {m: math.inf for m in ms} for f in formats}  # seconds per call of the shape's own N rows
            for rep in sorted({1, *rep_of.values()}):
                lin = torch.nn.Linear(k, n * rep, bias=False).requires_grad_(False)
                ours = copy.deepcopy(lin)
                use_f32_kernel(ours)  # what `firstlight serve` runs fp32 linears on (f32_mm, oneDNN above onednn_min_rows())
                layers = {"fp32": ours, "fp32-blas": lin,
                          **{f: get_format(f).quantize_linear(lin) for f in formats if not f.startswith("fp32")}}
                for m in ms:
                    if rep not in (1, rep_of[m]):
                        continue
                    x = torch.randn(m, k)
                    calls = max(3, int(4e8 // (2 * m * k * n * rep)))  # ~1 ms or more per sample
                    for name in formats:
                        def run(layer=layers[name], x=x, calls=calls) -> None:
                            for _ in range(calls):
                                layer(x)
                        run()
                        best[name][m] = min(best[name][m], median_time(run, 5) / calls / rep)
            for m in ms:
                flops[m] += 2 * m * k * n * copies
                for name in formats:
                    secs[name][m] += best[name][m] * copies
    return {name: {m: flops[m] / secs[name][m] / 1e9 for m in ms} for name in formats}


def rows_rep(m: int, n: int, k: int, min_flops: float = 4e7, max_bytes: float = 16e6) -> int:
    """How many times kernel_rates repeats a shape's N rows so one call does >= min_flops (its fixed cost then
    weighs little), while its fp32 weight stays <= max_bytes (hot in this machine's 32 MB L3: the rate is
    compute, the memory side of the bound is the copy bandwidth's)."""
    return max(1, min(math.ceil(min_flops / (2 * m * n * k)), int(max_bytes // (4 * n * k))))


def model_shapes(model: torch.nn.Module, head_slice: int = 4096) -> list[tuple[int, int, int]]:
    """(N, K, copies) of the model's linears for kernel_rates: the first layer's (times the number of layers)
    and head_slice rows of the head (times its rows / head_slice: a slice that stays in cache, as the layers' do)."""
    layers = model.layers
    shapes = [(*m.weight.shape, len(layers)) for m in layers[0].modules() if isinstance(m, torch.nn.Linear)]
    vocab, hidden = model.lm_head.weight.shape
    rows = min(vocab, head_slice)
    return [*shapes, (rows, hidden, vocab / rows)]


def model_work(path: Path) -> tuple[int, int, AttentionShape, list[tuple[int, int, int]]]:
    """What the bounds need of the model at `path`: its matmul parameters, the head's, its attention shape, and
    the linear shapes kernel_rates times."""
    from firstlight.models.loader import load_model

    model, _ = load_model(path, with_tokenizer=False)
    params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return params, model.lm_head.weight.numel(), AttentionShape.of(model.config), model_shapes(model)


def step_s(weight_bytes: int, params: int, bw_gbs: float, rate: dict[int, float], c: int, context: float,
           attn: AttentionShape | None = None, kv_bytes: int = 4) -> float:
    """The least time of a decode step of c rows whose queries see `context` keys (attn None: the matmuls alone,
    as summaries recorded before attention was counted)."""
    kv, flops = (attn.kv_bytes(context, kv_bytes), attn.flops(context)) if attn else (0.0, 0.0)
    return max((weight_bytes + c * kv) / (bw_gbs * 1e9), c * (2 * params + flops) / (rate[c] * 1e9))


def bound_phases_s(weight_bytes: int, params: int, head_params: int, bw_gbs: float, rate: dict[int, float], c: int,
                   output_len: int, prompt_len: float = PROMPT_LEN, attn: AttentionShape | None = None,
                   kv_bytes: int = 4) -> tuple[float, float]:
    """The least time of a closed loop of c requests (prompt, output_len): (the c prompts, the decode steps)."""
    p = round(prompt_len)
    attn_flops = sum(attn.flops(i) for i in range(1, p + 1)) if attn else 0.0  # the causal prompt
    prefill_s = (2 * (prompt_len * (params - head_params) + head_params) + attn_flops) / (prompt_rate(rate, c) * 1e9)
    decode_s = sum(step_s(weight_bytes, params, bw_gbs, rate, c, p + j, attn, kv_bytes)
                   for j in range(1, output_len))  # step j: each row's query sees p + j keys
    return c * prefill_s, decode_s


def bound_tok_s(weight_bytes: int, params: int, head_params: int, bw_gbs: float, rate: dict[int, float], c: int,
                output_len: int, prompt_len: float = PROMPT_LEN, attn: AttentionShape | None = None,
                kv_bytes: int = 4) -> float:
    """Output tok/s of a closed loop of c requests (prompt, output_len) no server can beat here."""
    return c * output_len / sum(bound_phases_s(weight_bytes, params, head_params, bw_gbs, rate, c, output_len,
                                               prompt_len, attn, kv_bytes))


# ---- the servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(args: argparse.Namespace, port: int) -> list[Server]:
    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant import apply_quantization, model_weight_bytes

    path = hub.resolve(args.model)
    out = []
    base = [PY, "-m", "firstlight.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(args.threads), "--max-num-seqs", "32"]
    for fmt in ("fp32", "int8", "int4", "w4a8", "w8a8"):
        kv16 = f"firstlight-{fmt}-kv16" in args.servers  # the same with --kv-cache-dtype fp16
        if f"firstlight-{fmt}" not in args.servers and not kv16 and not (fmt == "fp32" and "hf-serve" in args.servers):
            continue
        model, tok = load_model(path)
        apply_quantization(model, None if fmt == "fp32" else fmt, tokenizer=tok)  # GPTQ results come from cache
        cmd = base + ["--quantization", "none" if fmt == "fp32" else fmt]
        out.append(Server(f"firstlight-{fmt}", cmd, args.model, fmt, model_weight_bytes(model)))
        out.append(Server(f"firstlight-{fmt}-kv16", cmd + ["--kv-cache-dtype", "fp16"], args.model, fmt,
                          model_weight_bytes(model), kv_bytes=2))
        del model
    if "firstlight-int4-compiled" in args.servers:  # single stream and startup only (graphs built on first use)
        int4 = next(s for s in out if s.kernel == "int4") if any(s.kernel == "int4" for s in out) else None
        wb = int4.weight_bytes if int4 else 0
        out.append(Server("firstlight-int4-compiled", base + ["--quantization", "int4", "--compile-decode"],
                          args.model, "int4", wb, workloads=("single",)))
    hf = Server("hf-serve", ["transformers", "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
                             "--host", "127.0.0.1", "--port", str(port), str(path)],
                str(path), "fp32-blas", 0, length_by="generation_config")
    hf.weight_bytes = next((s.weight_bytes for s in out if s.name == "firstlight-fp32"), 0)
    hf.cmd[0] = str(Path(PY).with_name("transformers"))
    if not Path(hf.cmd[0]).exists():
        hf.missing = f"{hf.cmd[0]} not found (pip install transformers[serving])"
    out.append(hf)
    gguf = Path(args.gguf_dir) / hub.KNOWN_MODELS[args.model].gguf_name if args.model in hub.KNOWN_MODELS else None
    ll = Server("llama-cpp", [PY, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                              "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch",
                              str(args.threads), "--n_ctx", "4096", "--model_alias", args.model,
                              "--interrupt_requests", "False"],  # default: a new request cuts the running stream
                args.model, "w4a8", 0, length_by="min_tokens", kv_bytes=2)  # its KV cache: f16
    # llama.cpp's own server (`make bench-peers-server`): parallel slots with continuous batching, where
    # llama-cpp-python's server answers one request at a time. 1,024 tokens of context per slot.
    ls = Server("llama-server", [str(LLAMA_SERVER), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                 "--threads", str(args.threads), "--threads-batch", str(args.threads),
                                 "--parallel", "32", "--ctx-size", str(32 * 1024), "--alias", args.model],
                args.model, "w4a8", 0, kv_bytes=2)
    if importlib.util.find_spec("llama_cpp") is None:
        ll.missing = "llama-cpp-python is not installed (make bench-peers builds it)"
    if not LLAMA_SERVER.is_file():
        ls.missing = f"{LLAMA_SERVER} not found (make bench-peers-server builds it)"
    for peer in (ll, ls):
        if gguf is None:
            peer.missing = f"{args.model} has no GGUF in the hub"
        if peer.missing or peer.name not in args.servers:
            continue
        if not gguf.is_file():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            hub.obtain_gguf(hub.KNOWN_MODELS[args.model], gguf.parent)
        peer.weight_bytes = gguf.stat().st_size
    out += [ll, ls]
    return [s for s in out if s.name in args.servers]


def start(server: Server, threads: int, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(Path(__file__).parents[1]), **server.env}
    proc = subprocess.Popen(server.cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{server.name} did not answer /v1/models in 900 s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(server: Server, port: int, out: Path, tokenizer: str, bench_root: str, *extra: str) -> dict:
    cmd = [PY, "-m", "firstlight.cli", "bench", "run", "--url", f"http://127.0.0.1:{port}", "--model",
           server.model_name, "--tokenizer", tokenizer, "--out", str(out), "--no-plots", "--seed", "0",
           "--cache-bust",  # a fresh nonce per run: no run reuses another's prompts from a prefix cache
           "--ignore-eos" if server.length_by == "ignore_eos" else "--no-ignore-eos", *extra]
    if server.extra_body:
        cmd += ["--extra-body", json.dumps(server.extra_body)]
    subprocess.run(cmd, cwd=bench_root, check=False, capture_output=True, text=True, timeout=3600)
    path = out / "result.json"
    return json.loads(path.read_text())["metrics"] if path.is_file() else {"error": "no result.json"}


def first_request_s(server: Server, port: int) -> float:
    """Wall time of one completion of 2 tokens (a prefill and one decode step)."""
    body = {"model": server.model_name, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        r.read()
    return time.perf_counter() - t0


def force_length(server: Server, n: int) -> None:
    if server.length_by == "generation_config":  # transformers serve rejects ignore_eos; it reads this field
        server.extra_body = {"generation_config": json.dumps({"min_new_tokens": n, "max_new_tokens": n,
                                                              "do_sample": False})}
    elif server.length_by == "min_tokens":  # llama-cpp-python ignores ignore_eos; it has min_tokens
        server.extra_body = {"min_tokens": n}


def run_server(server: Server, args: argparse.Namespace, port: int, out: Path) -> dict:
    res: dict = {"name": server.name}
    t0 = time.perf_counter()
    proc = start(server, args.threads, port, out / f"{server.name}.log")
    res["startup_s"] = time.perf_counter() - t0
    tok = str(args.tokenizer)
    workloads = [w for w in args.workloads if server.workloads is None or w in server.workloads]
    try:
        res["first_request_s"] = first_request_s(server, port)  # prefill + 1 decode step (compiles, if it does)
        res["second_request_s"] = first_request_s(server, port)
        common = ["--input-len", str(PROMPT_LEN)]
        if "single" in workloads:
            force_length(server, SINGLE_OUT)
            res["single"], res["bound_single"] = measured_beside(server, args, (1, PROMPT_LEN), lambda: bench(
                server, port, out / server.name / "single", tok, args.bench_root, *common, "--output-len",
                str(SINGLE_OUT), "--concurrency", "1", "--num-requests", "3", "--warmup-requests", "1"))
            if server.name.startswith("llama"):
                res["single"]["own_decode_tok_s"] = llama_eval_tok_s(out / f"{server.name}.log", 3)
        if "closed" in workloads:
            force_length(server, CLOSED_OUT)
            for c in args.concurrency:
                n = args.num_requests_c1 if c == 1 else args.num_requests
                res[f"c{c}"], res[f"bound_c{c}"] = measured_beside(server, args, bound_ms(c), lambda c=c, n=n: bench(
                    server, port, out / server.name / f"c{c}", tok, args.bench_root, *common, "--output-len",
                    str(CLOSED_OUT), "--concurrency", str(c), "--num-requests", str(n), "--warmup-requests", "1"))
        if "poisson" in workloads:
            server.extra_body = {}
            for rate in args.rates:
                res[f"rate{rate}"] = bench(server, port, out / server.name / f"rate{rate}", tok, args.bench_root,
                                           "--input-len", "lognormal:128:0.5", "--output-len", "lognormal:32:0.5",
                                           "--rate", str(rate), "--arrival", "poisson", "--num-requests",
                                           str(args.poisson_requests), "--slo", args.slo, "--timeout", "600")
    finally:
        stop(proc)
    return res


def llama_eval_tok_s(log: Path, n: int) -> float | None:
    """llama.cpp's own decode rate over the last n single-stream requests: the median of the `eval time` lines
    (llama_decode's time, no HTTP, sampling or Python) of the requests that decoded SINGLE_OUT - 1 tokens."""
    runs = [(float(ms), int(k)) for ms, k in re.findall(  # llama-cpp-python's log: "N runs"; llama-server's: "N tokens"
        r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)", log.read_text())]
    rates = [1e3 * k / ms for ms, k in runs if k >= SINGLE_OUT - 1 and ms > 0][-n:]
    return statistics.median(rates) if rates else None


def measured_beside(server: Server, args: argparse.Namespace, ms: tuple[int, ...],
                    run: Callable[[], dict]) -> tuple[dict, dict]:
    """run() and the bound's inputs measured just before and just after it (memory bandwidth, the server's kernel
    at M in ms): this machine's speed moves by up to 2x within minutes, so a bound measured once at the start can
    sit in another phase than the run it bounds. The bound then uses the mean of the two measurements."""
    def inputs() -> tuple[float, dict[int, float]]:
        return memory_bandwidth_gbs(), kernel_rates(tuple(sorted(set(ms))), args.shapes, (server.kernel,))[server.kernel]
    bw0, r0 = inputs()
    metrics = run()
    bw1, r1 = inputs()
    return metrics, {"copy_bandwidth_gbs": [bw0, bw1], "gemm_gflops": {m: [r0[m], r1[m]] for m in r0}}


def beside(r: dict, key: str, bw: float, rate: dict[int, float]) -> tuple[float, dict[int, float]]:
    """The bound's inputs measured beside workload `key` of result r (their mean), else the run-wide ones."""
    b = r.get(f"bound_{key}")
    if not b:
        return bw, rate
    return sum(b["copy_bandwidth_gbs"]) / 2, {**rate, **{int(m): sum(v) / 2 for m, v in b["gemm_gflops"].items()}}


def median_of(runs: list) -> object:
    """The rounds' values of one field as one: numbers by their median, lists element by element, dicts key by key,
    anything else (names) as the first round has it."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs if isinstance(r, dict) and k in r]) for k in first}
    if isinstance(first, list) and all(isinstance(r, list) and len(r) == len(first) for r in runs):
        return [median_of(list(v)) for v in zip(*runs, strict=True)]
    nums = [r for r in runs if isinstance(r, int | float) and not isinstance(r, bool)]
    return statistics.median(nums) if nums and len(nums) == len(runs) else first


def merge_rounds(rs: list[dict]) -> dict:
    """One server's result over its rounds: every figure the median of the rounds' (the tables print these), and
    the rounds themselves under "rounds" (the per-round table and its same-round ratios read those)."""
    if len(rs) == 1:
        return rs[0]
    merged = {**median_of(rs), "rounds": rs}
    del merged["round"]
    return merged


ROUND_METRICS = (  # (label, value of one round's result, higher is better)
    ("decode tok/s", lambda r: (r.get("single") or {}).get("tokens_per_s_per_user"), True),
    ("decode tok/s, ours served vs llama.cpp's own eval time", lambda r: (r.get("single") or {}).get(
        "own_decode_tok_s" if r["name"].startswith("llama") else "tokens_per_s_per_user"), True),
    ("TTFT ms", lambda r: ((r.get("single") or {}).get("ttft_ms") or {}).get("median"), False),
)


def round_metrics(concurrency: list[int]) -> tuple:
    return ROUND_METRICS + tuple((f"c={c} tok/s", lambda r, c=c: (r.get(f"c{c}") or {}).get("output_throughput"), True)
                                 for c in concurrency)


def rounds_of(s: dict) -> int:
    """How many rounds the summary's servers ran (1: a summary of one round, or of before --rounds)."""
    return max((len(r.get("rounds", ())) for r in s["results"]), default=1) or 1


def print_rounds(s: dict, args: argparse.Namespace) -> None:
    """Per metric, every server's figure in each round (servers alternate order round by round), their median, and
    each firstlight server's advantage over the best peer of the same round (ours / peer's for rates, peer's / ours
    for TTFT; > 1 is better): the median of those same-round ratios, and their range, is the comparison to quote
    on a machine whose speed drifts between runs."""
    n = rounds_of(s)
    if n < 2:
        return
    peers = [r for r in s["results"] if not r["name"].startswith("firstlight")]
    print(f"\nPer round ({n} rounds, server order alternating): value per round | median | vs the best peer of "
          "each round, median (min-max)")
    for label, get, higher in round_metrics(args.concurrency):
        by_round = {r["name"]: {x["round"]: get(x) for x in r.get("rounds", [r])} for r in s["results"]}
        if not any(v is not None for vals in by_round.values() for v in vals.values()):
            continue
        print(f"\n| {label} | " + " | ".join(f"round {i + 1}" for i in range(n)) + " | median | vs best peer |")
        print("|---|" + "---:|" * (n + 2))
        for r in s["results"]:
            vals = by_round[r["name"]]
            ratios = []
            for i, v in vals.items():
                best = [p for p in (by_round[q["name"]].get(i) for q in peers) if p]
                if v and best and r["name"].startswith("firstlight"):
                    ratios.append(v / max(best) if higher else min(best) / v)
            present = [v for v in vals.values() if v is not None]
            vs = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
            print(f"| {r['name']} | " + " | ".join(fmt(vals.get(i)) for i in range(n))
                  + f" | {fmt(statistics.median(present) if present else None)} | {vs} |")


def fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--servers", default="firstlight-fp32,firstlight-int8,firstlight-int4,firstlight-w4a8,firstlight-w8a8,"
                    "firstlight-int4-compiled,hf-serve,llama-cpp,llama-server")
    ap.add_argument("--workloads", default="single,closed,poisson")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--num-requests-c1", type=int, default=8)
    ap.add_argument("--rates", default="0.5,1,2")
    ap.add_argument("--poisson-requests", type=int, default=24)
    ap.add_argument("--slo", default="ttft=2s,tpot=250ms")
    ap.add_argument("--gguf-dir", default=str(Path.home() / ".cache" / "firstlight" / "gguf"))
    ap.add_argument("--bench-root", default=str(Path(__file__).parents[1]),
                    help="repository root whose `firstlight bench` client runs the workloads")
    ap.add_argument("--out", default="/tmp/firstlight-servers")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every server this many times, in alternating order; tables print medians, and a "
                         "per-round table the same-round ratios against the best peer")
    ap.add_argument("--tables", type=Path, help="print the tables of a servers.json written earlier, run nothing")
    args = ap.parse_args()
    args.servers = args.servers.split(",")
    args.workloads = args.workloads.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.tables:
        summary = json.loads(args.tables.read_text())
        summary["gemm_gflops"] = {k: {int(m): r for m, r in v.items()} for k, v in summary["gemm_gflops"].items()}
        print_tables(summary, args)
        return
    torch.set_num_threads(args.threads)
    from firstlight.models import hub

    args.tokenizer = hub.resolve(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params, head_params, attn, shapes = model_work(args.tokenizer)
    args.shapes = shapes
    bw = memory_bandwidth_gbs()
    rates = kernel_rates(tuple(sorted({1, *(m for c in args.concurrency for m in bound_ms(c))})), shapes)
    port = free_port()
    load0 = os.getloadavg()
    runs: dict[str, list[dict]] = {}  # per server, its result in each round
    results: list[dict] = []
    skipped: dict[str, str] = {}
    order = servers(args, port)
    for rnd in range(args.rounds):
        for server in order if rnd % 2 == 0 else order[::-1]:  # alternate: drift hits every server alike
            if server.missing:
                if rnd == 0:
                    skipped[server.name] = server.missing
                    print(f"skip {server.name}: {server.missing}", flush=True)
                continue
            print(f"running {server.name}{f' (round {rnd + 1} of {args.rounds})' if args.rounds > 1 else ''} ...",
                  flush=True)
            rdir = out / f"round{rnd + 1}" if args.rounds > 1 else out
            rdir.mkdir(parents=True, exist_ok=True)
            try:
                r = run_server(server, args, port, rdir)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                skipped[server.name] = str(e)
                print(f"  failed: {e}", flush=True)
                continue
            r["kernel"], r["weight_bytes"], r["kv_bytes"] = server.kernel, server.weight_bytes, server.kv_bytes
            r["round"] = rnd
            runs.setdefault(server.name, []).append(r)
            results = [merge_rounds(rs) for rs in runs.values()]
            (out / "servers.json").write_text(json.dumps({"results": results, "skipped": skipped}, indent=1))
    load1 = os.getloadavg()
    summary = {"model": args.model, "threads": args.threads, "isas": isas(), "copy_bandwidth_gbs": bw, "gemm_gflops": rates,
               "matmul_params": params, "head_params": head_params, "attention": dataclasses.asdict(attn),
               "load_average": [load0, load1], "results": results, "skipped": skipped, "slo": args.slo}
    (out / "servers.json").write_text(json.dumps(summary, indent=1))
    print_tables(summary, args)


def print_tables(s: dict, args: argparse.Namespace) -> None:
    bw, rates, params = s["copy_bandwidth_gbs"], s["gemm_gflops"], s["matmul_params"]
    head = s.get("head_params", 0)  # runs before it was recorded: logits of every prompt token
    a = s.get("attention")  # None in summaries recorded before attention was counted
    attn = AttentionShape(**{**a, "windows": tuple(a["windows"])}) if a else None
    la = s["load_average"]
    beside_runs = any(k.startswith("bound_") for r in s["results"] for k in r)
    print(f"\n{s['model']}, {s['threads']} threads; memory bandwidth {bw:.1f} GB/s; GEMM GFLOP/s at M="
          f"{'/'.join(str(m) for m in sorted(next(iter(rates.values()))))}"
          f"{' (at the start; each bound below uses the rates measured beside its run)' if beside_runs else ''}: "
          + "; ".join(
              f"{k} " + "/".join(f"{v[m]:.0f}" for m in sorted(v)) for k, v in rates.items())
          + f"; load average {la[0][0]:.1f} before, {la[1][0]:.1f} after, on {os.cpu_count()} CPUs"
          + (f"; every figure the median of {rounds} rounds" if (rounds := rounds_of(s)) > 1 else "")
          + "".join(f"; {k}: {v}" for k, v in s.get("isas", {}).items()))
    print("\n| server | weights MB | decode tok/s (bound) | TTFT ms | " + " | ".join(
        f"c={c} tok/s (bound)" for c in args.concurrency) + " | out tok/req | start s | 1st / 2nd request s |")
    print("|---|---:|---:|---:|" + "---:|" * len(args.concurrency) + "---:|---:|---:|")
    for r in s["results"]:
        rate = {int(k): v for k, v in rates[r["kernel"]].items()}
        wb = r["weight_bytes"]
        single = r.get("single", {})
        dec = single.get("tokens_per_s_per_user")
        kvb = r.get("kv_bytes", 4)
        sent = round((single.get("input_tokens") or {}).get("mean") or PROMPT_LEN)
        bw1, rate1 = beside(r, "single", bw, rate)
        dec_bound = (SINGLE_OUT - 1) / sum(step_s(wb, params, bw1, rate1, 1, sent + j, attn, kvb)
                                           for j in range(1, SINGLE_OUT))
        cells = []
        outs = []
        for c in args.concurrency:
            m = r.get(f"c{c}", {})
            sent = (m.get("input_tokens") or {}).get("mean") or PROMPT_LEN
            bw1, rate1 = beside(r, f"c{c}", bw, rate)
            bound = bound_tok_s(wb, params, head, bw1, rate1, c, CLOSED_OUT, sent, attn, kvb)
            cells.append(f"{fmt(m.get('output_throughput'))} ({bound:.0f})")
            outs.append(fmt((m.get("output_tokens") or {}).get("mean"), 0))
        ttft = (single.get("ttft_ms") or {}).get("median")
        print(f"| {r['name']} | {wb / 1e6:.0f} | {fmt(dec)} ({dec_bound:.0f}) | {fmt(ttft, 0)} | " + " | ".join(cells)
              + f" | {'/'.join(outs)} | {r['startup_s']:.0f} | {fmt(r.get('first_request_s'), 2)} / "
              f"{fmt(r.get('second_request_s'), 2)} |")
    for r in s["results"]:
        if own := (r.get("single") or {}).get("own_decode_tok_s"):
            print(f"{r['name']}: its own decode rate (llama.cpp's `eval time`: no HTTP, sampling or Python) {own:.1f} tok/s")
    rate_keys = [k for k in (s["results"][0] if s["results"] else {}) if k.startswith("rate")]
    if rate_keys:
        print(f"\nPoisson arrivals, lognormal lengths; goodput (req/s meeting {s['slo']}) / output tok/s / errors")
        print("| server | " + " | ".join(f"{k[4:]} req/s" for k in rate_keys) + " |")
        print("|---|" + "---|" * len(rate_keys))
        for r in s["results"]:
            cells = []
            for k in rate_keys:
                m = r.get(k, {})
                cells.append(f"{fmt(m.get('goodput'), 2)} / {fmt(m.get('output_throughput'))} / {m.get('num_errors', '-')}")
            print(f"| {r['name']} | " + " | ".join(cells) + " |")
    print_rounds(s, args)
    for name, why in s["skipped"].items():
        print(f"skipped {name}: {why}")


if __name__ == "__main__":
    main()
