"""Workloads: seeded distributions, JSONL errors, shared prefixes, cache busting, local tokenizer."""

from __future__ import annotations

import json
import random

import pytest

from firstlight.bench.workload import LengthDist, Workload, WorkloadSpec
from firstlight.errors import FirstlightError


@pytest.mark.parametrize("spec,mean", [("64", 64), ("uniform:10:30", 20), ("normal:100:10", 100),
                                       ("lognormal:50:0.3", 50 * 2.718281828 ** (0.045))])
def test_length_distributions(spec, mean):
    d = LengthDist.parse(spec)
    xs = [d.sample(random.Random(i)) for i in range(3000)]
    assert sum(xs) / len(xs) == pytest.approx(mean, rel=0.03)
    assert min(xs) >= 1


@pytest.mark.parametrize("bad", ["x", "uniform:5", "gauss:1:2", "uniform:9:3", "normal:-1:2"])
def test_bad_length_spec(bad):
    with pytest.raises(FirstlightError, match="--input-len|uniform"):
        LengthDist.parse(bad, "--input-len")


def test_seeded_and_deterministic():
    a = Workload(WorkloadSpec(input_len="uniform:5:50", seed=7))
    b = Workload(WorkloadSpec(input_len="uniform:5:50", seed=7))
    c = Workload(WorkloadSpec(input_len="uniform:5:50", seed=8))
    assert [a.session(i).turns[0].text for i in range(5)] == [b.session(i).turns[0].text for i in range(5)]
    assert a.session(0).turns[0].text != c.session(0).turns[0].text


def test_malformed_jsonl_names_the_line(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "hello"}\n\n{"prompt": "a", }\n')
    with pytest.raises(FirstlightError, match=r"w.jsonl:3: not valid JSON"):
        Workload(WorkloadSpec(kind="jsonl", path=str(p)))
    p.write_text('{"prompt": "hello"}\n{"text": "no prompt"}\n')
    with pytest.raises(FirstlightError, match=r"w.jsonl:2: expected an object"):
        Workload(WorkloadSpec(kind="jsonl", path=str(p)))


def test_jsonl_prompts_and_messages(tmp_path):
    p = tmp_path / "w.jsonl"
    rows = [{"prompt": "one two", "output_len": 3}, {"messages": [{"role": "user", "content": "hi"}]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    w = Workload(WorkloadSpec(kind="jsonl", path=str(p), output_len="5"))
    assert w.session(0).turns[0].text == "one two" and w.session(0).turns[0].max_tokens == 3
    assert w.session(1).turns[0].messages[0]["content"] == "hi" and w.session(1).turns[0].max_tokens == 5
    assert w.session(2).turns[0].text == "one two"  # cycles


def test_shared_prefix_groups():
    w = Workload(WorkloadSpec(kind="shared-prefix", num_groups=3, prefix_len=20, input_len="5"))
    s = [w.session(i) for i in range(6)]
    assert [x.group for x in s] == [0, 1, 2, 0, 1, 2]
    assert s[0].turns[0].text.split()[:20] == s[3].turns[0].text.split()[:20]
    assert s[0].turns[0].text.split()[:20] != s[1].turns[0].text.split()[:20]
    assert len(s[0].turns[0].text.split()) == 25


def test_cache_bust_differs_per_run_but_keeps_sharing():
    runs = [Workload(WorkloadSpec(kind="shared-prefix", num_groups=2, prefix_len=8, cache_bust=True))
            for _ in range(2)]
    a, b = (r.session(0).turns[0].text for r in runs)
    assert a != b and a.split()[1:] == b.split()[1:]
    w = runs[0]
    assert w.session(0).turns[0].text.split()[:9] == w.session(2).turns[0].text.split()[:9]


def test_local_tokenizer_counts_exactly(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["red", "green", "blue", "cyan", "gold"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    w = Workload(WorkloadSpec(input_len="uniform:5:40", tokenizer=str(tmp_path)))
    for i in range(5):
        t = w.session(i).turns[0]
        assert t.input_tokens == len(tok.encode(t.text).ids)
        assert t.input_tokens == w.input_len.sample(random.Random(f"0-{i}"))
    with pytest.raises(FirstlightError, match="no tokenizer.json"):
        Workload(WorkloadSpec(tokenizer=str(tmp_path / "nope")))
