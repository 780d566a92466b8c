"""ChatPlanner against a fake OpenAI-compatible server on 127.0.0.1: choices, tool rounds, fallbacks."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from firstlight.bringup.chat_planner import ChatConfig, ChatPlanner
from firstlight.bringup.planner import PlaybookPlanner, RunInfo
from firstlight.bringup.playbook import Playbook
from firstlight.bringup.remedies import Candidate, rule
from firstlight.bringup.signatures import OpClassError
from firstlight.cli import app

SIG = OpClassError(op_class="softmax", op="aten._softmax.default", module="layers.0.self_attn", rel_l2=0.3)
INFO = RunInfo(chip="wormhole-n300", vendor="tenstorrent", family="llama", model="tiny")
CANDS = [Candidate(f"remedy_{i}", (rule(op="aten._softmax", activation="fp32"),), f"candidate {i}", cost_rank=i)
         for i in range(4)]


class FakeChat:
    """Answers each POST with the next scripted reply: a message dict, (status, raw body), or a function of
    the request body returning one of those."""

    def __init__(self, replies: list[Any]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fake.requests.append({"path": self.path, "body": json.loads(body)})
                reply = fake.replies.pop(0) if fake.replies else (500, "script exhausted")
                reply = reply(fake.requests[-1]["body"]) if callable(reply) else reply
                status, raw = reply if isinstance(reply, tuple) else (200, json.dumps(
                    {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": reply}]}))
                data = raw.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def fake_chat() -> Iterator[Any]:
    made: list[FakeChat] = []

    def make(replies: list[Any]) -> FakeChat:
        made.append(FakeChat(replies))
        return made[-1]

    yield make
    for f in made:
        f.close()


def call(name: str, args: dict[str, Any], id_: str = "call_1") -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def _planner(url: str, tmp_path, **kw: Any) -> ChatPlanner:
    book = Playbook(tmp_path / "pb.json")
    return ChatPlanner(ChatConfig(url=url, model="fake-model", timeout_s=10, **kw), PlaybookPlanner(book))


def _playbook_order(tmp_path) -> list[Candidate]:
    return PlaybookPlanner(Playbook(tmp_path / "pb.json")).rank(SIG, CANDS, INFO)


def test_the_chosen_candidate_goes_first_and_the_rest_keep_playbook_order(fake_chat, tmp_path):
    srv = fake_chat([call("choose_remedy", {"candidate_index": 2, "reason": "softmax wants fp32"})])
    planner = _planner(srv.url, tmp_path)
    base = _playbook_order(tmp_path)
    ranked = planner.rank(SIG, CANDS, INFO)
    assert ranked == [base[2], base[0], base[1], base[3]]
    assert planner.decisions[-1]["reason"] == "softmax wants fp32" and "fallback" not in planner.decisions[-1]
    req = srv.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["body"]["model"] == "fake-model"
    assert {t["function"]["name"] for t in req["body"]["tools"]} == {"localize", "candidate_details", "choose_remedy"}
    prompt = req["body"]["messages"][1]["content"]
    assert SIG.describe() in prompt and "wormhole-n300" in prompt
    assert all(f"{i}. [{c.remedy}] {c.description}" in prompt for i, c in enumerate(base))


def test_tool_results_go_back_to_the_model(fake_chat, tmp_path):
    srv = fake_chat([call("localize", {}, "c1"), call("candidate_details", {"candidate_index": 1}, "c2"),
                     call("choose_remedy", {"candidate_index": 3, "reason": "r"}, "c3")])
    planner = _planner(srv.url, tmp_path)
    base = _playbook_order(tmp_path)
    assert planner.rank(SIG, CANDS, INFO, spread=0.25)[0] == base[3]
    assert len(srv.requests) == 3 and planner.decisions[-1]["rounds"] == 3
    tool_msgs = [m for m in srv.requests[2]["body"]["messages"] if m["role"] == "tool"]
    loc, det = (json.loads(m["content"]) for m in tool_msgs)
    assert tool_msgs[0]["tool_call_id"] == "c1" and loc["signature"]["module"] == "layers.0.self_attn"
    assert loc["fraction_of_units_failing"] == 0.25
    assert det["remedy"] == base[1].remedy and det["rules"][0]["op"] == "aten._softmax"
    assert det["playbook_score"] == 0.0  # an empty playbook


@pytest.mark.parametrize("replies, why", [
    ([(500, "overloaded")], "HTTP 500"),
    ([(200, "not json")], "no choices[0].message"),
    ([{"role": "assistant", "content": "try the second one"}], "without a tool call"),
    ([call("choose_remedy", {"candidate_index": 7, "reason": "x"})], "candidate_index 7"),
    ([call("choose_remedy", {"candidate_index": "1", "reason": "x"})], "candidate_index '1'"),
    ([call("rm_rf", {})], "unknown tool 'rm_rf'"),
    ([{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "choose_remedy", "arguments": "{oops"}}]}],
     "does not parse"),
    ([call("localize", {})] * 4, "no choose_remedy call in 4 requests"),
])
def test_nonsense_or_failure_falls_back_to_the_playbook_order(fake_chat, tmp_path, replies, why):
    srv = fake_chat(replies)
    planner = _planner(srv.url, tmp_path)
    assert planner.rank(SIG, CANDS, INFO) == _playbook_order(tmp_path)
    assert why in planner.decisions[-1]["fallback"]


def test_a_server_that_is_not_there_falls_back(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    planner = _planner(f"http://127.0.0.1:{port}/v1", tmp_path)
    assert planner.rank(SIG, CANDS, INFO) == _playbook_order(tmp_path)
    assert "ConnectError" in planner.decisions[-1]["fallback"]


def test_endpoint_forms():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"):
        assert ChatConfig(url=url, model="m").endpoint() == "http://h:1/v1/chat/completions"


def test_bringup_planner_chat_needs_url_and_model(tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bringup", "--target", "emulate:h100", "--planner", "chat", "--out", str(out)])
    assert res.exit_code == 2 and "--planner-url" in res.output and not out.exists()
    res = CliRunner().invoke(app, ["bringup", "--target", "emulate:h100", "--planner", "oracle", "--out", str(out)])
    assert res.exit_code == 2 and "'oracle'" in res.output and not out.exists()


@pytest.mark.slow
def test_the_loop_reaches_the_goal_with_a_chat_planner_that_picks_the_last_candidate(
        fake_chat, tiny_checkpoint, failing_chip, tmp_path):
    """The planner only orders candidates: the loop still verifies, keeps and reverts, and gets there."""
    from firstlight.bringup import runbook
    from firstlight.bringup.goal import parse_goal
    from firstlight.bringup.loop import BringupConfig, BringupLoop
    from firstlight.verify.harness import VerifyConfig

    def last(body: dict[str, Any]) -> dict[str, Any]:
        n = body["messages"][1]["content"].split("Candidates (playbook order):\n")[1].count("\n") + 1
        return call("choose_remedy", {"candidate_index": n - 1, "reason": "the last one"})

    srv = fake_chat([last] * 40)
    book = Playbook(tmp_path / "pb.json")
    out = tmp_path / "out"
    planner = ChatPlanner(ChatConfig(url=srv.url, model="fake", timeout_s=10), PlaybookPlanner(book),
                          log_path=tmp_path / "planner.jsonl")
    model = tiny_checkpoint("llama", seed=3)
    cfg = BringupConfig(model_path=model, chip=str(failing_chip), goal=parse_goal("kl<=2e-3,top1>=0.95"), budget=14,
                        perf_budget=0, out=out, prompt_ids=list(range(3, 35)),
                        verify=VerifyConfig(new_tokens=4, ppl_tokens=0))
    state = BringupLoop(cfg, book, planner=planner, on_iteration=lambda s: runbook.write(out, s, str(model))).run()
    assert state.final["met"], state.iterations[-1]
    trials = [it for it in state.iterations if it["phase"] == "correctness"]
    assert len(trials) == len(planner.decisions)  # one decision per remedy tried
    chosen = [(it, d) for it, d in zip(trials, planner.decisions, strict=True) if "chosen" in d]
    assert chosen and all(d["reason"] == "the last one" for _, d in chosen)
    assert all(it["remedy"]["description"] == d["chosen"] for it, d in chosen)
    assert all(d["index"] == d["num_candidates"] - 1 for _, d in chosen)
    logged = [json.loads(line) for line in (tmp_path / "planner.jsonl").read_text().splitlines()]
    assert logged == planner.decisions
