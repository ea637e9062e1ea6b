"""The README's install gives a cv2 that needs no libGL, with ultralytics installed.

``ultralytics`` depends on ``opencv-python`` (GUI build, links libGL); nudenet uses
``opencv-python-headless``. Both wheels ship the same ``cv2`` folder, so whichever installs
last wins. ``[dev]`` and ``[logos]`` therefore name ``ultralytics-opencv-headless`` (the same
package, published by Ultralytics with the headless OpenCV as its dependency).
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
import subprocess

import pytest


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_only_the_headless_opencv_is_installed():
    assert _installed("opencv-python-headless")
    assert not _installed("opencv-python"), (
        "opencv-python (needs libGL) is installed next to opencv-python-headless; install "
        "ultralytics-opencv-headless instead of ultralytics")


def test_cv2_is_the_headless_build_and_links_no_libgl():
    cv2 = pytest.importorskip("cv2")
    gui = [line.split(":", 1)[1].strip() for line in cv2.getBuildInformation().splitlines()
           if line.strip().startswith("GUI:")]
    assert gui == ["NONE"]
    if shutil.which("ldd") is None:
        pytest.skip("ldd not available")
    (so,) = glob.glob(os.path.join(os.path.dirname(cv2.__file__), "cv2*.so")) or [None]
    if so is None:
        pytest.skip("cv2 has no extension module file")
    libs = subprocess.run(["ldd", so], capture_output=True, text=True, check=True).stdout
    assert "libGL.so" not in libs


def test_ultralytics_imports_with_the_headless_cv2():
    import ultralytics  # in [dev]: CI must not skip the YOLO logo tests

    assert _installed("ultralytics-opencv-headless")
    from ultralytics.nn.tasks import ClassificationModel  # noqa: F401  (imports cv2)

    assert ultralytics.__version__


def _declared(section: str = "install_requires") -> list[str]:
    import configparser
    import re
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parent.parent / "setup.cfg")
    lines = [x.split("#")[0].strip() for x in cfg["options"][section].splitlines()]
    return [re.split(r"[<>=!~ ]", x, maxsplit=1)[0] for x in lines if x]


#: declared distributions that the package does not import, with the reason they are needed
NOT_IMPORTED = {"accelerate": "diffusers loads pipelines through it"}
IMPORT_NAMES = {"hydra-core": "hydra", "pillow": "PIL", "open-clip-torch": "open_clip", "PyYAML": "yaml",
                "clean-fid": "cleanfid"}


def test_every_declared_dependency_is_imported_by_the_package():
    """No dependency is declared and left unused (torchmetrics was); torch is a range."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folders = ("emma", "leaderboards", "classifiers", "attackers", "stace", "hydra_plugins")
    code = "\n".join(p.read_text(encoding="utf-8") for d in folders for p in (root / d).rglob("*.py"))
    declared = _declared()
    assert "torchmetrics" not in declared and not any(x.startswith("torch==") for x in declared)
    unused = [d for d in declared if d not in NOT_IMPORTED and not re.search(
        rf"^\s*(import|from) {re.escape(IMPORT_NAMES.get(d, d).replace('-', '_'))}\b", code, re.M)]
    assert unused == []


def test_console_scripts_name_the_cli_entry_points():
    import configparser
    import importlib
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parent.parent / "setup.cfg")
    scripts = dict(line.split(" = ") for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    assert set(scripts) == {"emma-run", "emma-leaderboard"}
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))
