"""The sandboxed side of STACE's probe execution (standard library only).

Started by :mod:`stace.sandbox` as ``python -I sandbox_child.py WORKDIR REQ_FD RESP_FD``
with a cleared environment, resource limits and (where the OS allows) no network
namespace. It installs an audit hook — the last layer — and then runs the synthesised
program ``WORKDIR/probe.py`` with one global, ``probe``, whose methods send JSON requests
over a pipe to the harness, which holds the model, renders and judges.

The probe API (what the Code Synthesiser is told)::

    probe.info() -> dict          # concept, k, remaining images, default sampler settings
    probe.generate(prompts, seeds=None, negative_prompt=None, guidance_scale=None,
                   num_inference_steps=None) -> list[int]   # image ids; renders len(prompts) images
    probe.tokenize(text) -> list[str]                        # the text encoder's tokens
    probe.token_ids(text) -> list[int]                       # their ids (start/end tokens included)
    probe.encode(text) -> list[list[float]]                  # prompt embedding (L x D)
    probe.nearest_tokens(text, n=10) -> list[[str, float]]   # vocabulary neighbours, cosine
    probe.generate_embeds(embeds, seeds=None, negative_prompt=None, guidance_scale=None,
                          num_inference_steps=None, label=None) -> list[int]
    probe.attack(attacker, prompt=None, seed=None) -> dict   # one of the harness's attackers

docs/stace.md documents each call.
"""

from __future__ import annotations

import json
import os
import sys

BLOCKED_EVENTS = {
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function",
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "os.kill",
    "os.killpg", "os.putenv", "os.chdir", "os.symlink", "os.link", "shutil.rmtree",
    "sys.addaudithook", "os.add_dll_directory", "os.startfile",
}
BLOCKED_MODULES = {"ctypes", "_ctypes", "socket", "_socket", "subprocess", "_posixsubprocess",
                   "multiprocessing", "_multiprocessing", "asyncio", "ssl", "_ssl", "pty", "signal"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class SandboxViolation(RuntimeError):
    """The program tried something the sandbox forbids."""


def install_audit_hook(workdir: str) -> None:
    root = os.path.realpath(workdir) + os.sep

    def inside(path: object) -> bool:
        if isinstance(path, int):  # an already-open descriptor
            return True
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return (p + os.sep).startswith(root)

    def hook(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS:
            raise SandboxViolation(f"blocked: {event}")
        if event == "import" and args and str(args[0]).split(".")[0] in BLOCKED_MODULES:
            raise SandboxViolation(f"blocked: import {args[0]}")
        if event == "open" and args:
            path, mode, flags = (list(args) + [None, None])[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                     (isinstance(flags, int) and flags & _WRITE_FLAGS)
            name = os.fsdecode(path) if isinstance(path, (str, bytes)) else ""
            if writes and not inside(path):
                raise SandboxViolation(f"blocked: writing outside the sandbox folder ({name})")
            if name.startswith("/proc/") and not name.startswith(("/proc/self/stat", "/proc/self/fd")):
                raise SandboxViolation(f"blocked: reading {name}")
        if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                     "os.truncate", "os.utime") and args and not inside(args[0]):
            raise SandboxViolation(f"blocked: {event} outside the sandbox folder")

    sys.addaudithook(hook)


class Probe:
    """The program's handle on the model: every call is one request/response over the pipe."""

    def __init__(self, req_fd: int, resp_fd: int) -> None:
        self._out = os.fdopen(req_fd, "w", buffering=1)
        self._in = os.fdopen(resp_fd, "r")

    def _call(self, op: str, **args: object) -> object:
        self._out.write(json.dumps({"op": op, "args": args}) + "\n")
        self._out.flush()
        line = self._in.readline()
        if not line:
            raise RuntimeError("the harness closed the probe pipe")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"probe.{op} failed: {reply.get('error')}")
        return reply["result"]

    def info(self) -> dict:
        return self._call("info")  # type: ignore[return-value]

    def generate(self, prompts, seeds=None, negative_prompt=None, guidance_scale=None,
                 num_inference_steps=None) -> list:
        if isinstance(prompts, str):
            prompts = [prompts]
        return self._call("generate", prompts=list(prompts), seeds=None if seeds is None else list(seeds),
                          negative_prompt=negative_prompt, guidance_scale=guidance_scale,
                          num_inference_steps=num_inference_steps)  # type: ignore[return-value]

    def tokenize(self, text: str) -> list:
        return self._call("tokenize", text=text)  # type: ignore[return-value]

    def token_ids(self, text: str) -> list:
        return self._call("token_ids", text=text)  # type: ignore[return-value]

    def encode(self, text: str) -> list:
        return self._call("encode", text=text)  # type: ignore[return-value]

    def nearest_tokens(self, text: str, n: int = 10) -> list:
        return self._call("nearest_tokens", text=text, n=n)  # type: ignore[return-value]

    def generate_embeds(self, embeds, seeds=None, negative_prompt=None, guidance_scale=None,
                        num_inference_steps=None, label=None) -> list:
        # one L x D embedding, or a list of them (one image each)
        if embeds and embeds[0] and not isinstance(embeds[0][0], (list, tuple)):
            embeds = [embeds]
        embeds = [[[float(x) for x in row] for row in e] for e in embeds]
        return self._call("generate_embeds", embeds=embeds, seeds=None if seeds is None else list(seeds),
                          negative_prompt=negative_prompt, guidance_scale=guidance_scale,
                          num_inference_steps=num_inference_steps, label=label)  # type: ignore[return-value]

    def attack(self, attacker: str, prompt=None, seed=None) -> dict:
        return self._call("attack", attacker=attacker, prompt=prompt, seed=seed)  # type: ignore[return-value]


def main() -> int:
    workdir, req_fd, resp_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.chdir(workdir)
    with open("probe.py", encoding="utf-8") as fh:
        source = fh.read()
    probe = Probe(req_fd, resp_fd)
    code = compile(source, "probe.py", "exec")
    install_audit_hook(workdir)
    try:
        exec(code, {"__name__": "__main__", "probe": probe, "__builtins__": __builtins__})
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
