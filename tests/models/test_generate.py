"""The plain generation path: sampling, stopping, streaming text, and the CLI around it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from firstlight.models.generate import GenerationStats, TextStreamer, generate_tokens, sample_token
from firstlight.models.loader import load_model


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_token(logits, 0.0, 1.0, None) == 1


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    seen = {sample_token(logits, 1.0, 0.7, gen) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 >= 0.7: tokens 2 and 3 are never drawn


def test_sampling_is_reproducible_with_a_seed(tiny_dirs):
    model, tok = load_model(tiny_dirs["qwen2"])
    prompt = tok.encode("To be, or not")
    runs = [list(generate_tokens(model, prompt, 12, temperature=4.0, seed=7)) for _ in range(2)]
    other = list(generate_tokens(model, prompt, 12, temperature=4.0, seed=8))
    assert runs[0] == runs[1]
    assert runs[0] != other


def test_stops_at_eos_and_counts(tiny_dirs):
    model, tok = load_model(tiny_dirs["llama"])
    prompt = tok.encode("The quick brown")
    greedy = list(generate_tokens(model, prompt, 10))
    stop = greedy[3]
    stats = GenerationStats()
    out = list(generate_tokens(model, prompt, 10, eos_token_ids=(stop,), stats=stats))
    assert out == greedy[: greedy.index(stop) + 1]
    assert stats.num_generated_tokens == len(out) and stats.num_prompt_tokens == len(prompt)


def test_context_overflow_is_a_clear_error(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        list(generate_tokens(model, [1] * 500, 20))


def test_streamer_holds_back_partial_utf8(tiny_dirs):
    _, tok = load_model(tiny_dirs["llama"])
    text = "Paris é 東京 ok"
    streamer = TextStreamer(tok)
    pieces = [streamer.push(t) for t in tok.encode(text, add_special_tokens=False)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "firstlight.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_on_a_checkpoint_dir(tiny_dirs):
    model, tok = load_model(tiny_dirs["gemma3_text"])
    expected = tok.decode(list(generate_tokens(model, tok.encode("The capital"), 8)), skip_special_tokens=True)
    res = _cli("generate", "--model", str(tiny_dirs["gemma3_text"]), "--prompt", "The capital",
               "--max-tokens", "8", "--threads", "1")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "The capital" + expected + "\n"
    assert "decode" in res.stderr and "tok/s" in res.stderr


def test_cli_chat_applies_template(tiny_dirs):
    res = _cli("generate", "--model", str(tiny_dirs["qwen3"]), "--prompt", "hi", "--chat", "--max-tokens", "4")
    assert res.returncode == 0, res.stderr


def test_cli_bad_model_path_is_one_line_error(tmp_path):
    res = _cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    assert "missing" in res.stderr and len(res.stderr.strip().splitlines()) <= 2


def test_cli_pull_unknown_model_is_one_line_error():
    res = _cli("models", "pull", "no-such-model")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "known models: gemma3-270m, smollm2-135m" in res.stderr


def test_cli_unknown_architecture_lists_supported(tiny_dirs, tmp_path):
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["llama"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    res = _cli("generate", "--model", str(ckpt), "--prompt", "x")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "'mamba' is not supported; supported:" in res.stderr
