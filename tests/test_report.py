"""`edgeq report`: the demo run's page, loaded in a real headless Chromium.

The page is checked as a reader gets it: no console errors, no request that fails (every
image inline, nothing fetched), the numbers shown equal those in the JSON files, sections
without data absent, a failed budget at the top, and a screenshot that is not blank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgeq.tasks.metrics import metric

from .conftest import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def demo(digits_run, digits_int8, tmp_path_factory):
    """The demo's folder as `make demo` leaves it, plus profile and analyze weights output."""
    from click.testing import CliRunner

    from edgeq.cli import cli as group

    folder = tmp_path_factory.mktemp("report") / "demo"
    folder.mkdir()
    for name in ("run.json", "history.json"):
        shutil.copy(digits_run.out_dir / name, folder / name)
    shutil.copy(digits_int8.path, folder / "digits_int8.tflite")
    shutil.copy(digits_int8.manifest, folder / "digits_int8.manifest.json")
    runner = CliRunner()

    def edgeq(*args):
        result = runner.invoke(group, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result

    tflite = folder / "digits_int8.tflite"
    edgeq("eval", tflite, "--reference", digits_run.fp32_model, "--data", "digits", "--max-drop", "1.0",
          "--json", folder / "eval.json")  # fmt: skip
    edgeq("profile", tflite, "--runs", "20", "--json", folder / "profile.json")
    edgeq("analyze", "weights", digits_run.fp32_model, "--json", folder / "weights.json", "--plots", folder / "plots")
    return folder


def _browse(page_path: Path, screenshot: Path, width: int = 1000):
    """Open the page in headless Chromium; return what a reader (and the console) saw."""
    from playwright.sync_api import sync_playwright

    seen = {"errors": [], "failed": [], "requests": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.on("console", lambda m: seen["errors"].append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: seen["errors"].append(str(e)))
        page.on("requestfailed", lambda r: seen["failed"].append(r.url))
        page.on("request", lambda r: seen["requests"].append(r.url))
        page.goto(page_path.resolve().as_uri(), wait_until="load")
        seen["sections"] = page.eval_on_selector_all("section", "els => els.map(e => e.id)")
        seen["images"] = page.eval_on_selector_all(
            "img", "els => els.map(e => ({src: e.src.slice(0, 30), w: e.naturalWidth}))"
        )
        seen["cells"] = page.eval_on_selector_all(
            "[data-field]",
            "els => els.map(e => [e.closest('tr').dataset.model || e.closest('tr').dataset.stage || "
            "e.closest('tr').dataset.device, e.dataset.field, e.innerText.trim()])",
        )
        seen["verdict_class"] = page.get_attribute("#verdict", "class")
        seen["verdict"] = page.inner_text("#verdict")
        seen["first_section_top"] = page.eval_on_selector("#verdict", "e => e.getBoundingClientRect().top")
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    return seen


def _pixel_std(png: Path) -> float:
    from PIL import Image

    return float(np.asarray(Image.open(png).convert("L"), dtype=np.float32).std())


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: deploy/test-env.sh (make test) installs Debian's package")
def test_demo_report_in_headless_chromium_shows_the_json_numbers(cli, demo, tmp_path):
    out = tmp_path / "report.html"
    result = cli("report", demo, "--out", out)
    assert result.exit_code == 0, result.output
    assert "passes" in result.stdout and str(out) in result.stdout
    html = out.read_text()
    assert "http://" not in html and "https://" not in html  # nothing to fetch

    shot = tmp_path / "page.png"
    seen = _browse(out, shot)
    assert seen["errors"] == [] and seen["failed"] == []
    assert all(url.startswith(("file:", "data:")) for url in seen["requests"]), seen["requests"]
    # sections with data are there; those without (no sensitivity, plan or fleet files) are absent
    assert seen["sections"] == ["verdict", "models", "training", "weights", "ops", "provenance"]
    assert seen["images"] and all(i["src"].startswith("data:image/") and i["w"] > 0 for i in seen["images"])
    assert seen["verdict_class"] == "verdict pass" and "budget 1 pp: pass" in seen["verdict"]
    assert "n=359" in seen["verdict"] and "95% CI" in seen["verdict"]

    ev = json.loads((demo / "eval.json").read_text())
    run = json.loads((demo / "run.json").read_text())
    profile = json.loads((demo / "profile.json").read_text())
    cells = {(row, field): text for row, field, text in seen["cells"]}
    q = "digits_int8.tflite"
    assert ev["metric"] == "accuracy" and cells[(q, "value")] == f"accuracy {ev['value']:.2%}"
    assert cells[(q, "worse_by")] == metric("accuracy").show_change(ev["worse_by"])
    assert cells[(q, "agreement")] == f"{ev['agreement']:.2%}"
    assert cells[(q, "sqnr_db")] == f"{ev['sqnr_db']:.1f}"
    assert cells[(q, "size")] == f"{ev['size_bytes'] / 1024:.1f} KiB"
    assert cells[(q, "median_ms")] == f"{profile['model']['runs'][0]['latency']['median_ms']:.3f}"
    assert cells[(q, "rss_mb")] == f"{profile['model']['runs'][0]['memory']['peak_rss_run_mb']:.1f}"
    assert cells[("fp32.keras (FP32 reference)", "value")] == f"accuracy {ev['reference_value']:.2%}"
    for stage in run["results"]:
        assert cells[(stage["name"], "test_value")] == f"accuracy {stage['test_value']:.2%}"
        assert cells[(stage["name"], "val_value")] == f"accuracy {stage['val_value']:.2%}"
    assert _pixel_std(shot) > 20  # a page with text, tables and plots, not a blank one

    # the same page on a phone: nothing wider than the screen but the scrolling tables
    phone = _browse(out, tmp_path / "phone.png", width=390)
    assert phone["errors"] == [] and phone["failed"] == []


def test_failed_budget_is_the_first_thing_on_the_page(cli, demo, digits_run, tmp_path):
    folder = tmp_path / "strict"
    shutil.copytree(demo, folder)
    gated = cli("eval", folder / "digits_int8.tflite", "--reference", digits_run.fp32_model, "--data", "digits",
                "--max-drop", "-5", "--json", folder / "eval.json")  # fmt: skip
    assert gated.exit_code == 4  # the gate failed, and its JSON was written
    out = tmp_path / "report.html"
    result = cli("report", folder, "--out", out)
    assert result.exit_code == 0, result.output
    assert "FAILS" in result.stdout
    html = out.read_text()
    body = html[html.index("<body>") :]
    assert body.index('id="verdict"') < body.index("<section", body.index('id="verdict"') + 1)
    headline = body[body.index('class="headline">') :].split("</div>")[0]
    assert "FAILS" in headline and "budget -5 pp: FAIL" in headline and "digits_int8.tflite" in headline
    if CHROMIUM:
        seen = _browse(out, tmp_path / "fail.png")
        assert seen["verdict_class"] == "verdict fail" and seen["sections"][0] == "verdict"
        assert seen["first_section_top"] < 120  # at the top, above everything else


def test_bad_inputs_are_one_line_errors_and_write_nothing(cli, tmp_path):
    stranger = tmp_path / "other.json"
    stranger.write_text(json.dumps({"hello": 1}))
    out = tmp_path / "r.html"
    assert_one_line_error(cli("report", stranger, "--out", out), "other.json", "not an edgeq output")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_one_line_error(cli("report", broken, "--out", out), "broken.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(cli("report", empty, "--out", out), "nothing to report")
    assert not out.exists() and not list(tmp_path.glob(".*"))  # no half-written page


def test_sensitivity_and_plan_sections(cli, digits_run, tmp_path):
    """analyze sensitivity and plan output become their sections (bars, frontier), without a browser."""
    from edgeq.report.build import render
    from edgeq.report.sources import collect

    sens = tmp_path / "s.json"
    ok = cli("analyze", "sensitivity", digits_run.fp32_model, "--data", "digits", "--calib-samples", "50",
             "--method", "fast", "--json", sens)  # fmt: skip
    assert ok.exit_code == 0, ok.output
    html, context = render(collect([sens]))
    layers = [r["layer"] for r in context["sensitivity"][0]["rows"]]
    assert set(layers) >= {"conv1", "conv2", "conv3", "logits"}
    ranked = json.loads(sens.read_text())["fast"]  # the page keeps the analysis's ranking, no other
    assert layers == [f["layer"] for f in ranked]
    assert [r["sqnr"] for r in context["sensitivity"][0]["rows"]] == [f["channel_sqnr_db"] for f in ranked]
    assert 'id="sensitivity"' in html and "data:image/svg+xml;base64," in html
    assert 'id="models"' not in html and 'id="training"' not in html  # no data, no section


def test_a_device_that_throttled_fails_the_page(cli, tmp_path, monkeypatch):
    """A fleet profile (results/DEVICE/*.profile.json) taken while the device throttled: flagged at the top."""
    import os

    from edgeq.report.build import render
    from edgeq.report.sources import collect

    from .runtime.conftest import INT8
    from .runtime.test_cli import _pi_like

    sysfs, bin_dir = _pi_like(tmp_path, ["0x0", "0x20002"])
    monkeypatch.setenv("EDGEQ_SYSFS", str(sysfs))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "results" / "pi-hot" / "tiny_int8.profile.json"
    out.parent.mkdir(parents=True)
    assert cli("profile", INT8, "--runs", "5", "--json", out).exit_code == 0
    html, context = render(collect([tmp_path / "results"]))
    assert context["verdict"]["status"] == "fail" and "pi-hot throttled" in context["verdict"]["headline"]
    (row,) = context["fleet"]
    assert row["device"] == "pi-hot" and row["throttled"] == "THROTTLED" and row["temperature_c"] == "61.2 → 61.2"


def test_a_record_not_as_edgeq_writes_it_is_named_in_one_line(cli, tmp_path):
    """What the fuzzer found: a hand-edited or cut record made the report raise a traceback from
    deep inside a section; now the page names the file in one line."""
    record = json.loads((ROOT / "tests" / "data" / "fuzz" / "eval.json").read_text())
    record["verdicts"][0]["interval95"] = []  # as a hand edit or another tool might leave it
    broken = tmp_path / "run" / "eval.json"
    broken.parent.mkdir()
    broken.write_text(json.dumps(record))
    shutil.copy(ROOT / "tests" / "data" / "fuzz" / "profile.json", tmp_path / "run" / "profile.json")
    result = cli("report", tmp_path / "run", "--out", tmp_path / "r.html")
    assert_one_line_error(result, str(broken), "cannot read this eval record")
    assert not (tmp_path / "r.html").exists()
