"""The getting-started guide's account of `make run` is written by `python -m jobs.demo_summary` from a measured
run."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import yaml

from jobs import demo_summary


def test_the_page_block_is_the_saved_measurement() -> None:
    assert not demo_summary.stale(), "regenerate it with `python -m jobs.demo_summary`"


def fake_run(folder, accuracy: list[float], late: list[int]):
    """A run folder with the tables and config that a demo run leaves (8 clients a round)."""
    folder.mkdir(parents=True)
    pd.DataFrame({"round": range(len(accuracy)), "accuracy": accuracy, "stragglers": late}).to_parquet(
        folder / "rounds.parquet")
    # the first late client of each round also failed: it is recorded "failed", and was late all the same
    rows = [{"round": r, "client": c, "status": ("failed" if c == 0 else "late") if c < n else "ok"}
            for r, n in enumerate(late) for c in range(8)]
    pd.DataFrame(rows).to_parquet(folder / "clients.parquet")
    (folder / "config.yaml").write_text("data: {num_clients: 20}\nparticipation: {clients_per_round: 8}\n")
    (folder / "meta.json").write_text(json.dumps({"backend": "LocalBackend"}))
    return folder


def test_figures_count_rounds_from_one_and_take_a_float32_95_as_reached(tmp_path) -> None:
    run = fake_run(tmp_path / "run", [0.5, 0.91, 0.9499999880790710, 0.97, 0.96], late=[1, 2, 2, 3, 1])
    s = demo_summary.summarise(run)
    assert s["rounds_to"] == {"0.90": 2, "0.95": 3}
    assert (s["best_accuracy"], s["best_after_rounds"], s["final_accuracy"]) == (0.97, 4, 0.96)
    assert s["late_per_round"] == [1, 3] and (s["clients"], s["per_round"], s["rounds"]) == (20, 8, 5)
    text = demo_summary.render({**s, "wall_s": 12.3, "cpus": 2, "date": "d", "command": "c"})
    assert "**97.0% best (after 4 rounds) / 96.0% final" in text and "95% after 3 rounds" in text
    assert "1–3 of the 8 updates" in text and "took 12 s of wall time" in " ".join(text.split())


def test_a_target_never_reached_says_so(tmp_path) -> None:
    s = demo_summary.summarise(fake_run(tmp_path / "run", [0.5, 0.8], late=[0, 0]))
    assert s["rounds_to"] == {"0.90": None, "0.95": None}
    assert "never 90%, never 95%" in demo_summary.render({**s, "wall_s": None, "date": "d", "command": "c"})


@pytest.fixture
def readme_copy(tmp_path, monkeypatch):
    """The page and the saved figures redirected to copies, so a test never writes the real ones."""
    readme = tmp_path / "getting-started.md"
    shutil.copy(demo_summary.PAGE, readme)
    monkeypatch.setattr(demo_summary, "PAGE", readme)
    monkeypatch.setattr(demo_summary, "SAVED", tmp_path / "demo.json")
    return readme


def test_it_runs_the_config_times_it_and_writes_the_block(readme_copy, tmp_path, monkeypatch) -> None:
    cfg = yaml.safe_load((demo_summary.ROOT / "configs" / "demo.yaml").read_text())
    cfg.update(rounds=2, runtime={"backend": "local"})
    cfg["data"]["num_clients"] = 10
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr(demo_summary, "CONFIG", str(tiny))
    assert demo_summary.main(["--out", str(tmp_path / "runs")]) == 0
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved["rounds"] == 2 and saved["clients"] == 10 and saved["wall_s"] > 0
    assert saved["command"] == "python -m jobs.demo_summary" and saved["run"].startswith("demo-")
    assert not demo_summary.stale()
    block = readme_copy.read_text().split("<!-- demo:headline -->\n")[1].split("<!-- /demo:headline -->")[0]
    assert block == demo_summary.render(saved) and "of wall time" in block


def test_a_folder_that_is_not_a_run_is_one_line_and_exit_2(readme_copy, tmp_path, capsys) -> None:
    before = readme_copy.read_text()
    assert demo_summary.main(["--from", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a run folder" in err
    assert readme_copy.read_text() == before and not (tmp_path / "demo.json").exists()


@pytest.mark.parametrize("config, problem", [("- a list\n", "expected a mapping"), ("data: 5\n", "not a run's config"),
                                             ("data: {num_clients: many}\nparticipation: {}\n", "not a run's config"),
                                             ("data: [\n", "unreadable (")])
def test_a_run_whose_config_is_not_a_runs_is_one_line_and_exit_2(readme_copy, tmp_path, capsys, config,
                                                                   problem) -> None:
    before = readme_copy.read_text()
    run = fake_run(tmp_path / "run", [0.5, 0.8], late=[0, 0])
    (run / "config.yaml").write_text(config)
    assert demo_summary.main(["--from", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"demo_summary: error: {run / 'config.yaml'}: {problem}"), err
    assert readme_copy.read_text() == before


@pytest.mark.parametrize("args, damage, message", [
    (["--from", ""], None, "--from: give a run folder, not an empty string"),
    (["--out", ""], None, "--out: give a folder, not an empty string"),
    (["--from", "RUN"], "nan", "rounds.parquet: not the demo's table (it needs an accuracy for every round"),
    (["--from", "RUN"], "no block", "getting-started.md: no <!-- demo:headline --> block to write into"),
])
def test_what_cannot_be_summarised_writes_nothing(readme_copy, tmp_path, capsys, args, damage, message) -> None:
    """Neither the page nor the saved figures change, and a bad argument fails before the demo runs."""
    run = fake_run(tmp_path / "run", [0.5, float("nan") if damage == "nan" else 0.8], late=[0, 0])
    if damage == "no block":
        readme_copy.write_text("# no block here\n")
    before = readme_copy.read_text()
    assert demo_summary.main([str(run) if a == "RUN" else a for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("demo_summary: error: ") and message in err[0], err
    assert readme_copy.read_text() == before and not (tmp_path / "demo.json").exists()
