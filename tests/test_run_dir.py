"""The run directory: claimed by one cell at a time, refused early when it cannot be written,
and launchers found from any working directory."""

from __future__ import annotations

import fcntl
import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_env

FAST = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "metrics=rates_only",
        "prompt_types=[name]", "images_per_prompt=1"]
LOCK = ".emma-cell.lock"


def emma_run(args, cache, cwd=ROOT, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "emma.run", *args], cwd=cwd, env=env or run_env(cache),
                          capture_output=True, text=True, timeout=timeout)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _hold(run: Path, cell: str):
    """The run directory's lock, held by this test process as a running cell would hold it."""
    run.mkdir(parents=True, exist_ok=True)
    f = open(run / LOCK, "a+")  # noqa: SIM115 - held until the caller closes it
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(json.dumps({"pid": os.getpid(), "host": "testhost", "cell": cell}) + "\n")
    f.flush()
    return f


def test_a_run_dir_in_use_by_another_cell_is_refused_and_left_alone(tmp_path):
    run = tmp_path / "run"
    held = _hold(run, "concept=star")
    before = _tree(run)
    try:
        proc = emma_run([*FAST, f"hydra.run.dir={run}"], tmp_path / "cache")
    finally:
        held.close()
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert err[0] == (f"error: run directory {run} is in use by another cell (pid {os.getpid()} on testhost, "
                      "cell: concept=star); wait for it to end, or choose another hydra.run.dir")
    assert _tree(run) == before  # no .hydra/, no images, no results: the other cell's folder is untouched


def test_a_sweep_job_into_a_held_folder_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    held = _hold(sweep / "job", "method=esd")
    try:
        proc = emma_run(["-m", *FAST, f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=job"], tmp_path / "cache")
    finally:
        held.close()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"run directory {sweep / 'job'} is in use by another cell (pid {os.getpid()}" in proc.stderr
    assert not (sweep / "job" / "results.json").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text(json.dumps({"pid": dead.pid, "host": "testhost", "cell": "concept=star"}) + "\n")
    proc = emma_run([*FAST, f"hydra.run.dir={run}"], tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run / "results.json").read_text())["metrics"]
    assert not (run / LOCK).exists()  # released when the cell ended


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_an_output_folder_that_is_a_file_is_a_one_line_error(key, tmp_path):
    target = tmp_path / "taken"
    target.write_text("not a folder\n")
    multirun = ["-m"] if key == "hydra.sweep.dir" else []
    for folder, expected in [(target, f"error: {key}={target} is a file; give a folder"),
                             (target / "sub", f"error: {key}={target / 'sub'} is inside {target}, which is a "
                                              "file; give a folder")]:
        proc = emma_run([*multirun, *FAST, f"{key}={folder}"], tmp_path / "cache")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [expected]
        assert target.read_text() == "not a folder\n"
    assert not (tmp_path / "cache" / "images").exists()  # refused before any image


def test_a_read_only_run_dir_is_a_one_line_error(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("this user (root) can write to a read-only folder")
        for folder, reason in [(parent, "read-only"), (parent / "run", f"{parent} is read-only")]:
            proc = emma_run([*FAST, f"hydra.run.dir={folder}"], tmp_path / "cache")
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert proc.stderr.strip().splitlines() == [
                f"error: cannot write to hydra.run.dir={folder} ({reason}); give a folder you can write to"]
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_a_folder_without_write_permission_is_named(tmp_path, monkeypatch):
    """The read-only case where the test runs as root (who may write anywhere)."""
    from emma.errors import ConfigError
    from emma.validate import check_output_dirs

    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(ConfigError) as err:
        check_output_dirs([f"hydra.run.dir={tmp_path / 'a' / 'b'}"], multirun=False)
    assert str(err.value) == (f"cannot write to hydra.run.dir={tmp_path / 'a' / 'b'} ({tmp_path} is read-only); "
                              "give a folder you can write to")
    with pytest.raises(ConfigError, match=r"^cannot write to hydra.sweep.dir=.* \(read-only\)"):
        check_output_dirs([f"hydra.sweep.dir={tmp_path}"], multirun=True)


def test_launchers_are_found_from_any_working_directory(tmp_path):
    """The launchers live in ``hydra_plugins``, which Hydra scans for plugins: an install of the
    package (here an editable one into a fresh environment, as ``pip install -e .`` makes) must
    make them findable without the repository root on the path or as the working directory."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    # the dependencies from this interpreter's environment (no .pth of it runs: not a site dir)
    Path(venv_site, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in run_env(tmp_path / "cache").items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                              "--no-deps", "--no-build-isolation", "--no-index", "-e", str(ROOT)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([str(python), "-m", "emma.run", "hydra/launcher=local", *FAST, "--cfg", "hydra",
                           "--package", "hydra.launcher"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "_target_: hydra_plugins.emma_launchers.launchers.EmmaLocalLauncher" in proc.stdout, proc.stdout
