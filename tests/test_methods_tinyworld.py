"""Each method really erases a shape from the trained tiny world, through the command line's
own configs (the tiny-world presets in conf/preset/method), with fewer images than the
documented table (docs/methods_tinyworld.md, 8 shapes, scripts/eval_methods_tinyworld.py).

The floors come from the measured spread over 3 seeds and 1 / 2 torch threads (see the table's
notes): EA on 6 name images, RA on 30 random-shape images relative to the base model's.
``EMMA_TEST_METHOD_SEED`` / ``EMMA_TEST_THREADS`` run the floor tests with another seed / torch
thread count (CI runs seed 0 on 1 thread).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.conftest import run_env

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("eval_methods_tinyworld",
                                               ROOT / "scripts" / "eval_methods_tinyworld.py")
ev = importlib.util.module_from_spec(_spec)
sys.modules["eval_methods_tinyworld"] = ev
_spec.loader.exec_module(ev)

from emma.pipelines import TINYWORLD_DIR  # noqa: E402

pytestmark = pytest.mark.skipif(not TINYWORLD_DIR.exists(), reason="the trained tiny world is not shipped")

CONCEPT = "circle"
IMAGES = 6
SEED = int(os.environ.get("EMMA_TEST_METHOD_SEED", "0"))
THREADS = int(os.environ.get("EMMA_TEST_THREADS", "1"))  # torch threads of the floor tests
# Floors: EA on 6 name images (the base model draws the circle in all 6), RA relative to the
# base model's RA on the same 30 random-shape images. Measured over seeds 0-2 (1 thread), the
# lowest values were: FMN EA 0.67 (4 of 6); every other measured method EA 1.00 and
# RA >= 0.93 x base (CA, anchored on the other shapes: EA 1.00, RA >= 1.00 x base over seeds
# 0-2 on 1 thread and seed 0 on 2; tiny world 3, seed 0: EA 0.83, RA 0.93 at 128 anchor images,
# EA 1.00, RA 1.00 x base at the shipped 192; SPM with Facilitated Transport, tiny world 3, seed 0:
# EA 0.83, RA 1.00 x base, where world 2's preset left EA 0.33).
# Each floor sits one image (EA) or about 0.08 (RA) below
# the lowest measured value. ESD-u (with -m slow), seeds 0-2 on 1 thread: EA 0.83, 0.50, 0.83,
# RA 0.86, 0.96, 0.83 x base; seed 0 on 2 threads: EA 1.00, RA 0.54 x base. Without a
# preservation term its outcome follows float rounding (docs/methods_tinyworld_limits.md), so
# its floors only catch an ESD-u that erases nothing or draws no other shape.
EA_FLOOR, RA_FLOOR = 0.65, 0.75
FLOORS = {"fmn": (0.5, RA_FLOOR), "esd_u": (0.3, 0.45)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("methods-cache")


@pytest.fixture(scope="module")
def base(cache) -> "ev.CellRates":
    return ev.evaluate_cell("none", CONCEPT, seed=SEED, images_per_prompt=IMAGES, cache_dir=cache, threads=THREADS)


def test_the_base_model_draws_the_concept(base):
    assert base.ea_name <= 0.2  # else erasure would not be measurable
    assert base.ra_random >= 0.6


def test_a_cell_records_the_libraries_and_runtime_it_ran_with(base):
    # float rounding follows the CPU, the thread count and the library versions: a page's
    # figure is only checkable against the machine that measured it
    assert base.environment["runtime"]["torch_threads"] == THREADS
    assert base.environment["libraries"]["torch"] == torch.__version__.split("+")[0]
    assert base.environment["runtime"]["cpu"]
    # rows written before the field existed still load
    row = {k: v for k, v in ev.asdict(base).items() if k != "environment"}
    assert ev.CellRates(**row).environment == {}


# The two longest erasures (500 and 800 ESD iterations, about 2 and 3 min on one thread) run
# with -m slow, keeping CI under 30 minutes: ESD-500 is ESD's preset with more iterations (its
# settings are checked below and ESD's floor runs here); docs/methods_tinyworld.md measures both
# on all eight shapes.
SLOW_FLOORS = {"esd_500", "esd_u"}
# Presets tuned on tiny world 2 that miss their floor on tiny world 3 (seed 0, one thread) until
# they are re-tuned on it: strict, so a preset that passes again must get its floor back.
NOT_RETUNED = {"fmn": "tiny world 3: RA 0.17 x base (the other shapes are lost)"}


def _floor_param(method: str):
    marks = [pytest.mark.slow] if method in SLOW_FLOORS else []
    if method in NOT_RETUNED:
        marks.append(pytest.mark.xfail(strict=True, reason=NOT_RETUNED[method]))
    return pytest.param(method, marks=marks)


@pytest.mark.parametrize("method", [_floor_param(m) for m in ev.METHODS])
def test_each_method_erases_the_circle(cache, base, method):
    row = ev.evaluate_cell(method, CONCEPT, seed=SEED, images_per_prompt=IMAGES, cache_dir=cache, threads=THREADS)
    ea_floor, ra_floor = FLOORS.get(method, (EA_FLOOR, RA_FLOOR))
    print(f"{method} seed {SEED} threads {THREADS}: EA {row.ea_name:.2f} RA {row.ra_random:.2f} "
          f"({row.ra_random / base.ra_random:.2f} x base {base.ra_random:.2f})")  # the spread, with -rP
    assert row.ea_name >= ea_floor, row
    assert row.ra_random >= ra_floor * base.ra_random, row


@pytest.mark.parametrize("domain", [[], ["domain=tinyworld_style", "concept=striped"]], ids=["shapes", "styles"])
def test_esd_strength_presets_rise_with_the_number(domain):
    """ESD-100/200/500 keep their meaning on the tiny world: the number is the iteration count,
    the objective and sampler are ESD-x's, and the update budget (rate x iterations) rises with
    the number even where a strength runs at its own rate to meet the bar."""
    cfgs = {k: ev.compose([f"method=esd_{k}", *domain]).method for k in (100, 200, 500)}
    assert [cfgs[k].iterations for k in (100, 200, 500)] == [100, 200, 500]
    assert len({(m.ddim_steps, m.train_method, m.negative_guidance) for m in cfgs.values()}) == 1
    budget = [cfgs[k].learning_rate * cfgs[k].iterations for k in (100, 200, 500)]
    assert budget == sorted(budget) and len(set(budget)) == 3, budget


def test_presets_follow_the_model():
    """The tiny world picks the tiny preset; SD v1.4 keeps the paper's defaults; the command
    line overrides either."""
    tiny = ev.compose(["method=esd"]).method
    sd = ev.compose(["method=esd", "model=sd14"]).method
    assert (tiny.iterations, tiny.learning_rate) == (300, 1.0e-3)
    assert (sd.iterations, sd.learning_rate) == (1000, 1.0e-5)
    assert ev.compose(["method=esd", "method.iterations=7"]).method.iterations == 7


@pytest.mark.parametrize("concept", ["star", "crescent"])
def test_uce_preserves_the_other_shapes_of_any_concept(concept):
    from omegaconf import OmegaConf

    cfg = ev.compose(["method=uce", f"concept={concept}"])
    preserve = OmegaConf.to_container(cfg.method.preserve_concepts, resolve=True)["tinyworld"]
    assert concept not in preserve and len(preserve) == 7 and set(preserve) < set(ev.SHAPES)


def test_ca_anchors_on_the_other_shapes_of_any_concept():
    """CA's tiny preset anchors on every other shape (never the erased one) and keeps them
    with prior preservation; so does CA-model (tiny world 2's generic anchor draws circles)."""
    from omegaconf import OmegaConf

    from emma.domains import load_domain
    from emma.methods._common import for_domain
    from emma.methods.ca import ConceptAblationMethod

    cfg = ev.compose(["method=ca", "concept=star"]).method
    table = for_domain(OmegaConf.to_container(cfg.anchor_concepts, resolve=True), "tinyworld", what="")
    anchors = ConceptAblationMethod.anchors_of(table, "star", ["star"], load_domain("tinyworld"))
    assert anchors == [s for s in ev.SHAPES if s != "star"] and cfg.prior_preservation
    model = ev.compose(["method=ca_model", "concept=star"]).method
    table = for_domain(OmegaConf.to_container(model.anchor_concepts, resolve=True), "tinyworld", what="")
    assert ConceptAblationMethod.anchors_of(table, "star", ["star"], load_domain("tinyworld")) == anchors
    assert model.prior_preservation
    # styles likewise: the generic style anchor "plain" is itself a style of the domain
    for method in ("ca", "ca_model"):
        cfg = ev.compose([f"method={method}", "domain=tinyworld_style", "concept=plain"]).method
        table = for_domain(OmegaConf.to_container(cfg.anchor_concepts, resolve=True), "tinyworld_style", what="")
        got = ConceptAblationMethod.anchors_of(table, "plain", ["plain"], load_domain("tinyworld_style"))
        assert got == ["striped", "dotted", "checkered"], (method, got)


def _metrics(path: Path) -> dict[str, float]:
    data = json.loads((path / "results.json").read_text())
    return {k: v["value"] for k, v in data["metrics"].items() if not k.startswith("time/")}


def test_same_cell_twice_in_one_process_and_in_two_processes_is_bit_identical(tmp_path):
    """Same seed, same thread count, fresh caches: identical metrics and identical images,
    whether run in this process twice or by the CLI in another process."""
    from emma.cell import run_cell

    overrides = ["method=fmn", "concept=star", "images_per_prompt=2", "threads=1", *ev.RATE_OVERRIDES]
    outs = []
    for i in range(2):
        cfg = ev.compose([*overrides, f"paths.cache_dir={tmp_path / f'cache{i}'}"])
        run_cell(cfg, tmp_path / f"out{i}")
        outs.append(tmp_path / f"out{i}")
    env = run_env(tmp_path / "cache-cli")
    proc = subprocess.run([sys.executable, "-m", "emma.run", *overrides, f"hydra.run.dir={tmp_path / 'out-cli'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs.append(tmp_path / "out-cli")
    metrics = [_metrics(o) for o in outs]
    assert metrics[0] == metrics[1] == metrics[2]
    hashes = [[json.loads(line)["image_hash"] for line in (o / "samples.jsonl").read_text().splitlines()]
              for o in outs]
    assert hashes[0] == hashes[1] == hashes[2]
    erased = [json.loads((o / "results.json").read_text())["versions"]["model"]["erased_fingerprint"] for o in outs]
    assert erased[0] == erased[1] == erased[2]
    runtime = json.loads((outs[2] / "results.json").read_text())["versions"]["runtime"]
    assert runtime["torch_threads"] == 1


def test_a_style_concept_runs_in_the_style_domain():
    assert ev.concept_overrides("striped") == ["domain=tinyworld_style", "concept=striped"]
    assert ev.concept_overrides("circle") == ["concept=circle"]
    cfg = ev.compose(["method=uce", *ev.concept_overrides("dotted")])
    assert cfg.domain.name == "tinyworld_style" and cfg.concept == "dotted"
    assert ev.grid_prompts("dotted")[:5] == ["a star in dotted style"] * 4 + ["a star in striped style"]


def test_a_cell_that_stops_with_an_error_is_a_failing_row_of_the_report(tmp_path, monkeypatch):
    from emma.errors import ConfigError

    def fake(method, concept, *, seed=0, **kw):
        if method == "ca" and concept == "square":
            raise ConfigError("CA anchor of 'square' is the concept itself; pick a different anchor")
        ra = 0.9 if method == "none" else 0.85
        return ev.CellRates(method, concept, seed, 1, 0.0 if method == "none" else 1.0, ra, 10, 50, 1.0, 2.0,
                            {"learning_rate": 1e-3})

    monkeypatch.setattr(ev, "evaluate_cell", fake)
    monkeypatch.setattr(ev, "preset_values", lambda m, c: c)
    out, js = tmp_path / "t.md", tmp_path / "t.json"
    ev.main(["--methods", "uce,ca", "--concepts", "circle,square", "--out", str(out), "--json", str(js), "--no-grid"])
    data = json.loads(js.read_text())
    cells = [(r["method"], r["concept"]) for r in data["rows"]]
    assert cells == [("uce", "circle"), ("uce", "square"), ("ca", "circle")]
    assert data["errors"] == [{"method": "ca", "concept": "square", "seed": 0,
                               "error": "CA anchor of 'square' is the concept itself; pick a different anchor"}]
    text = out.read_text()
    assert "| uce | 2 | 1.00 |" in text and "| 2 of 2 |" in text.split("| uce |")[1].split("\n")[0]
    assert "| 1 of 1 (**no**) |" in text.split("| ca |")[1].split("\n")[0]  # its second cell stopped
    assert "- ca / square (seed 0): stopped with an error: CA anchor of 'square'" in text
    absent = text.split("Not in this table (no cell measured for it): ")[1].split(".\n")[0].split(", ")
    assert {"esd", "esd_u", "advunlearn", "sld"} <= set(absent) and not {"uce", "ca", "none"} & set(absent)
    # --report reassembles the same table, error included; a later file's good cell replaces the error
    again = tmp_path / "again.md"
    ev.main(["--report", str(js), "--out", str(again), "--no-grid"])
    assert "stopped with an error" in again.read_text()
    shared = "ran in several processes at once, so a time includes waiting for a core"
    assert shared in again.read_text() and shared not in text  # times of one process vs. assembled cells
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps({"base": data["base"], "rows": [dict(data["rows"][2], concept="square")]}))
    ev.main(["--report", str(js), str(fixed), "--out", str(again), "--no-grid"])
    assert "stopped with an error" not in again.read_text()
    assert "| 2 of 2 |" in again.read_text().split("| ca |")[1].split("\n")[0]


def test_the_per_concept_table_shows_the_worst_seed_and_the_summary_counts_passing_cells():
    def row(method, seed, ea, ra):
        return ev.CellRates(method, "circle", seed, 1, ea, ra, 10, 50, 1.0, 2.0, {})

    base = ev.Bases({("circle", 0): row("none", 0, 0.0, 1.0), ("circle", 1): row("none", 1, 0.0, 1.0),
                     ("circle", 2): row("none", 2, 0.0, 0.85)})
    rows = [row("uce", 0, 1.0, 0.70), row("uce", 1, 0.7, 0.95), row("uce", 2, 0.9, 0.70)]
    text = ev.markdown(rows, base, ["circle"], "cmd", None)
    assert "| uce | 0.70 / 0.70 |" in text  # lowest EA (seed 1) and lowest RA (seeds 0 and 2)
    # each cell against the base at its own seed: seed 2's RA 0.70 passes against 0.85 (0.82 x base),
    # seed 0's fails against 1.00, seed 1 fails on EA
    assert "| uce | 3 | 0.87 |" in text and "| 1 of 3 (**no**) |" in text
    assert "- uce / circle (seed 0): RA 0.70 < 0.8 x 1.00" in text and "(seed 2)" not in text
    assert "no base-model cell at their own seed" not in text
    del base[("circle", 2)]  # a file without seed 2's base: the report says so
    assert "1 cells have no base-model cell at their own seed" in ev.markdown(rows, base, ["circle"], "cmd", None)


def test_the_page_states_the_image_counts_of_each_domain_it_shows():
    def row(concept, n_random):
        return ev.CellRates("uce", concept, 0, 1, 1.0, 1.0, 10, n_random, 1.0, 2.0, {})

    base = ev.Bases({(c, 0): ev.CellRates("none", c, 0, 1, 0.0, 1.0, 10, n, 0.0, 1.0, {})
                     for c, n in (("circle", 50), ("plain", 20))})
    both = ev.markdown([row("circle", 50), row("plain", 20)], base, ["circle", "plain"], "cmd", None)
    assert ("10 name images and 50 random-shape images per shape cell; "
            "10 name images and 20 random-style images per style cell") in both
    shapes = ev.markdown([row("circle", 50)], base, ["circle"], "cmd", None)
    assert "random-shape images per shape cell" in shapes and "style cell" not in shapes


def test_the_settings_line_keeps_a_per_domain_mapping_whole():
    """A preset mapping that names both tiny-world domains (AdvUnlearn's prompt templates) is
    shown whole on the page; one naming only the shape domain is shown as that entry."""
    both = {"tinyworld": "an image of a {}", "tinyworld_style": "a star in {} style"}
    values = ev.preset_values("advunlearn", {"concept_templates": both})
    assert values["concept_templates"] == both and values["iterations"] == 150
    shapes_only = {"tinyworld": "an image of a {}", "object": "a photo of a {}"}
    assert ev.preset_values("advunlearn", {"concept_templates": shapes_only})["concept_templates"] == "an image of a {}"


def test_esd_x_leaves_the_circle_in_its_long_descriptions(tmp_path):
    """EMMA's implicit-prompt finding on the shipped world (its frozen, distilled text encoder):
    ESD-x erasing the circle by name removes it from the name prompt but not from the suite's
    long descriptions. ``python -m emma.run method=esd concept=circle prompt_types=[name,long]``
    at seed 0 measured EA name 1.00 and EA long 0.20 (16 of 20 images still show the circle) at
    one thread, 0.90 and 0.25 at two; on tiny world 2 both were 1.00."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, run_env

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "emma.run", "method=esd", "concept=circle", "prompt_types=[name,long]",
         "metrics=rates_only", "threads=1", f"hydra.run.dir={out}"],
        cwd=ROOT, env=run_env(tmp_path / "cache"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "results.json").read_text())["metrics"]
    assert metrics["ea/name"]["value"] >= 0.8
    assert metrics["ea/long"]["value"] <= 0.6 and metrics["ea/long"]["n"] == 20


def test_a_method_failing_many_cells_gets_one_line_and_a_documented_one_links_its_limits():
    concepts = list(ev.SHAPES)
    base = ev.Bases({(c, 0): ev.CellRates("none", c, 0, 1, 0.0, 1.0, 10, 50, 0.0, 1.0, {}) for c in concepts})

    def rows(method, ea, ra):
        return [ev.CellRates(method, c, 0, 1, ea, ra, 10, 50, 1.0, 2.0, {}) for c in concepts]

    text = ev.markdown(rows("fmn", 1.0, 0.2) + rows("spm", 0.5, 1.0) + rows("uce", 1.0, 1.0)[:7]
                       + [ev.CellRates("uce", "diamond", 0, 1, 0.7, 1.0, 10, 50, 1.0, 2.0, {})],
                       base, concepts, "cmd", None)
    failing = text.split("## Cells below the bar")[1]
    assert "- fmn: 8 of 8 cells, 0 on EA name and 8 on RA random (why: [methods_tinyworld_limits.md]" in failing
    assert "- spm: 8 of 8 cells, 8 on EA name and 0 on RA random\n" in failing  # not documented: no link
    assert "- uce / diamond (seed 0): EA 0.70 < 0.8\n" in failing  # one failing cell: listed by itself
    assert "fmn / circle" not in failing


def test_a_miss_on_plain_links_why_plain_is_the_hardest_style():
    base = ev.Bases({(c, 0): ev.CellRates("none", c, 0, 1, 0.0, 1.0, 10, 20, 0.0, 1.0, {}) for c in ev.STYLES})
    rows = [ev.CellRates("spm", c, 0, 1, 0.0 if c == "plain" else 1.0, 1.0, 10, 20, 1.0, 2.0, {})
            for c in ev.STYLES] + [ev.CellRates("uce", "dotted", 0, 1, 0.7, 1.0, 10, 20, 1.0, 2.0, {})]
    failing = ev.markdown(rows, base, list(ev.STYLES), "cmd", None).split("## Cells below the bar")[1]
    assert ("- spm / plain (seed 0): EA 0.00 < 0.8 (plain is what a meaningless style word draws: "
            "[methods_tinyworld_limits.md](methods_tinyworld_limits.md#plain-the-style-a-meaningless-style-word-draws))"
            ) in failing
    assert "- uce / dotted (seed 0): EA 0.70 < 0.8\n" in failing


def test_the_settings_line_names_only_preset_files_that_exist():
    sld = ev.settings_line("sld", {}, ["circle", "plain"])
    assert sld == "- **sld**: `conf/method/sld.yaml` (no tiny-world preset: its own settings)"
    ca = ev.settings_line("ca", {}, ["circle", "plain"])
    assert ca.startswith("- **ca**: `conf/method/ca.yaml` + `conf/preset/method/ca_tiny.yaml`: `{")
    assert '"num_class_images": 192' in ca.split("; on tinyworld_style")[0]
    assert ca.endswith("on tinyworld_style also `conf/preset/method_domain/ca_tiny_tinyworld_style.yaml`: "
                       '`{"num_class_images": 128}`')


def test_the_page_says_what_one_cell_of_n_name_images_can_show():
    """The bar's resolution is computed from the rows' image counts: the pass probability is the
    binomial tail (checked against scipy) and EA 1.0's Wilson lower end is n / (n + z^2)."""
    from scipy.stats import binom

    for n, rate in ((10, 0.9), (10, 0.95), (50, 0.9), (7, 0.8)):
        need = -(-8 * n // 10)  # ceil(0.8 n)
        assert ev.pass_probability(n, rate) == pytest.approx(binom.sf(need - 1, n, rate), abs=1e-12)
    assert ev.pass_probability(10, 0.9) == pytest.approx(0.9298, abs=1e-4)

    def rows(n, cells):
        return [ev.CellRates("uce", "circle", s, 1, 1.0, 1.0, n, 50, 1.0, 2.0, {}) for s in range(cells)]

    ten = ev.resolution(rows(10, 36))
    z2 = 1.959963984540054 ** 2
    assert f"EA 1.00 has the 95% interval {10 / (10 + z2):.2f}-1.00" in ten and "0.72-1.00" in ten
    assert "no single cell shows EA >= 0.8 with confidence" in ten
    assert f"all 36 together with {binom.sf(7, 10, 0.9) ** 36:.2f}" in ten and "together with 0.07" in ten
    fifty = ev.resolution(rows(50, 12))
    assert "0.93-1.00" in fifty and "no single cell" not in fifty and "all 12 together" in fifty
    assert ev.resolution([]) == ""
    page = ev.markdown(rows(10, 3), ev.Bases({("circle", s): ev.CellRates("none", "circle", s, 1, 0.0, 1.0, 10, 50,
                                                                          0.0, 1.0, {}) for s in range(3)}),
                       ["circle"], "cmd", None)
    assert "With 10 name images a cell's EA is a count out of 10" in page


def test_the_page_states_the_cells_own_images_per_prompt_and_threads(tmp_path):
    """A table of cells run with --images-per-prompt 50 says 50 (not the domain's 10), its
    --report command names the count, and the threads line is the cells' (not the report's)."""
    def row(n, threads):
        return ev.CellRates("uce", "circle", 0, threads, 1.0, 1.0, n, 5 * n, 1.0, 2.0, {})

    base = ev.Bases({("circle", 0): ev.CellRates("none", "circle", 0, 1, 0.0, 1.0, 50, 250, 0.0, 1.0, {})})
    fifty = ev.markdown([row(50, 1)], base, ["circle"], "cmd", None)
    assert "(50 images per prompt; the domain's default is 10)" in fifty and "the domain's 10 images" not in fifty
    assert "1 torch thread per cell." in fifty and "CPU threads" not in fifty
    ten = ev.markdown([row(10, 2)], base, ["circle"], "cmd", None)
    assert "(the domain's 10 images per prompt)" in ten and "2 torch threads per cell." in ten
    js = tmp_path / "cells.json"
    ev.write_json(js, base, [row(50, 1)], [])
    out = tmp_path / "page.md"
    ev.main(["--report", str(js), "--out", str(out), "--no-grid"])
    assert "--threads 1 --images-per-prompt 50  (cells run" in out.read_text()
    ev.write_json(js, base, [row(10, 1)], [])
    ev.main(["--report", str(js), "--out", str(out), "--no-grid"])
    assert "--images-per-prompt" not in out.read_text()


def test_a_page_of_selected_cells_carries_its_own_title_and_lead(tmp_path):
    base = ev.Bases({("circle", 0): ev.CellRates("none", "circle", 0, 1, 0.0, 1.0, 10, 50, 0.0, 1.0, {})})
    rows = [ev.CellRates("uce", "circle", 0, 1, 1.0, 1.0, 10, 50, 1.0, 2.0, {})]
    plain = ev.markdown(rows, base, ["circle"], "cmd", None)
    assert plain.startswith("# Erasure methods on the tiny world\n\nEach cell is")
    js = tmp_path / "cells.json"
    ev.write_json(js, base, rows, [])
    out = tmp_path / "page.md"
    ev.main(["--report", str(js), "--out", str(out), "--no-grid", "--title", "Re-check",
             "--lead", "Cells near the bar."])
    assert out.read_text().startswith("# Re-check\n\nCells near the bar.\n\nEach cell is")


def test_variants_measure_ea_on_the_concepts_other_names(tmp_path):
    """``--variants`` adds EA on the domain's variant prompts. The base model draws the circle
    from "disc", "orb", "ring" and "round blob" (model card: 1.00 of 30 images), so its EA
    there is at most one image in eight; the name and random rates are those of the plain cell."""
    plain = ev.evaluate_cell("none", "circle", seed=0, images_per_prompt=2, cache_dir=tmp_path, threads=1)
    with_v = ev.evaluate_cell("none", "circle", seed=0, images_per_prompt=2, cache_dir=tmp_path, threads=1,
                              variants=True)
    assert plain.ea_variant is None and plain.n_variant == 0
    assert with_v.n_variant == 8 and with_v.ea_variant <= 0.125
    assert (with_v.ea_name, with_v.ra_random, with_v.n_name) == (plain.ea_name, plain.ra_random, plain.n_name)


def test_the_variant_section_shows_the_lowest_variant_ea_beside_the_bar():
    concepts = ["circle", "square"]
    base = ev.Bases({(c, 0): ev.CellRates("none", c, 0, 1, 0.0, 1.0, 10, 50, 0.0, 1.0, {}) for c in concepts})
    rows = [ev.CellRates("mace", c, s, 1, 1.0, 1.0, 10, 50, 1.0, 2.0, {}, {}, ea, 40)
            for c, s, ea in (("circle", 0, 0.875), ("circle", 1, 0.425), ("square", 0, 1.0), ("square", 1, 0.9))]
    text = ev.markdown(rows, base, concepts, "cmd", None)
    assert "prompt_types=[name,random,variant]" in text
    section = text.split("## EA on the variant prompts")[1]
    assert "40 images per cell" in section
    assert "| mace | 0.80 | 0.42 | 0.90 |" in section  # mean of the four; lowest per concept
    assert "2 of 2" not in section and "passing" not in section
    plain = ev.markdown([ev.CellRates("mace", "circle", 0, 1, 1.0, 1.0, 10, 50, 1.0, 2.0, {})], base, concepts,
                        "cmd", None)
    assert "## EA on the variant prompts" not in plain and "prompt_types=[name,random]" in plain


def test_the_report_command_names_the_concepts_seeds_and_variants_that_reproduce_it(tmp_path):
    """--report's command is one that reruns its cells: the script's default --concepts is the
    shapes and its --seeds 0, so any other set is named, and --variants where cells measured it."""
    def cell(method, concept, seed, variant=None):
        return ev.CellRates(method, concept, seed, 1, 1.0, 1.0, 10, 50, 1.0, 2.0, {}, {}, variant, 40 if variant else 0)

    concepts = list(ev.SHAPES) + ["plain"]
    base = ev.Bases({(c, s): cell("none", c, s) for c in concepts for s in (0, 2)})
    js, out = tmp_path / "cells.json", tmp_path / "page.md"
    ev.write_json(js, base, [cell("uce", "circle", 0, 0.9), cell("uce", "plain", 2, 1.0)], [])
    ev.main(["--report", str(js), "--out", str(out), "--no-grid"])
    assert ("python scripts/eval_methods_tinyworld.py --methods uce --concepts circle,plain --seeds 0,2 --threads 1 "
            "--variants  (cells run") in out.read_text()
    ev.write_json(js, base, [cell("uce", c, 0) for c in ev.SHAPES], [])
    ev.main(["--report", str(js), "--out", str(out), "--no-grid"])
    assert "python scripts/eval_methods_tinyworld.py --methods uce --threads 1  (cells run" in out.read_text()
