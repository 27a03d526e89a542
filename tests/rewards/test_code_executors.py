"""The executor interface of the code verifier: the remote SandboxFusion executor against a local stub service on
127.0.0.1 that answers ``POST /run_code`` as SandboxFusion does (it runs the code in a plain subprocess: a stub of
the protocol, not a sandbox)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_prime.rewards.code_verifier import make_code_reward, verify_code
from trl_prime.rewards.executors import LocalJail, SandboxFusion


class _Stub(BaseHTTPRequestHandler):
    requests: list[dict] = []
    mode = "normal"  # "normal" | "sandbox_error" | "http_500"

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, **body})
        if self.mode == "http_500":
            self.send_response(500)
            self.end_headers()
            return
        if self.mode == "sandbox_error":
            answer = {"status": "SandboxError", "message": "no executor pod available", "run_result": None}
        else:
            try:
                done = subprocess.run(
                    [sys.executable, "-I", "-c", body["code"]],
                    input=body["stdin"],
                    capture_output=True,
                    text=True,
                    timeout=body["run_timeout"],
                )
                run = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout}
                run.update(stderr=done.stderr, execution_time=0.01)
            except subprocess.TimeoutExpired:
                run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
            answer = {"status": "Success" if run.get("return_code") == 0 else "Failed", "run_result": run}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def stub():
    _Stub.requests, _Stub.mode = [], "normal"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _stdin(*pairs):
    return {"stdin_stdout": [{"input": i, "output": o} for i, o in pairs]}


def test_remote_stdin_tests_are_judged_locally(stub):
    remote = SandboxFusion(stub)
    tests = _stdin(("1 2\n", "3\n"), ("5 7\n", "12\n"))
    progs = [
        "a, b = map(int, input().split())\nprint(a + b)",
        "a, b = map(int, input().split())\nprint(3)",
        "print(1/0)",
        "while True:\n    pass",
        "def f(:",
    ]
    rs = verify_code(progs, [tests] * len(progs), executor=remote, timeout=1.0)
    assert [(r.reward, r.reason) for r in rs] == [
        (1.0, "passed"),
        (0.5, "partial"),
        (0.0, "runtime_error"),
        (0.0, "timeout"),
        (0.0, "syntax_error"),
    ]
    assert rs[0].layers == ("remote",) and "ZeroDivisionError" in rs[2].detail
    # one request per case, the program and its stdin only: the expected outputs never leave the verifier
    sent = [q for q in _Stub.requests if q["code"] == progs[0]]
    assert [q["stdin"] for q in sent] == ["1 2\n", "5 7\n"] and {q["path"] for q in sent} == {"/run_code"}
    assert all(q["language"] == "python" and q["run_timeout"] == 1.0 for q in _Stub.requests)
    assert not any("12" in q["code"] + q["stdin"] for q in sent)


def test_remote_call_tests_and_refused_check_tests(stub):
    remote = SandboxFusion(stub)
    fn = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}
    leet = "class Solution:\n    def add(self, a, b):\n        return a + b"
    rs = verify_code(
        ["def add(a, b):\n    return a + b", leet, "def add(a, b):\n    return a - b"], [fn] * 3, executor=remote
    )
    assert [(r.reward, r.reason) for r in rs] == [(1.0, "passed"), (1.0, "passed"), (0.0, "failed")]
    check = {"check": "def check(c):\n    assert c() == 1", "entry_point": "f"}
    (r,) = verify_code(["def f():\n    return 1"], [check], executor=remote)
    assert (r.reward, r.reason) == (None, "sandbox_error") and "check() tests" in r.detail


@pytest.mark.parametrize("mode", ["sandbox_error", "http_500"])
def test_remote_infrastructure_failures_are_none_not_zero(stub, mode):
    _Stub.mode = mode
    logged = {}
    fn = make_code_reward(executor=SandboxFusion(stub))
    rewards = fn(completions=["print(3)"], tests=[_stdin(("", "3"))], log_metric=logged.__setitem__)
    assert rewards == [None] and fn.last_results[0].reason == "sandbox_error"
    assert ("no executor pod available" if mode == "sandbox_error" else "HTTP Error 500") in fn.last_results[0].detail
    assert logged["code/sandbox_error"] == 1.0  # counted by the trainers' verifier/failure_rate


def test_unreachable_service_and_bad_url():
    port = 9  # discard: nothing listens on 127.0.0.1:9 here
    (r,) = verify_code(["print(1)"], [_stdin(("", "1"))], executor=SandboxFusion(f"http://127.0.0.1:{port}"))
    assert (r.reward, r.reason) == (None, "sandbox_error") and "SandboxFusion at" in r.detail
    with pytest.raises(ValueError, match="http://"):
        SandboxFusion("127.0.0.1:8080")


def test_local_jail_is_the_default_executor():
    (r,) = verify_code(["print(int(input()) * 2)"], [_stdin(("4", "8"))], executor=LocalJail())
    (default,) = verify_code(["print(int(input()) * 2)"], [_stdin(("4", "8"))])
    assert (r.reward, r.reason) == (default.reward, default.reason) == (1.0, "passed")
    assert r.layers == default.layers and "process_group" in r.layers
