"""The HTML leaderboard in a real headless browser (Debian's chromium): it renders, its
tables sort on a header click, its images load, and the page logs no console errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from emma.results import SCHEMA_VERSION  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")

PROBE = """
<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
const _err = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); _err(...a); };
window.addEventListener('load', () => {
  const t = document.getElementById('tinyworld_methods');
  const col = Array.from(t.tHead.rows[0].cells).findIndex(th => th.textContent === 'ra/random ↑');
  const order = () => Array.from(t.tBodies[0].rows).map(r => r.cells[1].textContent);
  const before = order();
  t.tHead.rows[0].cells[col].click(); const asc = order();
  t.tHead.rows[0].cells[col].click(); const desc = order();
  const imgs = Array.from(document.images);
  const out = {before, asc, desc, images: imgs.length, width: document.documentElement.scrollWidth,
               sortable: typeof sortTable === 'function', main: !!document.getElementById('tinyworld_main'),
               loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length, errors: window.__errors};
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def _cell(root: Path, method: str, ra: float, ea: float, rng: np.random.Generator) -> None:
    root.mkdir(parents=True)
    metrics = {"ea/name": {"value": ea, "ci_low": ea - 0.1, "ci_high": min(1, ea + 0.1), "n": 8},
               "ra/random": {"value": ra, "ci_low": ra - 0.1, "ci_high": min(1, ra + 0.1), "n": 40},
               "asr": {"value": 1 - ea, "ci_low": 0.0, "ci_high": 1.0, "n": 8}}
    (root / "results.json").write_text(json.dumps({
        "schema_version": SCHEMA_VERSION, "metrics": metrics,
        "cell": {"model": "tinyworld", "method": method, "domain": "tinyworld", "concept": "circle",
                 "attacker": "static", "classifier": "tinyworld"},
        "config": {}, "timing": {}, "notes": [], "counts": {"evidence_images": 3},
        "versions": {"components": {"method": {"name": method, "version": "1"}}, "model": {}}}))
    ev = root / "evidence"
    ev.mkdir()
    index = []
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(ev / f"{i}.png")
        index.append({"file": f"{i}.png", "prompt": f"a circle #{i}", "seed": i, "group": "ea", "kind": "name",
                      "concept": "circle", "detected": i == 0, "score": 0.9 - i * 0.3})
    (ev / "index.json").write_text(json.dumps(index))


def test_html_renders_sorts_and_logs_no_errors(tmp_path):
    from leaderboards.build import build

    rng = np.random.default_rng(0)
    for method, ra, ea in [("esd", 0.70, 0.9), ("uce", 0.95, 0.6), ("none", 0.85, 0.0)]:
        _cell(tmp_path / "runs" / method, method, ra, ea, rng)
    build([tmp_path / "runs"], tmp_path / "board")
    html = (tmp_path / "board" / "index.html").read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", PROBE + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
             "--enable-logging=stderr", "--v=0", "--window-size=1280,900"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                         timeout=180)
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    assert m, dom.stderr[-2000:]
    out = json.loads(m.group(1).replace("&quot;", '"'))
    assert out["before"] == ["esd", "none", "uce"]  # the build sorts rows by method
    assert out["asc"] == ["esd", "none", "uce"]  # RA 0.70 < 0.85 < 0.95
    assert out["desc"] == ["uce", "none", "esd"]
    assert out["images"] == 9 + 1 and out["loaded"] == out["images"]  # evidence + the EA-vs-RA plot
    assert out["errors"] == [] and out["sortable"] and out["main"]
    assert out["width"] <= 1280  # nothing wider than the window: wide tables scroll inside their box
    assert "Uncaught" not in dom.stderr and ":ERROR:CONSOLE" not in dom.stderr

    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}",
                    (tmp_path / "board" / "index.html").as_uri()], capture_output=True, timeout=180, check=True)
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.shape == (900, 1280)
    assert pixels.std() > 10 and (pixels < 128).mean() > 0.01  # text, tables and plots, not a blank page
