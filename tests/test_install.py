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
