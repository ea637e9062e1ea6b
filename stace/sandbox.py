"""Run LLM-written probe code outside the harness process.

Layers, outermost first (docs/stace.md says what each stops):

1. **A separate process** in its own session (process group), started with ``python -I``
   (no user site, no ``PYTHON*`` variables) and a *cleared environment*: the harness's
   variables — API keys included — are not there to read.
2. **No network**: where ``unshare -rn`` works (Linux user + network namespaces), the child
   runs in an empty network namespace (loopback only, down).
3. **Resource limits** (``setrlimit``): CPU seconds, address space, output file size,
   process count, open files; plus a wall-clock limit enforced by the harness, which kills
   the whole process group at the end of every run, so no process survives it.
4. **A private working directory** (a fresh temporary folder, removed afterwards).
5. **An audit hook** (``sys.addaudithook``, last layer, in the child): blocks subprocess,
   ``os.system``/exec/fork/spawn, ctypes, sockets, signals to other processes, writes
   outside the working directory and reads of ``/proc``.

The child holds no model. It calls the probe API over a pipe; :class:`ProbeServer`
answers (render images, tokenize) in the harness, which keeps the images and judges them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

CHILD = Path(__file__).resolve().parent / "sandbox_child.py"
MAX_REQUEST_CHARS = 64 * 1024 * 1024  # one probe-API request (ten SD prompt embeddings are ~12 MB)
_UNSHARE: list[str] | None = None


@dataclasses.dataclass
class SandboxLimits:
    """Limits of one sandboxed run."""

    cpu_s: int = 30
    wall_s: float = 60.0
    memory_mb: int = 1024
    output_kb: int = 256
    max_processes: int = 64
    open_files: int = 64


@dataclasses.dataclass
class SandboxResult:
    """What a sandboxed program did.

    Attributes:
        ok: exited with status 0 within the limits.
        error: why not (the traceback's last lines, the signal, or the limit hit).
        stdout / stderr: their first ``output_kb`` kilobytes.
        returncode: the exit status (negative: killed by that signal).
        wall_s: wall seconds.
        network_isolated: ran in an empty network namespace.
        pid: the child's process id (its process group was killed at the end).
    """

    ok: bool
    error: str | None
    stdout: str
    stderr: str
    returncode: int | None
    wall_s: float
    network_isolated: bool
    pid: int = 0


def _unshare_prefix() -> list[str]:
    """``["unshare", "-rn"]`` when an unprivileged network namespace can be made here."""
    global _UNSHARE
    if _UNSHARE is None:
        exe = shutil.which("unshare")
        _UNSHARE = []
        if exe:
            try:
                ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            _UNSHARE = [exe, "-rn"] if ok else []
    return list(_UNSHARE)


def _limit(limits: SandboxLimits) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec
        mem = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_kb * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_sandboxed(code: str, handle: Callable[[str, dict[str, Any]], Any],
                  limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in the sandbox; answer its probe-API calls with ``handle(op, args)``.

    ``handle`` runs in the harness; an exception it raises is sent back to the program as a
    failed call (the program may catch it), never raised here. The wall-clock limit counts
    the program's own time: time the harness spends answering calls (an attacker run, say)
    is not charged to it; the program waits blocked meanwhile.
    """
    limits = limits or SandboxLimits()
    workdir = Path(tempfile.mkdtemp(prefix="stace-sandbox-"))
    (workdir / "probe.py").write_text(code, encoding="utf-8")
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    out_path, err_path = workdir / ".stdout", workdir / ".stderr"
    prefix = _unshare_prefix()
    cmd = prefix + [sys.executable, "-I", "-S", str(CHILD), str(workdir), str(req_w), str(resp_r)]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir), "TMPDIR": str(workdir)}
    t0 = time.monotonic()
    serving = 0.0  # seconds spent in handle()
    error: str | None = None
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=workdir,
                                env=env, pass_fds=(req_w, resp_r), start_new_session=True,
                                preexec_fn=_limit(limits), close_fds=True)
    os.close(req_w)
    os.close(resp_r)
    reader = os.fdopen(req_r, "r")
    writer = os.fdopen(resp_w, "w", buffering=1)
    try:
        parts: list[str] = []  # the unfinished request line, in pieces
        size = 0
        while True:
            remaining = limits.wall_s - (time.monotonic() - t0 - serving)
            if remaining <= 0:
                error = f"wall-clock limit of {limits.wall_s:g} s exceeded"
                break
            ready, _, _ = select.select([reader], [], [], min(remaining, 0.5))
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(reader.fileno(), 65536).decode("utf-8", "replace")
            if not chunk:  # the child closed its end: it has exited (or is exiting)
                break
            if "\n" not in chunk:  # part of a long request
                parts.append(chunk)
                size += len(chunk)
                if size > MAX_REQUEST_CHARS:
                    error = f"a probe request exceeded {MAX_REQUEST_CHARS // 2 ** 20} MB"
                    break
                continue
            lines = ("".join(parts) + chunk).split("\n")  # the program sends ASCII JSON lines
            parts, size = [lines[-1]], len(lines[-1])
            for line in lines[:-1]:
                t_call = time.monotonic()
                answer = json.dumps(_answer(handle, line))
                serving += time.monotonic() - t_call
                writer.write(answer + "\n")
                writer.flush()
        if error is None:
            try:
                proc.wait(timeout=max(0.1, limits.wall_s - (time.monotonic() - t0 - serving)))
            except subprocess.TimeoutExpired:
                error = f"wall-clock limit of {limits.wall_s:g} s exceeded"
    except BrokenPipeError:
        pass
    finally:
        _kill_group(proc)
        for fh in (reader, writer):
            try:
                fh.close()
            except OSError:
                pass
    wall = time.monotonic() - t0
    stdout = _head(out_path, limits.output_kb)
    stderr = _head(err_path, limits.output_kb)
    shutil.rmtree(workdir, ignore_errors=True)
    rc = proc.returncode
    if error is None and rc != 0:
        error = _describe_failure(rc, stderr, limits)
    return SandboxResult(ok=error is None, error=error, stdout=stdout, stderr=stderr, returncode=rc,
                         wall_s=wall, network_isolated=bool(prefix), pid=proc.pid)


def _answer(handle: Callable[[str, dict[str, Any]], Any], line: str) -> dict[str, Any]:
    try:
        req = json.loads(line)
        return {"ok": True, "result": handle(str(req["op"]), dict(req.get("args") or {}))}
    except Exception as exc:  # reported to the program, which may handle it
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _head(path: Path, kb: int) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(kb * 1024).decode("utf-8", "replace")
    except OSError:
        return ""


def _describe_failure(rc: int, stderr: str, limits: SandboxLimits) -> str:
    if rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        reason = {"SIGXCPU": f"CPU limit of {limits.cpu_s} s exceeded",
                  "SIGXFSZ": f"output limit of {limits.output_kb} KB exceeded",
                  "SIGKILL": "killed"}.get(sig, f"killed by {sig}")
        return reason
    tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-3:]
    return f"exit status {rc}: " + (" | ".join(tail) if tail else "no error output")
