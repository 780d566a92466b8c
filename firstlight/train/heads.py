"""Train Medusa heads by self-distillation (Cai et al. 2024, §2.3.2): the labels are the target's
own next-token distributions on text the target itself wrote, so the heads learn to predict what
the target will say, not what the corpus says.

One step, per rank:
  1. take `batch_size` corpus chunks of `prefix_len` tokens as prompts,
  2. let the frozen target continue each greedily for `gen_len` tokens (batched, contiguous KV),
     keeping its final hidden states h_t and logits at every position,
  3. head i at position t is trained to match the target's distribution at position t+1+i
     (soft cross-entropy), at `positions_per_row` random positions of the generated part,
  4. AdamW on the heads only; DistributedDataParallel averages gradients across ranks.

Checkpoints (heads + optimizer + step) go to `<out>.ckpt` every `checkpoint_every` steps; a rerun
with the same arguments resumes there. The result is a safetensors file (medusa.py) next to the model.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from firstlight.engine.speculative.medusa import MedusaHeads, default_heads_path, model_name, save_heads
from firstlight.errors import FirstlightError
from firstlight.models.kv_cache import ContiguousKVCache
from firstlight.train.data import batches, token_chunks
from firstlight.train.distributed import DistInfo, all_reduce_mean, init_distributed, shutdown_distributed


@dataclass
class HeadsTrainConfig:
    model: str
    corpus: str = "hamlet-sample"
    out: str | None = None  # default: <model dir>/firstlight_heads.safetensors
    num_heads: int = 4
    steps: int = 200
    batch_size: int = 8  # per rank
    prefix_len: int = 32
    gen_len: int = 64
    positions_per_row: int | None = 32  # None: every generated position
    lr: float = 1e-3
    checkpoint_every: int = 25
    resume: bool = True
    seed: int = 0
    device: str = "cpu"
    max_corpus_tokens: int = 200_000  # prompts are taken from the first tokens of the corpus
    progress: bool = True
    summary: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("num_heads", "steps", "batch_size", "prefix_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise FirstlightError(f"heads training: --{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.gen_len < self.num_heads + 2:
            raise FirstlightError(f"heads training: --gen-len must be >= num_heads + 2 = {self.num_heads + 2}, got {self.gen_len}")
        if self.positions_per_row is not None and self.positions_per_row < 1:
            raise FirstlightError(f"heads training: --positions-per-row must be >= 1, got {self.positions_per_row}")


@torch.no_grad()
def self_distill_batch(model: Any, prompts: torch.Tensor, gen_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target continues prompts [B, P] greedily; returns hidden [B, S, E] and logits [B, S, V] at
    every position S = P + gen_len - 1 (position t's logits predict token t+1)."""
    cfg = model.config
    b, p = prompts.shape
    dev = prompts.device
    dtype = next(model.parameters()).dtype
    cache = ContiguousKVCache(cfg.num_layers, b, cfg.num_kv_heads, cfg.head_dim, p + gen_len, dtype, dev)
    pos = torch.arange(p, device=dev).expand(b, p)
    hiddens = [model.forward_hidden(prompts, pos, cache)]  # [B, P, E]
    logits = [model.compute_logits(hiddens[0])]
    for step in range(gen_len - 1):
        tok = logits[-1][:, -1].argmax(-1, keepdim=True)  # [B, 1]
        h = model.forward_hidden(tok, torch.full((b, 1), p + step, device=dev), cache)
        hiddens.append(h)
        logits.append(model.compute_logits(h))
    return torch.cat(hiddens, 1), torch.cat(logits, 1)


def heads_loss(model: Any, heads: torch.nn.Module, hidden: torch.Tensor, logits: torch.Tensor, first: int,
               positions_per_row: int | None, gen: torch.Generator) -> tuple[torch.Tensor, list[float]]:
    """KL(target at t+1+i || head i at t), over positions t >= first (soft cross-entropy minus the
    target's entropy: same gradient, and 0 means the heads match the target exactly).

    Returns the loss and each head's top-1 agreement with the target's argmax (its greedy acceptance
    rate given all earlier heads were right)."""
    b, s, _ = hidden.shape
    num_heads = heads.module.num_heads if hasattr(heads, "module") else heads.num_heads
    last = s - 1 - num_heads  # every head has a label at t+1+i <= s-1
    t = torch.arange(first, last + 1, device=hidden.device)
    if positions_per_row is not None and positions_per_row < len(t):
        t = t[torch.randperm(len(t), generator=gen)[:positions_per_row]].sort().values
    h = hidden[:, t]  # [B, T, E]
    pred = model.compute_logits(heads(h)).float()  # [B, T, K, V]
    losses, accs = [], []
    for i in range(num_heads):
        teacher = logits[:, t + 1 + i].float()  # [B, T, V]
        logp, logt = F.log_softmax(pred[:, :, i], -1), F.log_softmax(teacher, -1)
        losses.append((logt.exp() * (logt - logp)).sum(-1).mean())
        accs.append(float((pred[:, :, i].argmax(-1) == teacher.argmax(-1)).float().mean()))
    return torch.stack(losses).mean(), accs


