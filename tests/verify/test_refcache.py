"""The reference's cached greedy continuation: same verdict and metrics, keyed by what it depends on,
unusable entries recomputed, `--no-reference-cache` bypasses it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from firstlight.cli import app
from firstlight.targets.faulty import Fault, FaultyTarget
from firstlight.targets.registry import get_target
from firstlight.verify.harness import DEFAULT_PROMPT, VerifyConfig, run_verify
from firstlight.verify.refcache import ContinuationCache, ReferenceCacheWarning, continuation_key, key_digest

CFG = VerifyConfig(new_tokens=6, ppl_tokens=0)
PROMPT = [1, 17, 42, 99, 7, 3, 250, 64]


def _verify(path, ref, cache, faulty=False, config=CFG):
    target = FaultyTarget(faults=[Fault("scale", op="aten.silu", layer=2, value=1.3)]) if faulty else get_target("eager", torch.float32)
    return run_verify(path, target, "faulty" if faulty else "eager", PROMPT, config, reference=ref,
                      reference_cache=cache)


def _same(a, b) -> None:
    """Everything but timings and the continuation's provenance is identical."""
    da, db = a.to_dict(), b.to_dict()
    for k in ("timings_s", "reference_continuation"):
        da.pop(k), db.pop(k)
    assert da == db


@pytest.mark.parametrize("faulty", [False, True], ids=["eager", "faulty-silu"])
def test_cache_hit_gives_the_same_result(tiny_dirs, references, tmp_path, faulty):
    path, ref = tiny_dirs["llama"], references("llama")
    cache = ContinuationCache(tmp_path / "cache")
    cold = _verify(path, ref, None, faulty)
    first = _verify(path, ref, cache, faulty)
    second = _verify(path, ref, cache, faulty)
    assert cold.reference_continuation["source"] == "generated" and cold.reference_continuation["cache"] == "disabled"
    assert first.reference_continuation["cache"] == "miss" and first.reference_continuation["stored"]
    assert second.reference_continuation["source"] == "cache" and second.reference_continuation["cache"] == "hit"
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    _same(cold, first)
    _same(cold, second)  # verdict, tokens, every boundary metric, parity, culprit
    assert second.verdict == ("mismatch" if faulty else "match")
    if faulty:
        assert second.culprit["module"] == "layers.2.mlp"


def test_key_changes_with_its_inputs(tiny_dirs, tiny_checkpoint, tmp_path):
    import shutil

    path = tiny_dirs["llama"]
    base = key_digest(continuation_key(path, PROMPT, 6))
    assert key_digest(continuation_key(path, PROMPT, 6)) == base  # stable
    assert key_digest(continuation_key(path, PROMPT[:-1], 6)) != base
    assert key_digest(continuation_key(path, PROMPT, 7)) != base
    assert key_digest(continuation_key(tiny_checkpoint("llama", seed=11), PROMPT, 6)) != base  # other weights
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    k = key_digest(continuation_key(copy, PROMPT, 6))
    st = (copy / "model.safetensors").stat()
    os.utime(copy / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place
    assert key_digest(continuation_key(copy, PROMPT, 6)) != k
    (copy / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3}))  # changes greedy
    assert key_digest(continuation_key(copy, PROMPT, 6)) != k
    # files the reference does not read are not in the key
    k = key_digest(continuation_key(copy, PROMPT, 6))
    (copy / "notes.txt").write_text("x")
    assert key_digest(continuation_key(copy, PROMPT, 6)) == k


def test_key_takes_sha256_from_a_pull_manifest(tiny_dirs, tmp_path):
    import shutil

    copy = tmp_path / "pulled"
    shutil.copytree(tiny_dirs["llama"], copy)
    size = (copy / "model.safetensors").stat().st_size
    files = {"model.safetensors": {"bytes": size, "sha256": "ab" * 32}, "config.json": {"bytes": -1, "sha256": "cd" * 32}}
    (copy / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))
    fp = {f["name"]: f for f in continuation_key(copy, PROMPT, 6)["checkpoint"]}
    assert fp["model.safetensors"]["sha256"] == "ab" * 32
    assert fp["config.json"]["sha256"] is None  # the manifest's size is not the file's: its hash is not trusted


@pytest.mark.parametrize("content", [
    "{not json", "\xff\xfe", json.dumps({"format": 1}), json.dumps([1, 2]),
], ids=["bad-json", "bad-utf8", "no-key", "not-a-dict"])
def test_corrupt_entry_is_ignored_and_recomputed(tiny_dirs, references, tmp_path, content):
    path, ref = tiny_dirs["llama"], references("llama")
    cache = ContinuationCache(tmp_path / "cache")
    cold = _verify(path, ref, None)
    entry = cache.entry_path(continuation_key(path, PROMPT, CFG.new_tokens))
    entry.parent.mkdir(parents=True)
    entry.write_bytes(content.encode("latin-1"))
    with pytest.warns(ReferenceCacheWarning, match="unusable"):
        res = _verify(path, ref, cache)
    assert res.reference_continuation["source"] == "generated" and res.reference_continuation["cache"] == "unusable"
    _same(cold, res)
    assert json.loads(entry.read_text())["continuation"] == res.tokens[len(PROMPT):]  # rewritten
    assert _verify(path, ref, cache).reference_continuation["cache"] == "hit"


def _rewrite_continuation(entry, cont) -> None:
    data = json.loads(entry.read_text())
    data["continuation"] = cont
    entry.write_text(json.dumps(data))


