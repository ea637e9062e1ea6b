"""The probe sandbox stops every escape we know to try, records it as an execution failure,
and leaves no process behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from stace.sandbox import SandboxLimits, run_sandboxed

LIMITS = SandboxLimits(cpu_s=3, wall_s=8, memory_mb=256, output_kb=64)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not running; /proc says so
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _sandbox_processes() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"sandbox_child.py" in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _no_api(op, args):  # the harness side: nothing to render here
    return [0] if op == "generate" else {"k": 1}


def test_a_well_behaved_program_calls_the_probe_api_over_the_pipe():
    calls = []

    def handle(op, args):
        calls.append((op, args))
        return list(range(len(args["prompts"]))) if op == "generate" else {"k": 4}

    r = run_sandboxed("print(probe.info()['k'])\nprint(probe.generate(['a disc', 'an orb'], seeds=[1, 2]))",
                      handle, LIMITS)
    assert r.ok and r.error is None, r.stderr
    assert r.stdout.splitlines() == ["4", "[0, 1]"]
    assert calls[1] == ("generate", {"prompts": ["a disc", "an orb"], "seeds": [1, 2], "negative_prompt": None,
                                     "guidance_scale": None, "num_inference_steps": None})


ESCAPES = {
    "socket": ("import socket\ns = socket.socket()\ns.connect(('1.1.1.1', 80))", "socket"),
    "socket_via_import_hook": ("s = __import__('_socket')", "_socket"),
    "write_outside": ("open('/tmp/stace_sandbox_escape_test.txt', 'w').write('x')", "outside the sandbox"),
    "harness_env": ("import os\nassert 'EMMA_TEST_PLANTED_KEY' not in os.environ, 'env leaked'\n"
                    "print(open('/proc/%d/environ' % os.getppid()).read())", "/proc"),
    "infinite_loop": ("while True:\n    pass", "limit"),
    "unbounded_memory": ("x = []\nwhile True:\n    x.append(bytearray(10 ** 7))", "MemoryError"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "os.fork"),
    "subprocess": ("import subprocess\nsubprocess.run(['ls'])", "subprocess"),
    "os_system": ("import os\nos.system('touch /tmp/stace_sandbox_escape_test.txt')", "os.system"),
    "ctypes": ("import ctypes\nctypes.CDLL(None).system(b'ls')", "ctypes"),
    "kill_parent": ("import os\nos.kill(os.getppid(), 9)", "os.kill"),
    "huge_output": ("while True:\n    print('x' * 1000)", "output"),
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escapes_are_stopped_and_recorded_as_failures(name, monkeypatch):
    monkeypatch.setenv("EMMA_TEST_PLANTED_KEY", "sk-planted-sandbox-0123456789")
    code, expect = ESCAPES[name]
    t0 = time.monotonic()
    r = run_sandboxed(code, _no_api, LIMITS)
    assert not r.ok, f"{name} was not stopped: {r.stdout[:200]}"
    message = (r.error or "") + r.stderr
    if name == "huge_output":
        assert "File too large" in message or "output limit" in message
    elif name == "infinite_loop":
        assert "CPU limit" in message or "wall-clock limit" in message
    else:
        assert expect in message, message[-400:]
    assert "sk-planted-sandbox" not in r.stdout + r.stderr
    assert time.monotonic() - t0 < LIMITS.wall_s + 5
    assert not Path("/tmp/stace_sandbox_escape_test.txt").exists()
    assert not _alive(r.pid)
    assert r.pid not in _sandbox_processes()


def test_a_failing_probe_api_call_reaches_the_program_not_the_harness():
    def handle(op, args):
        raise ValueError("only 0 of the k=0 images are left")

    code = "try:\n    probe.generate(['x'])\nexcept RuntimeError as e:\n    print('caught', e)"
    r = run_sandboxed(code, handle, LIMITS)
    assert r.ok and "caught probe.generate failed: ValueError: only 0 of the k=0" in r.stdout


def test_time_the_harness_spends_answering_is_not_charged_to_the_program():
    def handle(op, args):  # e.g. an attacker run: longer than the program's whole wall limit
        time.sleep(3.0)
        return {"k": 1}

    r = run_sandboxed("print(probe.info()['k'])", handle, SandboxLimits(cpu_s=3, wall_s=2, memory_mb=256))
    assert r.ok and r.stdout.strip() == "1", r.error
    assert r.wall_s >= 3.0


def test_an_oversized_request_is_stopped(monkeypatch):
    import stace.sandbox as sb

    monkeypatch.setattr(sb, "MAX_REQUEST_CHARS", 1_000_000)
    code = "import os\nfor _ in range(100):\n    probe._out.write('x' * 100_000)\nprobe._out.flush()\nprobe.info()"
    r = run_sandboxed(code, _no_api, LIMITS)
    assert not r.ok and "probe request exceeded" in r.error
    assert not _alive(r.pid)
