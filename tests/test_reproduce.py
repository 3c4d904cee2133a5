"""jobs.reproduce: the manifest, the paper and direction columns, empty cells past the rounds run, docs blocks,
and the whole command end to end in --quick mode."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fedsim.errors import ConfigError
from jobs import reproduce as rp
from jobs.sweep import Sweep, progress, score, summary
from tests.conftest import ROOT
from tests.forked import run_module

REPO = Path(ROOT)


@pytest.fixture(autouse=True)
def at_repository_root(monkeypatch):
    """The manifest names its sweep files and configs relative to the repository root, as the command runs."""
    monkeypatch.chdir(REPO)


def figure(arm, value, reference=None, reference_value=None, grid=None):
    return rp.PaperFigure(arm=arm, value=value, source="Table X", reference=reference,
                          reference_value=reference_value, grid=grid or {})


# ---- direction holds? ----

@pytest.mark.parametrize("ours,ours_ref,paper,paper_ref,holds", [
    (0.9, 0.8, 70.0, 60.0, True),    # both above the reference
    (0.7, 0.8, 50.0, 60.0, True),    # both below
    (0.9, 0.8, 50.0, 60.0, False),   # ours above, the paper's below
    (0.7, 0.8, 70.0, 60.0, False),
    (0.8, 0.8, 60.0, 60.0, True),    # both level
    (0.8, 0.8, 61.0, 60.0, False),   # level here, not in the paper
])
def test_direction_compares_signs_of_the_differences(ours, ours_ref, paper, paper_ref, holds) -> None:
    assert rp.direction_holds(ours, ours_ref, paper, paper_ref) is holds


def test_paper_cells_use_the_reference_arms_figure_or_the_given_reference_value() -> None:
    t = rp.TableSpec(id="t", sweep="s.yaml", paper=[
        figure("base", 67.0), figure("none", 63.4, reference="base"),
        figure("noise", 39.4, reference="base", reference_value=30.0)])
    ours = {("base",): 0.90, ("none",): 0.95, ("noise",): 0.95, ("other",): 0.5}
    assert rp.paper_cells(t, "base", {}, ours) == ["67 (Table X)", "reference"]
    assert rp.paper_cells(t, "none", {}, ours) == ["63.4 (Table X)", "no"]    # ours above base, the paper's below
    assert rp.paper_cells(t, "noise", {}, ours) == ["39.4 (Table X)", "yes"]  # 39.4 > 30.0, not 67.0
    assert rp.paper_cells(t, "other", {}, ours) == ["—", "—"]                 # no figure for this arm
    assert rp.paper_cells(t, "none", {}, {("base",): 0.9, ("none",): math.nan})[1] == "—"


def test_paper_cells_follow_the_grid_point_and_name_the_reference_when_there_are_several() -> None:
    t = rp.TableSpec(id="t", sweep="s.yaml", paper=[
        figure("A", 90.0, grid={"alpha": 0.1}), figure("B", 95.0, reference="A", grid={"alpha": 0.1}),
        figure("A", 99.0, grid={"alpha": 1.0}), figure("B", 98.0, reference="A", grid={"alpha": 1.0}),
        figure("C", 50.0), figure("D", 40.0, reference="C")])
    ours = {(0.1, "A"): 0.5, (0.1, "B"): 0.6, (1.0, "A"): 0.5, (1.0, "B"): 0.6}
    assert rp.paper_cells(t, "B", {"alpha": 0.1}, ours) == ["95 (Table X)", "yes (vs A)"]
    assert rp.paper_cells(t, "B", {"alpha": 1.0}, ours) == ["98 (Table X)", "no (vs A)"]


# ---- budgets past the rounds run stay empty ----

def test_a_budget_past_the_last_round_is_empty_not_the_last_value() -> None:
    c = pd.Series([0.5, 0.7, 0.6], index=[1, 2, 3])
    s = score(c, target=0.65, budgets=[2, 3, 5])
    assert s["best"] == 0.7 and s["final"] == 0.6 and s["rounds_to_target"] == 2
    assert s["at_2"] == 0.7 and s["at_3"] == 0.6 and math.isnan(s["at_5"])
    sparse = pd.Series([0.5, 0.8], index=[2, 4])  # evaluated every 2nd round
    assert score(sparse, None, [3, 4, 5]) == pytest.approx({"best": 0.8, "final": 0.8, "at_3": 0.5, "at_4": 0.8,
                                                            "at_5": math.nan}, nan_ok=True)


def test_the_target_is_also_counted_in_virtual_seconds_and_client_updates() -> None:
    """Two global models a round (their rows repeat the round's counts): the target first reached in round 2, after
    7.5 virtual seconds and 3 + 4 arrived updates; a table with one column per count."""
    rounds = pd.DataFrame({"round": [0, 0, 1, 1, 2, 2], "model": ["a", "b"] * 3,
                           "accuracy": [0.1, 0.2, 0.5, 0.7, 0.9, 0.6], "virtual_time": [2.5, 2.5, 7.5, 7.5, 9.0, 9.0],
                           "arrived": [3, 3, 4, 4, 5, 5]})
    made = progress(rounds)
    assert made["updates"].tolist() == [3, 7, 12] and made["virtual_time"].tolist() == [2.5, 7.5, 9.0]
    c = pd.Series([0.2, 0.7, 0.9], index=[1, 2, 3])
    s = score(c, 0.65, [], made, ["rounds", "virtual_time", "updates"])
    assert (s["rounds_to_target"], s["time_to_target"], s["updates_to_target"]) == (2.0, 7.5, 7.0)
    never = score(c, 0.95, [], made, ["virtual_time"])
    assert math.isnan(never["time_to_target"]) and "rounds_to_target" not in never
    sw = Sweep(target=0.65, target_by=["virtual_time", "updates"])
    df = pd.DataFrame([{"arm": "x", "seed": 0, "best": 0.9, "final": 0.9, **s}])
    head, rows = summary(df, sw)
    assert head[-2:] == ["virtual s to 65%", "client updates to 65%"] and rows[0][1][-2:] == ["7.5 ± 0.0", "7.0 ± 0.0"]


def test_the_table_leaves_those_cells_empty() -> None:
    sw = Sweep(seeds=[0, 1], budgets=[2, 5], arms=[])
    df = pd.DataFrame({"arm": ["a", "a"], "seed": [0, 1], "best": [0.8, 0.9], "final": [0.7, 0.9],
                       "at_2": [0.6, 0.8], "at_5": [math.nan, math.nan]})
    head, rows = summary(df, sw)
    assert head == ["method", "best acc (%)", "final acc (%)", "acc @ 2 rounds (%)", "acc @ 5 rounds (%)"]
    assert rows == [(("a",), ["a", "85.00 ± 5.00", "80.00 ± 10.00", "70.00 ± 10.00", ""])]


# ---- named runs resume ----

def test_runs_are_named_by_their_config_and_an_unfinished_one_is_run_again(tmp_path, monkeypatch) -> None:
    import fedsim.runtime.loop
    from jobs.cached_runs import FINISHED, finished_info, run_cached, run_key
    from tests.conftest import small_config

    cfg = small_config(tmp_path, rounds=2)
    assert run_key(cfg) == run_key(small_config(tmp_path / "elsewhere", rounds=2))  # where results go is no part
    assert run_key(cfg) != run_key(small_config(tmp_path, "seed=1", rounds=2))
    assert run_key(cfg) != run_key(small_config(tmp_path, "train.lr=0.02", rounds=2))
    folder = run_cached(cfg)
    assert folder.name.startswith("t-fedavg-s0-") and finished_info(folder)["wall_s"] > 0
    (folder / FINISHED).unlink()  # as if the run had been interrupted
    (folder / "leftover").write_text("x")
    assert run_cached(small_config(tmp_path, rounds=2)) == folder
    assert (folder / FINISHED).is_file() and not (folder / "leftover").exists()
    monkeypatch.setattr(fedsim.runtime.loop, "run", lambda *a, **k: pytest.fail("ran a finished run again"))
    assert run_cached(small_config(tmp_path, rounds=2)) == folder
    monkeypatch.undo()
    import jobs.cached_runs

    monkeypatch.setattr(jobs.cached_runs, "code_version", lambda: "other-code")  # fedsim's source changed
    (folder / "stale").write_text("x")
    assert run_cached(small_config(tmp_path, rounds=2)) == folder and not (folder / "stale").exists()
    assert finished_info(folder)["code"] == "other-code"


def test_runs_in_two_processes_give_the_numbers_of_runs_one_by_one(tmp_path) -> None:
    from fedsim.results.tables import load
    from jobs.sweep import run_all
    from tests.conftest import small_config

    def tables(where, jobs):
        configs = [small_config(tmp_path / where, f"seed={s}", "runtime.threads=1", rounds=2) for s in (0, 1)]
        folders = run_all(configs, ["a", "b"], jobs=jobs)
        assert [f.parent for f in folders] == [tmp_path / where / "results"] * 2
        return [load(f)["rounds"].filter(regex=r"^(?!.*_s$)") for f in folders]

    for one, two in zip(tables("serial", 1), tables("parallel", 2)):
        pd.testing.assert_frame_equal(one, two)


def test_mechanism_cells_average_rounds_then_seeds_and_dash_what_a_run_lacks(tmp_path) -> None:
    def fake_run(name, rows):
        folder = tmp_path / name
        folder.mkdir()
        pd.DataFrame(rows).to_parquet(folder / "rounds.parquet")
        (folder / "config.yaml").write_text("name: x\n")
        (folder / "meta.json").write_text("{}")
        return str(folder)

    a, b = "train/mech_acc_before_distill", "train/mech_acc_after_distill"
    # two model rows per round carry the same round-level value: counted once
    r0 = fake_run("s0", {"round": [0, 0, 1, 1], a: [0.5, 0.5, 0.7, 0.7], b: [0.6, 0.6, 0.8, 0.8]})
    r1 = fake_run("s1", {"round": [0, 1], a: [0.4, 0.6], b: [math.nan, 0.9]})
    r2 = fake_run("avg", {"round": [0, 1], "accuracy": [0.9, 0.9]})
    raw = pd.DataFrame({"arm": ["DaFKD", "DaFKD", "FedAvg"], "seed": [0, 1, 0], "run": [r0, r1, r2]})
    t = rp.TableSpec(id="t", sweep="s.yaml", mechanism=[rp.MechanismCell(label="before → after", columns=[a, b],
                                                                         sep=" → ")])
    head, cells = rp.mechanism_cells(t, raw, ["arm"])
    assert head == ["before → after"]
    assert cells[("DaFKD",)] == ["55.0 → 80.0"]  # seeds: (0.6 → 0.7) and (0.5 → 0.9)
    assert cells[("FedAvg",)] == ["—"]
    assert raw.loc[0, a] == pytest.approx(0.6) and math.isnan(raw.loc[2, b])  # per-seed values kept in the raw rows
    t.mechanism[0].arms = ["FedAvg"]  # a cell kept to named rows: another method's same-named column stays out
    assert rp.mechanism_cells(t, raw, ["arm"])[1][("DaFKD",)] == ["—"]
    t.mechanism = [rp.MechanismCell(label="last", columns=[a], final=True)]  # a run's last round: (0.7, 0.6)
    assert rp.mechanism_cells(t, raw, ["arm"])[1][("DaFKD",)] == ["65.0"]


# ---- the manifest ----

def test_the_manifest_lists_every_embedded_table_with_at_least_three_seeds() -> None:
    m = rp.load_manifest(REPO / "configs" / "reproduce.yaml")
    ids = [t.id for t in m.tables]
    assert ids[:4] == ["single_image", "dafkd", "fedgdkd", "dosfl"]  # the seed papers' tables
    own = ["robustness", "privacy", "fedopt", "async", "compression", "personal"]  # ours: the claims in the title
    assert sorted(ids[4:]) == sorted(own)
    for t in m.tables:
        assert len(t.seeds) >= 3 and t.paper_title
        if t.id in own:
            assert not t.paper and t.mechanism
            continue
        assert t.paper
        assert any(f.reference is None for f in t.paper), f"{t.id}: no reference row"
        assert all(f.source for f in t.paper)


def write_manifest(tmp_path, table: str) -> Path:
    sweep = REPO / "configs" / "dafkd" / "embedded.yaml"
    p = tmp_path / "m.yaml"
    p.write_text(f"tables:\n  - {{id: t, sweep: {sweep}, {table}}}\n")
    return p


@pytest.mark.parametrize("table,message", [
    ("paper: [{arm: Nope, value: 1, source: s}]", "paper\\[0\\].arm: 'Nope' is not a row"),
    ("paper: [{arm: FedAvg, value: 1, source: s, grid: {data.partition.alpha: 0.5}}]", "not a grid point"),
    ("paper: [{arm: FedAvg, value: 1, source: s, reference: DaFKD}]", "reference_value: 'DaFKD' has no paper figure"),
    ("paper: [{arm: FedAvg, value: 1, source: s, reference: FedAvg}]", "not its own reference"),
    ("paper: [{arm: FedAvg, value: 101, source: s}]", "value"),
    ("compare: rounds_to_target", "compare: 'rounds_to_target' is not one of"),
    ("seeds: []", "seeds: list one or more"),
    ("dosfl: [x.yaml]", "exactly one of sweep and dosfl"),
    ("mechanism: [{label: x, columns: [train/mech_nosuch]}]", "mechanism\\[0\\].columns: \\['train/mech_nosuch'\\]"),
    ("mechanism: [{label: x, columns: [train/mech_teacher_acc], arms: [Nope]}]", "mechanism\\[0\\].arms: \\['Nope'\\]"),
])
def test_a_bad_manifest_is_a_one_line_config_error(tmp_path, table, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        rp.load_manifest(write_manifest(tmp_path, table))
    assert "\n" not in str(err.value)


def test_the_command_checks_the_whole_manifest_before_it_runs_but_not_to_name_a_table(tmp_path, capsys) -> None:
    bad = write_manifest(tmp_path, "compare: rounds_to_target")
    root = tmp_path / "out"
    assert rp.main(["--manifest", str(bad), "--root", str(root)]) == 2
    assert "compare: 'rounds_to_target' is not one of" in capsys.readouterr().err and not root.exists()
    assert rp.main(["--manifest", str(bad), "--only", "nosuch"]) == 2  # the table's id, before the rest
    assert "--only: unknown table 'nosuch'; tables: ['t']" in capsys.readouterr().err
    # in a fresh process: a mistyped table id is refused without loading the algorithms (and torch, seconds)
    probe = ("import sys; from jobs.reproduce import main; code = main(['--only', 'nosuch']); "
             "print(code, 'torch' in sys.modules, 'fedsim.algorithms' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr[-2000:]


def test_the_command_reads_its_manifest_under_a_profiler(tmp_path) -> None:
    """`python -m cProfile -m jobs.reproduce` runs the file as a __main__ that is not sys.modules["__main__"]: the
    manifest's classes must still resolve their annotations (cProfile itself turns the exit code into 0)."""
    proc = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "p.prof"), "-m", "jobs.reproduce",
                           "--only", "nosuch"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedsim: error: --only: unknown table 'nosuch'; tables: ["), \
        proc.stderr[-2000:]
    assert (tmp_path / "p.prof").is_file()


def test_a_figure_for_one_grid_point_needs_the_references_figure_at_that_point(tmp_path) -> None:
    ok = ("paper: [{arm: DaFKD, value: 95, source: s, grid: {data.partition.alpha: 0.1}}, "
          "{arm: FedAvg, value: 94, source: s, reference: DaFKD, grid: {data.partition.alpha: 0.1}}]")
    assert len(rp.load_manifest(write_manifest(tmp_path, ok)).tables[0].paper) == 2
    bad = ok.replace("{arm: FedAvg, value: 94, source: s, reference: DaFKD, grid: {data.partition.alpha: 0.1}}",
                     "{arm: FedAvg, value: 94, source: s, reference: DaFKD}")
    with pytest.raises(ConfigError, match="has no paper figure at {'data.partition.alpha': 1.0}"):
        rp.load_manifest(write_manifest(tmp_path, bad))


# ---- method page blocks ----

def test_every_table_has_a_method_page_block_equal_to_its_generated_file() -> None:
    blocks = rp.page_blocks(sorted((REPO / "docs").rglob("*.md")))
    m = rp.load_manifest(REPO / "configs" / "reproduce.yaml")
    for t in m.tables:
        assert t.id in blocks, f"no method page has a <!-- reproduce:{t.id} --> block"
        generated = REPO / "results" / "reproduce" / f"{t.id}.md"
        if generated.is_file():
            assert blocks[t.id] == generated.read_text(encoding="utf-8"), \
                f"the method page's {t.id} table differs from {generated}: run `python -m jobs.reproduce --docs`"
        else:  # a table the command has not made yet says so
            assert blocks[t.id].startswith("Not yet regenerated"), f"the {t.id} table has no generated file"


def test_paste_replaces_only_the_blocks_with_a_generated_file_on_the_page_that_holds_each(tmp_path) -> None:
    pages = [tmp_path / "one.md", tmp_path / "two.md"]
    pages[0].write_text("intro\n<!-- reproduce:a -->\nold a\n<!-- /reproduce:a -->\nend\n")
    pages[1].write_text("<!-- reproduce:b -->\nold b\n<!-- /reproduce:b -->\n")
    (tmp_path / "a.md").write_text("| new | a |\n")
    assert rp.paste(pages, tmp_path, ["a", "b"]) == ["a"]
    text = pages[0].read_text()
    assert text == "intro\n<!-- reproduce:a -->\n| new | a |\n<!-- /reproduce:a -->\nend\n"
    assert pages[1].read_text() == "<!-- reproduce:b -->\nold b\n<!-- /reproduce:b -->\n"
    assert rp.paste(pages, tmp_path, ["a"]) == ["a"] and pages[0].read_text() == text  # idempotent
    with pytest.raises(ConfigError, match="no <!-- reproduce:c -->"):
        rp.paste(pages, tmp_path, ["c"])
    with pytest.raises(ConfigError, match=f"--root {tmp_path / 'none'}: no such folder of tables"):
        rp.paste(pages, tmp_path / "none", ["a"])  # a mistyped root pastes nothing, and says so
    (tmp_path / "a.md").write_bytes(b"\xff\xfe not text")
    with pytest.raises(ConfigError, match=r"a\.md: cannot be read as text \(UnicodeDecodeError\)"):
        rp.paste(pages, tmp_path, ["a"])
    assert pages[0].read_text() == text


def test_a_table_that_cannot_be_written_after_its_runs_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    def unwritable(*args, **kwargs):
        raise IsADirectoryError(21, "Is a directory", str(tmp_path / "single_image.parquet"))

    monkeypatch.setattr(rp, "reproduce", unwritable)
    with pytest.raises(SystemExit) as exit_:  # an empty root is not the default root
        rp.main(["--root", ""])
    assert exit_.value.code == 2 and "--root: give a folder, not an empty string" in capsys.readouterr().err
    assert rp.main(["--only", "single_image", "--root", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"fedsim: error: {tmp_path / 'single_image.parquet'}: Is a directory; the same command resumes once it can "
        "be written (finished runs are reused)")


# ---- the command ----

def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -m jobs.reproduce ARGS`, forked from a process that has done the imports (tests/forked.py)."""
    return run_module("jobs.reproduce", args, timeout=timeout)


@pytest.mark.parametrize("args,message", [(["--only", "nosuch"], "--only: unknown table 'nosuch'"),
                                          (["--only", ""], "--only: unknown table ''"),
                                          (["--docs", "--quick"], "--quick tables never go into the docs"),
                                          (["--seeds", "0"], "expected an integer >= 1"),
                                          (["--docs", "--page", "/no/such/README.md"],
                                           "/no/such/README.md: cannot be read as text"),
                                          (["--docs", "--page", "/"], "/: cannot be read as text"),
                                          (["--manifest", "/no/such/m.yaml"], "error: config file not found: "
                                                                              "/no/such/m.yaml")])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, message) -> None:
    proc = run_cli(*args, "--root", str(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_quick_reproduce_end_to_end_then_resume_then_paste(tmp_path) -> None:
    """Three tables of the manifest, one of each kind (a sweep with the paper's figures, the DOSFL/FedAvg
    comparison, our own grid with mechanism cells): the others run the same code (their rows and sweeps are checked
    by loading the manifest)."""
    root = tmp_path / "quick"
    proc = run_cli("--quick", "--root", str(root), "--only", "fedgdkd,dosfl,personal", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = rp.load_manifest(REPO / "configs" / "reproduce.yaml")
    ran = [t for t in m.tables if t.id in ("fedgdkd", "dosfl", "personal")]
    for t in ran:
        md = (root / f"{t.id}.md").read_text()
        table = [line for line in md.splitlines() if line.startswith("|")]
        head = [c.strip() for c in table[0].strip("|").split("|")]
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
        arms, grid = rp.table_rows(t)
        assert len(rows) == len(arms) * len(rp.grid_points(grid, {}))
        if not t.paper:  # our own grid: its mechanism cells last, no paper columns
            assert head[-len(t.mechanism):] == [c.label for c in t.mechanism] and "paper (%)" not in head
            assert "The papers' claims it tests:" in md
        else:
            assert head[-2:] == ["paper (%)", "direction holds?"]
            assert {r[-1] for r in rows} <= {"yes", "no", "reference", "—"} | {
                f"{v} (vs {f.reference})" for f in t.paper for v in ("yes", "no")}
            assert sum(r[-1] == "reference" for r in rows) >= 1 and any(r[-1].split()[0] in ("yes", "no")
                                                                        for r in rows)
        for key in ("Data: digits", "Budget:", "Seeds: 0;", "CPUs, torch threads", "Date:", "Wall time:",
                    f"Command: `python -m jobs.reproduce --quick --root {root} --only fedgdkd,dosfl,personal`"):
            assert key in md, key
        raw = pd.read_parquet(root / f"{t.id}.parquet")
        assert len(raw) == len(rows) and set(raw["seed"]) == {0}
        for folder in rp.run_folders(raw):
            assert (Path(folder) / "rounds.parquet").is_file() and Path(folder).parent == root / "runs"
        if t.sweep is not None:
            assert {"arm", "seed", "run", "best", "final"} <= set(raw.columns)
            budget_cols = [i for i, h in enumerate(head) if h.startswith("acc @ ")]
            assert budget_cols and all(r[i] == "" for r in rows for i in budget_cols)  # 2 rounds < every budget
        else:
            assert {"arm", "seed", "dosfl_run", "fedavg_run", "dosfl_acc", "fedavg_match_round"} <= set(raw.columns)
    assert "2 rounds" in (root / "fedgdkd.md").read_text()

    folders = sorted(p.name for p in (root / "runs").iterdir())
    again = run_cli("--quick", "--root", str(root), "--only", "fedgdkd,dosfl", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("reusing") == 6 + 6 and sorted(p.name for p in (root / "runs").iterdir()) == folders

    pages = []
    for page in sorted((REPO / "docs").rglob("*.md")):
        if "reproduce:" not in page.read_text(encoding="utf-8"):
            continue
        pages.append(tmp_path / page.name)
        pages[-1].write_text(page.read_text(encoding="utf-8"))
    pasted = run_cli("--docs", "--root", str(root), *[a for p in pages for a in ("--page", str(p))])
    assert pasted.returncode == 0, pasted.stderr
    blocks = rp.page_blocks(pages)
    assert all(blocks[t.id] == (root / f"{t.id}.md").read_text() for t in ran)
