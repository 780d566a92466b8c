"""Heads training: learns, checkpoints and resumes exactly, runs data-parallel on 2 processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from firstlight.engine.speculative.medusa import load_heads, model_name
from firstlight.errors import FirstlightError
from firstlight.models.loader import load_model
from firstlight.train.heads import HeadsTrainConfig, train_heads

SMALL = dict(batch_size=4, prefix_len=8, gen_len=12, lr=3e-3, progress=False)


def _params(path, model):
    heads, meta = load_heads(path, model.config, model_name(model.config))
    return torch.cat([p.flatten() for p in heads.parameters()]), meta


def test_training_lowers_the_held_out_loss_and_writes_heads_next_to_the_model(tiny_dir, tmp_path):
    from firstlight.engine.speculative.medusa import MedusaHeads
    from firstlight.train.heads import heads_loss, self_distill_batch

    train_heads(HeadsTrainConfig(model=str(tiny_dir), out=str(tmp_path / "b.safetensors"), steps=30,
                                 positions_per_row=None, **dict(SMALL, lr=1e-2)))
    model, _ = load_model(tiny_dir)
    trained, _ = load_heads(tmp_path / "b.safetensors", model.config, model_name(model.config))
    prompts = torch.tensor([[1, 5, 9, 33, 70, 2, 200, 11], [1, 300, 12, 13, 14, 90, 91, 92]])  # not a corpus chunk
    hidden, logits = self_distill_batch(model, prompts, 12)
    with torch.no_grad():
        gen = torch.Generator()
        before, _ = heads_loss(model, MedusaHeads(64, 4), hidden, logits, 7, None, gen)
        after, _ = heads_loss(model, trained, hidden, logits, 7, None, gen)
    assert float(after) < 0.9 * float(before)
    # the default output lives next to the model
    train_heads(HeadsTrainConfig(model=str(tiny_dir), steps=1, **SMALL))
    model, _ = load_model(tiny_dir)
    _, meta = _params(tiny_dir / "firstlight_heads.safetensors", model)
    assert meta["num_heads"] == "4" and meta["steps"] == "1"


def test_checkpoint_resume_matches_an_uninterrupted_run(tiny_dir, tmp_path):
    full = tmp_path / "full.safetensors"
    train_heads(HeadsTrainConfig(model=str(tiny_dir), out=str(full), steps=6, checkpoint_every=3, **SMALL))
    part = tmp_path / "part.safetensors"
    train_heads(HeadsTrainConfig(model=str(tiny_dir), out=str(part), steps=3, checkpoint_every=3, **SMALL))
    resumed = train_heads(HeadsTrainConfig(model=str(tiny_dir), out=str(part), steps=6, checkpoint_every=3, **SMALL))
    assert resumed["steps_this_run"] == 3
    model, _ = load_model(tiny_dir)
    # positions are subsampled with a per-run generator, so compare without subsampling
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    cfg = dict(SMALL, positions_per_row=None)
    train_heads(HeadsTrainConfig(model=str(tiny_dir), out=str(a), steps=4, checkpoint_every=2, **cfg))
    train_heads(HeadsTrainConfig(model=str(tiny_dir), out=str(b), steps=2, checkpoint_every=2, **cfg))
    train_heads(HeadsTrainConfig(model=str(tiny_dir), out=str(b), steps=4, checkpoint_every=2, **cfg))
    pa, pb = _params(a, model)[0], _params(b, model)[0]
    assert torch.allclose(pa, pb, atol=1e-6)


def test_empty_corpus_is_a_clear_error(tiny_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(FirstlightError, match="is empty"):
        train_heads(HeadsTrainConfig(model=str(tiny_dir), corpus=str(empty), out=str(tmp_path / "h.safetensors"), steps=1, **SMALL))


def test_bad_settings_are_clear_errors(tiny_dir):
    with pytest.raises(FirstlightError, match="--gen-len"):
        HeadsTrainConfig(model=str(tiny_dir), gen_len=3)


def test_two_process_data_parallel_equals_one_process_with_the_combined_batch(tiny_dir, tmp_path):
    """torchrun --nproc_per_node 2 (gloo): gradients are averaged, so 2 x batch 2 == 1 x batch 4."""
    cfg = dict(SMALL, positions_per_row=None)
    cfg.pop("batch_size")
    one = tmp_path / "one.safetensors"
    train_heads(HeadsTrainConfig(model=str(tiny_dir), out=str(one), steps=3, batch_size=4, **cfg))
    two = tmp_path / "two.safetensors"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "firstlight.train.cli", "heads",
           "--model", str(tiny_dir), "--out", str(two), "--steps", "3", "--batch-size", "2", "--prefix-len", "8",
           "--gen-len", "12", "--lr", "3e-3", "--positions-per-row", "0", "--threads", "1", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(two.with_suffix(".json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    model, _ = load_model(tiny_dir)
    a, b = _params(one, model)[0], _params(two, model)[0]
    # equal up to float reassociation (one Adam step moves a weight by ~lr = 3e-3)
    assert torch.allclose(a, b, atol=1e-4)
