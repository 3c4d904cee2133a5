"""The `fedsim` command: run, resume, show and plot runs, sweeps and stress tests.

Every user error (config, data, checkpoint, arguments) is printed as one line and exits with code 2.
Ctrl-C (exit 130) and SIGTERM (exit 143, what schedulers and `ray job stop` send) stop a run the same way:
the finished rounds' tables and checkpoint stay, the backend shuts down, and one line says how to resume.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.backend import make_backend
from actors.plugins import JOB_CONFIG_VAR
from fedsim.config.limits import MAX_WORKERS
from fedsim.errors import ConfigError, FedsimError
from fedsim.persist.storage import Location, location
from fedsim.plugins import PluginSources
from fedsim.runtime.allocator import keep_freed_blocks
from fedsim.runtime.callbacks import Callback, RunInfo
from fedsim.runtime.signals import INTERRUPTED_EXIT_CODE, TERMINATED_EXIT_CODE, catch_sigterm, sigterm_received
from jobs.args import OneLineParser, count

BROKEN_PIPE_EXIT_CODE = 141  # 128 + SIGPIPE, as a command killed by the closed pipe reports it


def print_summary(run_dir: Location) -> None:
    """The run's evaluated rounds as a table, then the best accuracy per model."""
    from fedsim.results.tables import load, summary

    rounds = load(run_dir)["rounds"]
    ev = rounds.dropna(subset=["accuracy"]) if "accuracy" in rounds else rounds.iloc[0:0]
    import pandas as pd

    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.float_format", "{:.4f}".format):
        print(summary(ev).tail(12).to_string(index=False))
    if not ev.empty:
        best = ev.groupby("model", sort=False)["accuracy"].agg(["max", "last"])
        for model, row in best.iterrows():
            print(f"{model or 'global'}: best accuracy {row['max']:.4f}, final {row['last']:.4f}")
    print(f"results: {run_dir.resolve() if isinstance(run_dir, Path) else run_dir}")


def say_where_a_job_writes(root: str) -> None:
    """Inside a submitted Ray job the working folder is Ray's unpacked copy of the user's, on the head: a relative
    results.root lands there, out of sight and deleted when Ray trims its cache. Say so at the start, in one line."""
    if JOB_CONFIG_VAR not in os.environ or "://" in root or Path(root).expanduser().is_absolute():
        return
    print(f"fedsim: in a Ray job, results.root {root!r} is inside Ray's copy of the working folder on the head: "
          f"results go to {Path(root).resolve()}, which Ray deletes when it trims its cache; set results.root to a "
          "folder every node mounts or a bucket (s3://...)", file=sys.stderr)


def _resume_conflicts(args: argparse.Namespace) -> None:
    """A resumed run keeps its saved config: a CONFIG or -o overrides next to --resume are refused, not ignored."""
    if args.config:
        raise ConfigError(f"--resume {args.resume} takes no CONFIG ({args.config}): a resumed run keeps its saved "
                          "config; start a new run with the CONFIG instead")
    if args.override:
        shown = " ".join(f"-o {o}" for o in args.override)
        raise ConfigError(f"--resume {args.resume} cannot take overrides ({shown}): a resumed run keeps its saved "
                          f"config; to extend it, edit rounds in {location(args.resume, '--resume') / 'config.yaml'}")


def _after_last_round(rounds_table: Location) -> str:
    """' after round R' for the last round the stopped run's table kept (the signal may land between writing
    the table and the progress callback), or '' if the table cannot be read."""
    from fedsim.results.tables import read_table

    try:
        kept = read_table(rounds_table)["round"]
    except (FedsimError, KeyError):
        return ""
    return f" after round {int(kept.max())}" if len(kept) else ""


class _Started(Callback):
    """Remembers the run folder, for the line that says how to resume an interrupted run."""

    run_dir: Location | None = None

    def on_setup_end(self, run: RunInfo) -> None:
        self.run_dir = run.run_dir


