"""The speed blocks of docs/performance.md and README.md: written from results/bench/fedavg.json by
`bench.report --docs`, with every target ratio marked met or not from the same invocation's medians."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import report
from jobs.readme_blocks import read_blocks
from tests.conftest import ROOT as ROOT_DIR

ROOT = Path(ROOT_DIR)

SUMMARY = ROOT / "results" / "bench" / "fedavg.json"


def system(s_per_round=None, total_s=None, startup_s=None, shutdown_s=None, peak_rss_mb=None) -> dict:
    return {"s_per_round": s_per_round, "total_s": total_s, "startup_s": startup_s, "shutdown_s": shutdown_s,
            "peak_rss_mb": peak_rss_mb, "final_accuracy": 0.5}


def crafted() -> dict:
    """A: fedsim local 10% slower than pfl per round, Ray 20% faster than pfl's two processes; C: no pfl run."""
    a = {"workload": {"N": 100, "K": 10, "R": 5, "model": "resnet8"},
         "plain": system(s_per_round=2.0), "plain_t1": system(s_per_round=1.0),
         "pfl": system(s_per_round=1.0, total_s=10.0, peak_rss_mb=1000.0),
         "pfl_multiprocess": system(s_per_round=1.0, total_s=10.0, peak_rss_mb=2000.0),
         "fedsim_local": system(s_per_round=1.1, total_s=9.0, peak_rss_mb=900.0),
         "fedsim_ray": system(s_per_round=0.8, total_s=12.0, startup_s=5.5, shutdown_s=1.5, peak_rss_mb=2000.0)}
    c = {"workload": {"N": 10000, "K": 100, "R": 2, "model": "mlp"},
         "plain": system(s_per_round=0.1), "fedsim_local": system(s_per_round=0.14, total_s=3.0),
         "fedsim_ray": system(s_per_round=0.2, total_s=4.0, startup_s=4.0, shutdown_s=1.2),
         "flower": system(total_s=10.0)}
    return {"date": "2026-11-24T00:00:00", "ray_floor_startup_s": 4.0, "ray_floor_shutdown_s": 1.4,
            "configs": {"A": a, "C": c}}


def row(lines: list[str], label: str) -> list[str]:
    match = [line for line in lines if line.startswith(f"| {label}")]
    assert len(match) == 1, label
    return [cell.strip() for cell in match[0].strip("|").split("|")][1:]


def test_targets_are_ratios_marked_met_or_not():
    lines = report.render_targets(crafted())
    assert lines[0] == "| ratio (target) | A | C |"
    assert row(lines, "fedsim local / pfl, s/round") == ["1.10x **not met**", "n/a"]
    assert row(lines, "fedsim local / pfl, total") == ["0.90x met", "n/a"]
    assert row(lines, "fedsim Ray / pfl 2 processes, s/round") == ["0.80x met", "n/a"]
    assert row(lines, "fedsim Ray / pfl 2 processes, total") == ["1.20x **not met**", ""]  # a target for A and B
    assert row(lines, "fedsim Ray / pfl 2 processes, peak RSS") == ["1.00x met", "n/a"]
    # the plain loop's figure is the faster of its two thread counts (1.0 s for A, not 2.0 s)
    assert row(lines, "fedsim local / plain, s/round (≤ 1.05x)") == ["1.10x **not met**", ""]
    assert row(lines, "fedsim local / plain, s/round (≤ 1.5x)") == ["", "1.40x met"]
    assert row(lines, "fedsim Ray / plain, s/round (≤ 1.5x)") == ["", "2.00x **not met**"]
    assert row(lines, "fedsim Ray / Flower, total") == ["", "0.40x met"]
    assert row(lines, "fedsim Ray start-up over Ray's own, 4.00 s") == ["+1.50 s **not met**", "+0.00 s met"]
    assert row(lines, "fedsim Ray shutdown over Ray's own, 1.40 s") == ["+0.10 s met", "-0.20 s met"]


def test_docs_option_rewrites_only_the_bench_blocks(tmp_path):
    import json

    summary = tmp_path / "fedavg.json"
    summary.write_text(json.dumps(crafted()))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:headline -->\nold\n<!-- /bench:headline -->\n"
                      "<!-- reproduce:x -->\nkeep\n<!-- /reproduce:x -->\n")
    page = tmp_path / "performance.md"
    page.write_text("<!-- bench:fedavg -->\nold\n<!-- /bench:fedavg -->\n")
    assert report.main([str(summary), "--docs", str(readme), str(page)]) == 0
    text = readme.read_text()
    assert read_blocks(text, "reproduce") == {"x": "keep\n"}
    data = report.read_summary(summary)
    body = read_blocks(page.read_text(), "bench")["fedavg"]
    assert body == report.speed_block(data, str(summary))
    assert "| fedsim local / pfl, s/round (≤ 1x) | 1.10x **not met** | n/a |" in body
    headline = read_blocks(text, "bench")["headline"]
    assert headline == report.headline_block(data, str(summary))
    assert "| fedsim, one process | 1.10 (9.0) | 0.14 (3.0) |" in headline  # s/round (total s) per config
    assert "| pfl-research, one process | 1.00 (10.0) | n/a |" in headline  # C has no pfl run
    assert report.main([str(summary), "--docs", str(readme), str(page)]) == 0 and readme.read_text() == text


def test_pages_without_the_block_are_one_line_and_untouched(tmp_path):
    import json

    summary = tmp_path / "fedavg.json"
    summary.write_text(json.dumps(crafted()))
    readme = tmp_path / "README.md"
    readme.write_text("no block here\n")
    proc = subprocess.run([sys.executable, "-m", "bench.report", str(summary), "--docs", str(readme)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and readme.read_text() == "no block here\n"
    assert proc.stderr.strip() == f"bench.report: error: {readme}: no <!-- bench:fedavg --> ... " \
                                  "<!-- /bench:fedavg --> block"


PERFORMANCE = ROOT / "docs" / "performance.md"
AGAIN = "run `python -m bench.report results/bench/fedavg.json --docs`"


def test_the_performance_page_speed_block_is_the_committed_summary():
    blocks = read_blocks(PERFORMANCE.read_text(encoding="utf-8"), "bench")
    assert "fedavg" in blocks, "docs/performance.md has no <!-- bench:fedavg --> block"
    expected = report.speed_block(report.read_summary(SUMMARY), "results/bench/fedavg.json")
    assert blocks["fedavg"] == expected, f"docs/performance.md's speed table differs from its summary: {AGAIN}"


def test_the_readme_headline_is_the_committed_summary():
    blocks = read_blocks((ROOT / "README.md").read_text(encoding="utf-8"), "bench")
    assert "headline" in blocks, "README.md has no <!-- bench:headline --> block"
    expected = report.headline_block(report.read_summary(SUMMARY), "results/bench/fedavg.json")
    assert 4 <= expected.count("\n| ") - 1 <= 6  # a headline of 4 to 6 systems, not the full table
    assert blocks["headline"] == expected, f"README.md's headline differs from results/bench/fedavg.json: {AGAIN}"


def test_the_performance_page_scale_and_gpu_blocks_are_the_committed_reports():
    blocks = read_blocks(PERFORMANCE.read_text(encoding="utf-8"), "bench")
    for name in ("scale", "gpu"):
        assert name in blocks, f"docs/performance.md has no <!-- bench:{name} --> block"
        expected = report.markdown_block(ROOT / "results" / "bench" / f"{name}.md")
        assert expected.splitlines()[1].startswith("Command: `python -m bench.")  # the title is dropped
        assert blocks[name] == expected, f"docs/performance.md's {name} table differs from its report: {AGAIN}"
