"""Where a candidate program runs: one interface, a local jail and a remote sandbox service.

The code verifier (:func:`trl_prime.rewards.code_verifier.verify_code`) hands every program to an *executor* and
judges what it reports; expected outputs never leave the verifier. An executor is any object with

``run(program, *, mode, inputs=None, fn_name=None, check=None, entry_point=None, check_prelude=None,
output_caps=None, config) -> SandboxRun``

with the meaning of :func:`trl_prime.rewards.sandbox.run_program`: one :class:`~trl_prime.rewards.sandbox.CaseOutcome`
per test case (``ok``, ``timeout``, ``memory``, ``output_limit``, ``runtime_error``, ...), ``SandboxRun.ok`` False
(with ``error``) for an infrastructure failure, which the verifier scores ``None`` (``sandbox_error``), never 0.

- :class:`LocalJail` (the default): :func:`~trl_prime.rewards.sandbox.run_program` on this machine (the bubblewrap
  jail; its fallback where bwrap cannot start).
- :class:`SandboxFusion`: a remote `SandboxFusion <https://github.com/bytedance/SandboxFusion>`_ service (the one
  veRL uses), for clusters where code runs elsewhere: one ``POST {url}/run_code`` per test case
  (``{"code", "language": "python", "stdin", "run_timeout", "memory_limit_MB"}``), judged from ``run_result``
  (``status`` ``Finished`` / ``TimeLimitExceeded``, ``return_code``, ``stdout``, ``stderr``). Isolation is the
  service's (its result's layers are ``("remote",)``). Call tests (``fn_name``) run the program followed by a
  small driver that prints the return value's JSON after a marker; HumanEval ``check`` tests are refused
  (``ok=False``): their expected values are in the check source, which would have to run next to the candidate
  in the remote process, where the candidate can read it.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from typing import Any, Protocol

from trl_prime.rewards import sandbox
from trl_prime.rewards.sandbox import CaseOutcome, SandboxConfig, SandboxRun


__all__ = ["Executor", "LocalJail", "SandboxFusion"]


class Executor(Protocol):
    """Runs one program against its test cases (see the module docstring)."""

    def run(
        self,
        program: str,
        *,
        mode: str,
        inputs: list | None = None,
        fn_name: str | None = None,
        check: str | None = None,
        entry_point: str | None = None,
        check_prelude: str | None = None,
        output_caps: list[int] | None = None,
        config: SandboxConfig,
    ) -> SandboxRun: ...


class LocalJail:
    """The default executor: the sandbox of this machine (:func:`trl_prime.rewards.sandbox.run_program`)."""

    name = "local"

    def run(self, program: str, **kwargs: Any) -> SandboxRun:
        return sandbox.run_program(program, **kwargs)


# The driver of call tests: the program's function (or Solution method) called with the JSON arguments; its return
# value printed as JSON after the marker, on stdout's last line.
_FN_DRIVER = """

def __trl_prime_call():
    import json as _j, sys as _s
    _name, _args = {name!r}, _j.loads({args!r})
    _f = globals().get(_name)
    if _f is None and "Solution" in globals():
        _f = getattr(globals()["Solution"](), _name, None)
    if _f is None:
        raise NameError(f"name {{_name!r}} is not defined")
    _out = _j.dumps(_f(*_args))
    _s.stdout.write("\\n{marker}" + _out + "\\n")
    _s.stdout.flush()