def test_bad_token_ids_are_ignored(tiny_dirs, references, tmp_path):
    path, ref = tiny_dirs["llama"], references("llama")
    cache = ContinuationCache(tmp_path / "cache")
    good = _verify(path, ref, cache)
    entry = cache.entry_path(continuation_key(path, PROMPT, CFG.new_tokens))
    for cont in ([10**9] * CFG.new_tokens, [1, 2], ["a"] * CFG.new_tokens, [True] * CFG.new_tokens):
        _rewrite_continuation(entry, cont)
        with pytest.warns(ReferenceCacheWarning, match="unusable"):
            res = _verify(path, ref, cache)
        assert res.tokens == good.tokens


def test_stale_entry_is_caught_by_the_reference_argmax(tiny_dirs, references, tmp_path):
    """An entry with the right key but tokens the reference would not choose (e.g. weights rewritten
    with the same size and mtime) is rejected by the hooked forward's own logits and regenerated."""
    path, ref = tiny_dirs["llama"], references("llama")
    cache = ContinuationCache(tmp_path / "cache")
    good = _verify(path, ref, cache)
    with torch.no_grad():
        logits = ref(torch.tensor([good.tokens])).logits[0]
    worst = int(logits[len(PROMPT) - 1].argmin())  # the least likely first token
    entry = cache.entry_path(continuation_key(path, PROMPT, CFG.new_tokens))
    _rewrite_continuation(entry, [worst] + good.tokens[len(PROMPT) + 1:])
    with pytest.warns(ReferenceCacheWarning, match="stale"):
        res = _verify(path, ref, cache)
    assert res.reference_continuation["cache"] == "stale" and res.tokens == good.tokens
    _same(good, res)
    assert _verify(path, ref, cache).reference_continuation["cache"] == "hit"


def test_unwritable_cache_warns_and_runs(tiny_dirs, references, tmp_path):
    path, ref = tiny_dirs["llama"], references("llama")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(ReferenceCacheWarning, match="could not write"):
        res = _verify(path, ref, ContinuationCache(blocker / "cache"))  # its parent is a file
    assert res.verdict == "match" and not res.reference_continuation["stored"]


def test_no_continuation_never_touches_the_cache(tiny_dirs, references, tmp_path):
    path, ref = tiny_dirs["llama"], references("llama")
    res = _verify(path, ref, ContinuationCache(tmp_path / "cache"), config=VerifyConfig(new_tokens=0, ppl_tokens=0))
    assert res.reference_continuation["source"] == "none" and res.reference_continuation["cache"] == "unused"
    assert not (tmp_path / "cache").exists()


def test_cli_uses_the_cache_and_no_reference_cache_bypasses_it(tiny_dirs, tmp_path, _reference_cache_in_tmp):
    runner = CliRunner()
    args = ["verify", "--model", str(tiny_dirs["llama"]), "--new-tokens", "4", "--ppl-tokens", "0"]

    def run(*extra):
        out = tmp_path / f"rep{len(list(tmp_path.iterdir()))}"
        res = runner.invoke(app, [*args, *extra, "--out", str(out)])
        assert res.exit_code == 0, res.output
        return res, json.loads((out / "result.json").read_text())

    _, bypass = run("--no-reference-cache")
    assert bypass["reference_continuation"]["cache"] == "disabled"
    assert not list(_reference_cache_in_tmp.glob("*.json"))
    _, miss = run()
    assert miss["reference_continuation"]["cache"] == "miss" and miss["reference_continuation"]["stored"]
    assert len(list(_reference_cache_in_tmp.glob("*.json"))) == 1
    out, hit = run()
    assert hit["reference_continuation"]["source"] == "cache"
    assert "4 greedy tokens, cache (cache: hit)" in out.output
    assert (hit["verdict"], hit["parity"], hit["tokens"]) == (bypass["verdict"], bypass["parity"], bypass["tokens"])
    _, again = run("--no-reference-cache")
    assert again["reference_continuation"]["source"] == "generated"


def test_cli_prints_a_corrupt_entry_as_one_warning_line(tiny_dirs, _reference_cache_in_tmp):
    from firstlight.models.loader import load_tokenizer

    path = tiny_dirs["llama"]
    ids = load_tokenizer(path)(DEFAULT_PROMPT)["input_ids"]
    entry = ContinuationCache(_reference_cache_in_tmp).entry_path(continuation_key(path, ids, 4))
    entry.write_text("{")
    res = CliRunner().invoke(app, ["verify", "--model", str(path), "--new-tokens", "4", "--ppl-tokens", "0"])
    assert res.exit_code == 0, res.output
    assert "warning: reference cache entry" in res.output and "Traceback" not in res.output
    assert json.loads(entry.read_text())["continuation"]


def test_unreadable_entry_warns_and_runs(tiny_dirs, references, tmp_path):
    path, ref = tiny_dirs["llama"], references("llama")
    cache = ContinuationCache(tmp_path / "cache")
    cache.entry_path(continuation_key(path, PROMPT, CFG.new_tokens)).mkdir(parents=True)  # a dir where the file goes
    with pytest.warns(ReferenceCacheWarning) as caught:
        res = _verify(path, ref, cache)
    messages = " | ".join(str(w.message) for w in caught)
    assert "unusable" in messages and "could not write" in messages
    assert res.verdict == "match" and res.reference_continuation["source"] == "generated"
