"""docs/scale.md's tables are written by `python -m jobs.stress_readme` from the results `fedsim stress --save`
keeps in results/bench/, and a million registered clients run through the stress command."""

from __future__ import annotations

import pandas as pd

import jobs.stress
from jobs import stress_readme
from jobs.cli import main as cli
from jobs.readme_blocks import read_blocks
from tests.conftest import ROOT


def test_every_stress_table_on_the_scale_page_is_the_one_its_result_files_give():
    text = stress_readme.PAGE.read_text(encoding="utf-8")
    names = list(read_blocks(text, "stress"))
    assert {"fedavg", "fedavg_participants", "fedgdkd", "million", "million_personal"} <= set(names)
    assert stress_readme.stale() == [], "regenerate them with `python -m jobs.stress_readme`"


def test_repeats_show_as_medians_and_round_time_relative_to_the_fewest_clients():
    df = pd.DataFrame({
        "registered": [10, 1000, 10, 1000, 1000], "participants": 5, "skip_late": False, "repeat": [0, 0, 1, 1, 2],
        "s_per_round": [1.0, 1.5, 2.0, 2.5, 9.0], "startup_s": 3.0, "peak_rss_gb": 2.0, "peak_rss_driver_gb": 1.0,
        "peak_rss_workers_gb": 0.5, "object_store_mb": 10.0, "computed": 5.0, "spilled_states": [0, 7, 0, 9, 8],
        "status": ["ok", "ok", "ok", "ok", "failed: boom"]})
    lines = stress_readme.render(df, "Command: `x`.").splitlines()
    assert lines[2] == "| 10 | 5 | no | 1.500 | 1.00× | 3.0 | 2.00 (1.00 / 0.50) | 10 | 5 | 0 |"
    assert lines[3] == "| 1,000 | 5 | no | 2.000 | 1.33× | 3.0 | 2.00 (1.00 / 0.50) | 10 | 5 | 8 |"
    assert lines[-1] == "Command: `x`. Medians of 2 interleaved repeats. 1 point(s) failed and are left out."


def test_the_stress_command_runs_a_million_registered_clients_and_saves_its_table(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs.stress, "BENCH", tmp_path / "bench")
    out = tmp_path / "stress"
    code = cli(["stress", f"{ROOT}/configs/stress/million.yaml", "--clients", "1000000", "--rounds", "2",
                "--participants", "10", "--repeat", "2", "--in-process", "--out", str(out), "--save", "tiny",
                "-o", "runtime.backend=local", "-o", "runtime.threads=1"])
    assert code == 0
    saved = pd.read_csv(tmp_path / "bench" / "stress_tiny.csv")
    assert saved["registered"].tolist() == [1000000, 1000000] and saved["repeat"].tolist() == [0, 1]
    assert (saved["status"] == "ok").all() and "run_dir" not in saved
    md = (tmp_path / "bench" / "stress_tiny.md").read_text()
    assert "--repeat 2" in md and "--save tiny" in md and "| repeat |" in md
    table = stress_readme.block("tiny", tmp_path / "bench")
    assert "| 1,000,000 | 10 | no |" in table and "Medians of 2 interleaved repeats." in table


def test_bad_stress_flags_are_one_line_errors(tmp_path, capsys):
    config = f"{ROOT}/configs/stress/million.yaml"
    assert cli(["stress", config, "--clients", "10", "--save", "../x", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "fedsim: error: --save: '../x' is not a name of lowercase letters, " \
                                              "digits and _"
    assert cli(["stress", config, "--clients", "10", "--repeat", "0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "fedsim: error: --repeat: must be from 1 to 1000, got 0"
    out = tmp_path / "out"
    assert cli(["stress", config, "--clients", "10", "--rounds", "99999999", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "fedsim: error: --rounds: must be from 1 to 1000000, got 99999999"
    assert not out.exists()  # refused before the folder, the table and a process per point


def test_stress_out_that_cannot_be_a_folder_is_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile, afile / "sub"):
        assert cli(["stress", f"{ROOT}/configs/stress/million.yaml", "--clients", "10", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"fedsim: error: --out: cannot make the folder {out} ("), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


BROKEN_TABLES = {
    "empty": b"",
    "binary": bytes(range(256)) * 4,
    "other columns": b"a,b\n1,2\n",
    "text for numbers": b"registered,participants,skip_late,status,s_per_round,startup_s,peak_rss_gb,"
                        b"peak_rss_driver_gb,peak_rss_workers_gb,object_store_mb,computed\n"
                        b"10,5,False,ok,fast,3,2,1,0.5,10,5\n",
    "an infinite count": b"registered,participants,skip_late,status,s_per_round,startup_s,peak_rss_gb,"
                         b"peak_rss_driver_gb,peak_rss_workers_gb,object_store_mb,computed\n"
                         b"1e400,5,False,ok,1,3,2,1,0.5,10,5\n",
    "a fractional count": b"registered,participants,skip_late,status,s_per_round,startup_s,peak_rss_gb,"
                          b"peak_rss_driver_gb,peak_rss_workers_gb,object_store_mb,computed\n"
                          b"10,2.5,False,ok,1,3,2,1,0.5,10,5\n",
}


def test_a_damaged_stress_table_is_one_line_naming_it(tmp_path, capsys):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "stress_x.md").write_text("Command: `fedsim stress c.yaml --save x`\n")
    readme = tmp_path / "README.md"
    readme.write_text("<!-- stress:x -->\nold\n<!-- /stress:x -->\n")
    for kind, content in BROKEN_TABLES.items():
        (bench / "stress_x.csv").write_bytes(content)
        try:
            stress_readme.block("x", bench)
        except stress_readme.ConfigError as exc:
            assert str(exc).startswith(f"{bench / 'stress_x.csv'}: "), (kind, exc)
            assert "\n" not in str(exc), kind
        else:
            raise AssertionError(f"{kind}: accepted")
    (bench / "stress_x.csv").write_text("registered,participants,skip_late,status,s_per_round,startup_s,peak_rss_gb,"
                                        "peak_rss_driver_gb,peak_rss_workers_gb,object_store_mb,computed\n"
                                        "10,5,False,ok,0,3,2,1,0.5,10,5\n")
    assert "| 10 | 5 | no | 0.000 | n/a |" in stress_readme.block("x", bench)  # no ratio to a zero base
    (bench / "stress_x.md").write_bytes(bytes(range(256)))
    try:
        stress_readme.block("x", bench)
    except stress_readme.ConfigError as exc:
        assert str(exc).startswith(f"{bench / 'stress_x.md'}: not text"), exc
    else:
        raise AssertionError("a binary .md accepted")
    assert readme.read_text() == "<!-- stress:x -->\nold\n<!-- /stress:x -->\n"


def test_stress_readme_refuses_an_unknown_flag_in_one_line(capsys):
    try:
        code = stress_readme.main(["--nope"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m jobs.stress_readme: error: unrecognized arguments: --nope"]
