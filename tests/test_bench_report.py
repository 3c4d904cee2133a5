"""The README's speed block: written from results/bench/fedavg.json by `bench.report --readme`, with every target
ratio marked met or not from the same invocation's medians."""

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


def test_readme_option_rewrites_only_the_bench_block(tmp_path):
    import json

    summary = tmp_path / "fedavg.json"
    summary.write_text(json.dumps(crafted()))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:fedavg -->\nold\n<!-- /bench:fedavg -->\n"
                      "<!-- reproduce:x -->\nkeep\n<!-- /reproduce:x -->\n")
    assert report.main([str(summary), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert read_blocks(text, "reproduce") == {"x": "keep\n"}
    body = read_blocks(text, "bench")["fedavg"]
    assert body == report.readme_block(report.read_summary(summary), str(summary))
    assert "| fedsim local / pfl, s/round (≤ 1x) | 1.10x **not met** | n/a |" in body
    assert report.main([str(summary), "--readme", str(readme)]) == 0 and readme.read_text() == text  # idempotent


def test_readme_without_the_block_is_one_line_and_untouched(tmp_path):
    import json

    summary = tmp_path / "fedavg.json"
    summary.write_text(json.dumps(crafted()))
    readme = tmp_path / "README.md"
    readme.write_text("no block here\n")
    proc = subprocess.run([sys.executable, "-m", "bench.report", str(summary), "--readme", str(readme)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and readme.read_text() == "no block here\n"
    assert proc.stderr.strip() == f"bench.report: error: {readme}: no <!-- bench:fedavg --> ... " \
                                  "<!-- /bench:fedavg --> block"


def test_readme_speed_block_is_the_committed_summary():
    blocks = read_blocks((ROOT / "README.md").read_text(encoding="utf-8"), "bench")
    assert "fedavg" in blocks, "README.md has no <!-- bench:fedavg --> block"
    expected = report.readme_block(report.read_summary(SUMMARY), "results/bench/fedavg.json")
    assert blocks["fedavg"] == expected, "README.md's speed table differs from results/bench/fedavg.json: " \
                                         "run `python -m bench.report results/bench/fedavg.json --readme`"


def test_readme_scale_block_is_the_committed_scale_report():
    blocks = read_blocks((ROOT / "README.md").read_text(encoding="utf-8"), "bench")
    assert "scale" in blocks, "README.md has no <!-- bench:scale --> block"
    expected = report.markdown_block(ROOT / "results" / "bench" / "scale.md")
    assert expected.splitlines()[1].startswith("Command: `python -m bench.scale_bench")  # the title is dropped
    assert blocks["scale"] == expected, "README.md's scale table differs from results/bench/scale.md: " \
                                        "run `python -m bench.report results/bench/fedavg.json --readme`"