def _progress(enabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]heads"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TextColumn("acc {task.fields[acc]}"), TimeElapsedColumn(), disable=not enabled,
    )


def train_heads(cfg: HeadsTrainConfig) -> dict[str, Any]:
    """Run training (one rank of it when launched by torchrun); returns the summary on every rank."""
    from firstlight.data import load_text
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model

    dist = init_distributed(cfg.device)
    try:
        return _train(cfg, dist, load_text, resolve, load_model)
    finally:
        shutdown_distributed(dist)


def _train(cfg: HeadsTrainConfig, dist: DistInfo, load_text: Any, resolve: Any, load_model: Any) -> dict[str, Any]:
    model_dir = resolve(cfg.model)
    out = Path(cfg.out) if cfg.out else default_heads_path(model_dir)
    ckpt_path = out.with_suffix(".ckpt")
    text = load_text(cfg.corpus)
    model, tok = load_model(model_dir, device=cfg.device)
    model.eval().requires_grad_(False)
    chunks = token_chunks(tok, text, cfg.prefix_len, cfg.max_corpus_tokens)

    torch.manual_seed(cfg.seed)
    heads: torch.nn.Module = MedusaHeads(model.config.hidden_size, cfg.num_heads).to(cfg.device)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    start, prior_s, loss_v, accs = 0, 0.0, float("nan"), [0.0] * cfg.num_heads
    if cfg.resume and ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location=cfg.device, weights_only=True)
        if state["num_heads"] != cfg.num_heads or state["model"] != str(model_dir):
            raise FirstlightError(f"checkpoint {ckpt_path} is for other settings ({state['model']}, {state['num_heads']} heads); "
                                  "delete it or pass --no-resume")
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        prior_s = float(state.get("train_s", 0.0))
        loss_v, accs = float(state.get("loss", loss_v)), list(state.get("accs", accs))
    base = heads
    if dist.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        heads = DistributedDataParallel(heads)
    data = batches(chunks, cfg.batch_size, dist.rank, dist.world_size, cfg.seed, start)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + dist.rank)

    tokens_per_step = cfg.batch_size * (cfg.prefix_len + cfg.gen_len) * dist.world_size
    t0 = time.perf_counter()
    with _progress(cfg.progress and dist.is_main) as bar:
        task = bar.add_task("train", total=cfg.steps, completed=start, loss=float("nan"), tps=0.0, acc="-")
        for step in range(start, cfg.steps):
            prompts = next(data).to(cfg.device)
            hidden, logits = self_distill_batch(model, prompts, cfg.gen_len)
            loss, accs = heads_loss(model, heads, hidden, logits, cfg.prefix_len - 1, cfg.positions_per_row, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_v = all_reduce_mean(float(loss.detach()), dist)
            accs = [all_reduce_mean(a, dist) for a in accs]
            done = step + 1 - start
            tps = done * tokens_per_step / (time.perf_counter() - t0)
            bar.update(task, completed=step + 1, loss=loss_v, tps=tps, acc=" ".join(f"{a:.2f}" for a in accs))
            if dist.is_main and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
                state = {"heads": base.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                         "num_heads": cfg.num_heads, "model": str(model_dir), "loss": loss_v, "accs": accs,
                         "train_s": prior_s + time.perf_counter() - t0}
                torch.save(state, ckpt_path.with_suffix(".ckpt.tmp"))
                ckpt_path.with_suffix(".ckpt.tmp").replace(ckpt_path)
    train_s = time.perf_counter() - t0
    checksum = float(sum(p.detach().double().sum() for p in base.parameters()))
    summary = {
        "model": str(model_dir), "corpus": cfg.corpus, "heads_path": str(out), "steps": cfg.steps,
        "steps_this_run": cfg.steps - start, "world_size": dist.world_size, "backend": dist.backend,
        "train_s": train_s, "train_s_total": prior_s + train_s, "tokens_per_s": (cfg.steps - start) * tokens_per_step / train_s if train_s else 0.0,
        "final_loss": loss_v, "head_top1_agreement": accs, "param_checksum": checksum,
        "threads": torch.get_num_threads(), "config": {k: v for k, v in asdict(cfg).items() if k != "summary"},
    }
    if dist.is_main:
        extra = {"steps": str(cfg.steps), "corpus": cfg.corpus, "final_loss": f"{loss_v:.4f}",
                 "train_s": f"{prior_s + train_s:.1f}",
                 "head_top1_agreement": json.dumps([round(a, 4) for a in accs])}
        save_heads(base, out, model.config, model_name(model.config), extra)
        out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    return summary