def cmd_run(args: argparse.Namespace) -> int:
    from fedsim.configure import load_config
    from fedsim.runtime.rundir import resume_config

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sources = None
    if args.resume:
        _resume_conflicts(args)
        sources = PluginSources(tuple(Path(p) for p in args.plugins), args.trust_run_plugins)
        cfg = resume_config(location(args.resume, "--resume"), sources)
    else:
        if not args.config:
            raise FedsimError("fedsim run: give a CONFIG file, or --resume RUN")
        if args.plugins or args.trust_run_plugins:
            flag = f"--plugins {args.plugins[0]}" if args.plugins else "--trust-run-plugins"
            raise ConfigError(f"{flag} goes with --resume RUN; a new run names its plugins in its config (plugins:)")
        cfg = load_config(args.config, args.override)
        say_where_a_job_writes(cfg.results.root)
    if args.backend:
        cfg.runtime.backend = args.backend
    started = _Started()
    backend = make_backend(cfg, args.workers)  # before the heavy imports: a Ray backend starts Ray meanwhile
    try:
        from fedsim.runtime.callbacks import ProgressBar
        from fedsim.runtime.loop import run

        run_dir = run(cfg if not args.resume else None, backend=backend, resume=args.resume,
                      callbacks=[started] + ([] if args.quiet else [ProgressBar()]), plugin_sources=sources)
    except KeyboardInterrupt:
        word, code = ("terminated", TERMINATED_EXIT_CODE) if sigterm_received() else ("interrupted",
                                                                                      INTERRUPTED_EXIT_CODE)
        where = started.run_dir or args.resume
        saved = where and location(where) / "rounds.parquet"
        if saved and saved.exists():
            print(f"fedsim: {word}{_after_last_round(saved)}; resume with `fedsim run --resume {saved.parent}`",
                  file=sys.stderr)
        else:
            print(f"fedsim: {word} before the first round finished; nothing was written", file=sys.stderr)
        return code
    finally:
        backend.shutdown()  # run() has shut it down already, unless it failed before it began
    print_summary(run_dir)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import pandas as pd

    from fedsim.errors import CheckpointError
    from fedsim.results.tables import load, run_folder, summary, unfinished

    res = load(args.run)
    reason = unfinished(res)
    if reason is not None:  # on stderr, so that the table alone goes down a pipe
        print(f"fedsim results show: {args.run}: {reason}", file=sys.stderr)
    clients_table = run_folder(args.run) / "clients.parquet"
    if args.clients and not clients_table.is_file():
        raise CheckpointError(f"{clients_table}: missing (the run folder is incomplete)")
    df = res["clients"] if args.clients else summary(res["rounds"])
    hidden = len(df) - args.rows
    if hidden > 0:  # the first and the last rows, as many as asked for, and a line in the gap
        four = {c: df[c].map("{:.4f}".format) for c in df.columns if df[c].dtype.kind == "f"}
        df = df.assign(**four).astype(str)
        gap = pd.DataFrame([["..."] * len(df.columns)], columns=df.columns)
        df = pd.concat([df.head((args.rows + 1) // 2), gap, df.tail(args.rows // 2)], ignore_index=True)
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.4f}".format):
        print(df.to_string(index=False))
    if hidden > 0:
        print(f"({hidden} of {len(df) + hidden - 1} rows not shown; --rows N shows more)")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    import warnings

    from fedsim.results.plots import DuplicateRuns, plot_runs
    from fedsim.results.tables import SkippedRuns

    if args.partition:
        return _plot_partition(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = plot_runs(args.runs, x=args.x or "round", metrics=args.metrics or ["accuracy"], out=args.out,
                        label=args.label, title=args.title, logx=args.logx)
    for w in caught:  # the runs left out (unreadable; another's duplicate), a line each; not numpy's remarks
        if issubclass(w.category, (SkippedRuns, DuplicateRuns)):
            print(f"fedsim: {w.message}", file=sys.stderr)
    print(out)
    return 0


def _plot_partition(args: argparse.Namespace) -> int:
    """`fedsim plot --partition RUN`: the run's split (fedsim.results.partition_plot), to RUN/partition.png."""
    from fedsim.results.partition_plot import plot_partition

    if len(args.runs) != 1:
        raise FedsimError(f"--partition: name one run folder, got {len(args.runs)}")
    given = [flag for flag, value in (("--x", args.x), ("--metric", args.metrics), ("--label", args.label))
             if value is not None]
    if given:
        raise FedsimError(f"--partition draws the run's split; {', '.join(given)} "
                          f"{'belongs' if len(given) == 1 else 'belong'} to a plot of metrics")
    print(plot_partition(args.runs[0], out=args.out, title=args.title))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from jobs.sweep import from_args

    return from_args(args)


def cmd_stress(args: argparse.Namespace) -> int:
    from jobs.stress import main as stress_main

    return stress_main(args.rest)


def cmd_mechanism_reference(args: argparse.Namespace) -> int:
    from fedsim.method.contract import algorithm_names, get_algorithm

    for name in algorithm_names():
        cols = get_algorithm(name).mechanism_columns
        if cols:
            print(f"\n## {name}\n\n| column | what it measures |\n|---|---|")
            esc = lambda text: str(text).replace("|", "\\|")  # noqa: E731  (pipes inside a markdown cell)
            print("\n".join(f"| `{c}` | {esc(doc)} |" for c, doc in cols.items()))
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    from fedsim.config.knobs import describe
    from fedsim.config.schema import RunConfig
    from fedsim.method.contract import algorithm_names, get_algorithm

    def table(rows):
        out = ["| key | type | default | meaning |", "|---|---|---|---|"]
        esc = lambda text: str(text).replace("|", "\\|")  # noqa: E731  (pipes inside a markdown cell)
        out += [f"| `{k}` | {esc(t)} | `{esc(d)}` | {esc(doc)} |" for k, t, d, doc in rows]
        return "\n".join(out)

    print(table([r for r in describe(RunConfig) if not r[0].startswith("algorithm.params")]))
    for name in algorithm_names():
        rows = describe(get_algorithm(name).Params, "algorithm")
        print(f"\n**algorithm.name: {name}**\n\n" + (table(rows) if rows else "no parameters"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="fedsim", description="Federated-learning simulations on Ray.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    r = sub.add_parser("run", help="run a config (or resume a run)")
    r.add_argument("config", nargs="?", help="YAML config")
    r.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. -o rounds=5 -o train.lr=0.01")
    r.add_argument("--resume", metavar="RUN", help="continue a killed run from its last checkpoint")
    r.add_argument("--plugins", action="append", default=[], metavar="FILE",
                   help="with --resume: your copy of a plugin the run names (it must be the file the run started "
                        "with), when it is no longer at its recorded path (docs/trust.md)")
    r.add_argument("--trust-run-plugins", action="store_true",
                   help="with --resume: import the run folder's own copies of its plugins (run only folders you "
                        "trust: this runs their code)")
    r.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend")
    r.add_argument("--workers", type=count(1, MAX_WORKERS), help="number of client workers")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(fn=cmd_run)
    res = sub.add_parser("results", help="inspect runs")
    rsub = res.add_subparsers(dest="what", required=True, parser_class=OneLineParser)
    show = rsub.add_parser("show", help="print a run's table")
    show.add_argument("run")
    show.add_argument("--clients", action="store_true", help="the per-client table instead of the rounds")
    show.add_argument("--rows", type=count(1), default=60, help="at most this many rows (the first and the last)")
    show.set_defaults(fn=cmd_show)
    pl = sub.add_parser("plot", help="metrics of one or many runs as PNG, a curve per setting, mean ± std over seeds")
    pl.add_argument("runs", nargs="+", metavar="RUN", help="run folders, folders of runs, or glob patterns")
    pl.add_argument("--x", help="x axis: round, virtual_time, or the bytes sent so far, bytes_up or "
                                                 "bytes_down (default: round)")
    pl.add_argument("--metric", "--y", dest="metrics", nargs="+", metavar="METRIC",
                    help="columns of rounds.parquet, a panel each (default: accuracy)")
    pl.add_argument("--label", nargs="+", metavar="KEY",
                    help="config keys whose values label the curves (default: the keys that differ, algorithm.name "
                         "first)")
    pl.add_argument("--partition", action="store_true",
                    help="draw the split of one RUN instead: client sizes and label proportions, with its "
                         "heterogeneity (default out: RUN/partition.png)")
    pl.add_argument("--title", help="the figure's title (default: the run's name, or how many runs)")
    pl.add_argument("--logx", action="store_true", help="a logarithmic x axis (e.g. --x bytes_up across "
                                                        "compression schemes)")
    pl.add_argument("--out", help="PNG path (default: RUN/<metrics>.png, or <metrics>.png in the runs' common "
                                  "folder)")
    pl.set_defaults(fn=cmd_plot)
    sw = sub.add_parser("sweep", help="run a sweep's runs as Ray Tune trials and write one table of mean ± std")
    sw.add_argument("sweep", help="sweep file (YAML)")
    sw.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field in every run, e.g. -o rounds=5")
    sw.add_argument("--backend", choices=["ray", "local"], help="override runtime.backend in every run")
    sw.add_argument("--output-dir", metavar="DIR", help="the sweep's folder, a path or a URI (s3://...): its runs, "
                                                        "Tune's state, table.md and table.parquet (default "
                                                        "results/sweeps/<title>)")
    sw.add_argument("--resume", action="store_true", help="continue the sweep in DIR after its driver stopped")
    sw.add_argument("--parallel", type=count(1), metavar="N", help="at most N trials at once (default: all that fit)")
    sw.add_argument("--out", help="markdown output path (default DIR/table.md)")
    sw.add_argument("--dry-run", action="store_true", help="list the runs and their shares without running them")
    sw.add_argument("--fresh", action="store_true", help="rerun runs that already finished")
    sw.set_defaults(fn=cmd_sweep)
    st = sub.add_parser("stress", help="scale the client count and measure time and memory", add_help=False)
    st.add_argument("rest", nargs=argparse.REMAINDER)
    st.set_defaults(fn=cmd_stress)
    ref = sub.add_parser("config-reference", help="print every config key as a markdown table")
    ref.set_defaults(fn=cmd_reference)
    mref = sub.add_parser("mechanism-reference", help="print every method's mechanism columns as markdown")
    mref.set_defaults(fn=cmd_mechanism_reference)
    return p


STDOUT = "standard output"


class _NamedStdout:
    """sys.stdout whose write errors (a full disk, /dev/full) name it, so they read as one line like any file's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._named(self._stream.write, text)

    def writelines(self, lines: Any) -> None:
        self._named(self._stream.writelines, lines)

    def flush(self) -> None:
        self._named(self._stream.flush)

    def _named(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, STDOUT) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _refused(exc: OSError) -> str:
    """One line for a file or device that refused a read or write (permissions, a full disk); when standard output
    is what failed, it is pointed at /dev/null so the flush at exit does not fail a second time."""
    if exc.filename == STDOUT:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    reason = exc.strerror or f"{type(exc).__name__}: {exc}"
    return f"{exc.filename}: {reason}" if exc.filename else reason


def main(argv: list[str] | None = None, own_process: bool | None = None) -> int:
    """The `fedsim` command. `own_process` (default: when `argv` is the command line's) lets it tune the process it
    runs in (glibc keeps freed blocks for the next round: fedsim.runtime.allocator)."""
    if (argv is None) if own_process is None else own_process:
        keep_freed_blocks()
    argv = sys.argv[1:] if argv is None else list(argv)
    with catch_sigterm():
        if argv[:1] == ["stress"]:  # its own parser (jobs.stress) reads everything after the word, --help included
            args = argparse.Namespace(fn=cmd_stress, rest=argv[1:])
        else:
            args = build_parser().parse_args(argv)
        stdout, sys.stdout = sys.stdout, _NamedStdout(sys.stdout)
        try:
            code = args.fn(args)
            sys.stdout.flush()  # a reader that left (`fedsim ... | head`) shows here, not as a traceback at exit
            return code
        except BrokenPipeError:  # the reader has what it wanted; what is left goes nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return BROKEN_PIPE_EXIT_CODE
        except FedsimError as exc:
            print(f"fedsim: error: {exc}", file=sys.stderr)
            return exc.exit_code
        except OSError as exc:
            print(f"fedsim: error: {_refused(exc)}", file=sys.stderr)
            return FedsimError.exit_code
        except KeyboardInterrupt:
            word, code = ("terminated", TERMINATED_EXIT_CODE) if sigterm_received() else ("interrupted",
                                                                                          INTERRUPTED_EXIT_CODE)
            print(f"fedsim: {word}", file=sys.stderr)
            return code
        finally:
            sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