__trl_prime_call()
"""


class SandboxFusion:
    """A remote SandboxFusion service as executor (see the module docstring).

    Args:
        url: the service's base URL, e.g. ``"http://sandbox:8080"`` (``/run_code`` is appended).
        request_timeout: extra seconds a request may take beyond the case's ``run_timeout`` (queueing, network).
        headers: extra HTTP headers (e.g. an authorization token of a gateway in front of the service).

    Raises:
        ValueError: ``url`` is not an ``http://`` or ``https://`` URL.
    """

    name = "sandboxfusion"

    def __init__(self, url: str, *, request_timeout: float = 30.0, headers: dict[str, str] | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"SandboxFusion url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/") + "/run_code"
        self.request_timeout = float(request_timeout)
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def _post(self, code: str, stdin: str, cfg: SandboxConfig) -> dict:
        body = {
            "code": code,
            "language": "python",
            "stdin": stdin,
            "run_timeout": cfg.timeout,
            "compile_timeout": cfg.timeout,
            "memory_limit_MB": cfg.memory_mb or 1024,
        }
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=self.headers, method="POST")
        with urllib.request.urlopen(req, timeout=cfg.timeout + self.request_timeout) as resp:
            return json.loads(resp.read().decode("utf-8", "replace"))

    def run(
        self,
        program: str,
        *,
        mode: str,
        inputs: list | None = None,
        fn_name: str | None = None,
        check: str | None = None,
        entry_point: str | None = None,
        check_prelude: str | None = None,
        output_caps: list[int] | None = None,
        config: SandboxConfig,
    ) -> SandboxRun:
        t0 = time.monotonic()
        layers = ("remote",)
        if mode == "check":
            return SandboxRun(
                ok=False,
                layers=layers,
                error="the SandboxFusion executor does not run HumanEval check() tests: their expected values would "
                "run in the candidate's own process; use the local jail (executor=None) for them",
            )
        if mode not in ("stdin", "fn") or inputs is None or (mode == "fn" and not isinstance(fn_name, str)):
            raise ValueError(f"mode must be 'stdin' (with inputs) or 'fn' (with inputs and fn_name), got {mode!r}")
        caps = list(output_caps) if output_caps is not None else [config.output_limit] * len(inputs)
        try:
            compile(program, "solution.py", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
            return SandboxRun(ok=True, layers=layers, compile_error=f"{type(e).__name__}: {e}"[:2000])
        cases: list[CaseOutcome] = []
        for i, x in enumerate(inputs):
            if time.monotonic() - t0 >= config.total_timeout:
                cases.append(CaseOutcome(status="timeout", detail="total time limit reached before this case"))
                continue
            marker = "@@trl_prime_result:" + secrets.token_hex(8) + ":"
            if mode == "stdin":
                code, stdin = program, x
            else:
                code = program + _FN_DRIVER.format(name=fn_name, args=json.dumps(list(x)), marker=marker)
                stdin = ""
            try:
                answer = self._post(code, stdin, config)
            except (OSError, ValueError, urllib.error.URLError) as e:
                return SandboxRun(
                    ok=False,
                    layers=layers,
                    error=f"SandboxFusion at {self.url} failed: {type(e).__name__}: {e}",
                    elapsed=time.monotonic() - t0,
                )
            case = _case_of(answer, mode, marker, caps[i])
            if case is None:
                why = str(answer.get("message") or answer.get("status") or answer)[:500]
                return SandboxRun(
                    ok=False, layers=layers, error=f"SandboxFusion error: {why}", elapsed=time.monotonic() - t0
                )
            cases.append(case)
        return SandboxRun(ok=True, layers=layers, cases=cases, elapsed=time.monotonic() - t0)


def _case_of(answer: Any, mode: str, marker: str, cap: int) -> CaseOutcome | None:
    """One test case's outcome from a ``/run_code`` answer; None when the service itself failed."""
    if not isinstance(answer, dict) or answer.get("status") == "SandboxError":
        return None
    run = answer.get("run_result")
    if not isinstance(run, dict):
        return None
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    t = float(run.get("execution_time") or 0.0)
    status = run.get("status")
    if status == "TimeLimitExceeded":
        return CaseOutcome(status="timeout", stdout=stdout[:2000], stderr=stderr[-2000:], time=t)
    if status != "Finished":
        return None
    if len(stdout.encode("utf-8", "replace")) >= cap:
        return CaseOutcome(status="output_limit", stdout=stdout[:cap], detail=f"output exceeded {cap} bytes", time=t)
    if run.get("return_code") != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {run.get('return_code')}"
        return CaseOutcome(status="runtime_error", stdout=stdout[:2000], stderr=stderr[-2000:], detail=last, time=t)
    if mode == "stdin":
        return CaseOutcome(status="ok", stdout=stdout, stderr=stderr[-2000:], time=t)
    head, sep, tail = stdout.rpartition(marker)
    if not sep:
        return CaseOutcome(status="runtime_error", stdout=stdout[:2000], detail="exited before the function returned")
    try:
        value = json.loads(tail.strip())
    except ValueError:
        return CaseOutcome(status="runtime_error", stdout=head[:2000], detail="return value could not be decoded")
    return CaseOutcome(status="ok", stdout=head[:2000], value=value, has_value=True, time=t)
