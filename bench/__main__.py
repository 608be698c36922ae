"""``python -m bench``: the one benchmark driver.

    python -m bench list                       # the scenarios (also in --help)
    python -m bench SCENARIO [--print] [--bare] [--run-dir DIR] [ARGS...]
    python -m bench report [--check]           # docs/bench tables rebuilt from the runs' JSON

A scenario's run writes manifest.json (bench/manifest.py) and output.log in its run directory
(var/bench/SCENARIO/<UTC time> unless --run-dir), beside the JSON the command writes there.
ARGS go to the command after its own (argparse keeps the last of a repeated option, so
``scale --images 20000`` overrides the default). The exit status is the command's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench import manifest
from bench.scenarios import BY_NAME, SCENARIOS, Scenario

ROOT = Path(__file__).resolve().parents[1]


def table(commands: bool = False) -> str:
    """One line per scenario; with commands, a second line: what it runs and the document it feeds."""
    width = max(len(s.name) for s in SCENARIOS)
    lines = []
    for s in SCENARIOS:
        lines.append(f"  {s.name:<{width}}  {'GPU' if s.gpu else 'CPU'}  {s.about}")
        if commands:
            lines.append(f"  {'':<{width}}       {' '.join(s.command)}  -> {s.doc}")
    return "\n".join(lines)


def command(s: Scenario, run_dir: Path, extra: list[str]) -> list[str]:
    args = [a.replace("{run}", str(run_dir)) for a in (*s.command, *extra)]
    return [sys.executable, *args] if s.module else args


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one benchmark scenario (its run directory gets manifest.json and output.log), "
                    "list them, or rebuild the docs' tables from the runs' JSON.",
        epilog="commands:\n  list                  the scenarios below, with what each runs\n"
               "  report [--check]      rebuild docs/bench tables (--check: exit 1 if a doc differs)\n\n"
               "scenarios (CPU: this machine; GPU: a host set up by bench/gpu_setup.sh):\n" + table())
    ap.add_argument("scenario", help="a scenario name, `list` or `report`")
    ap.add_argument("--print", dest="print_only", action="store_true", help="print the command, run nothing")
    ap.add_argument("--bare", action="store_true", help="run the command only: no manifest, no output.log")
    ap.add_argument("--run-dir", type=Path, default=None, help="default: var/bench/SCENARIO/<UTC time>")
    return ap


def run(s: Scenario, run_dir: Path, cmd: list[str], argv: list[str], bare: bool) -> int:
    env = dict(os.environ)
    if s.step:  # bench/h200_vllm.sh writes under $OUT
        env["OUT"] = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if bare:
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode
    info = manifest.build(s.name, argv, cmd, s.gpu)
    manifest.write(run_dir, info)
    t0 = time.monotonic()
    with open(run_dir / "output.log", "w") as log, subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
            code = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            code = proc.wait()
    # read again: a GPU step installs its packages (bench/gpu_setup.sh) during the run
    info["versions"] = manifest.versions(manifest.GPU_SITES if s.gpu else ())
    manifest.write(run_dir, info, exit_code=code, wall_s=time.monotonic() - t0)
    print(f"[bench] {s.name}: exit {code}, {run_dir}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # everything after `--` goes to the command untouched
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    if argv[:1] == ["report"]:
        from bench import report

        return report.main(argv[1:])
    args, extra = _parser().parse_known_args(argv)
    if args.scenario == "list":
        print(table(commands=True))
        return 0
    s = BY_NAME.get(args.scenario)
    if s is None:
        _parser().error(f"unknown scenario {args.scenario!r} (python -m bench list)")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = (args.run_dir or ROOT / "var" / "bench" / s.name / stamp).resolve()
    cmd = command(s, run_dir, extra + passthrough)
    if args.print_only:
        print((f"OUT={shlex.quote(str(run_dir))} " if s.step else "") + shlex.join(cmd))
        return 0
    return run(s, run_dir, cmd, ["python -m bench", *argv, *(["--", *passthrough] if passthrough else [])],
               args.bare)


if __name__ == "__main__":
    sys.exit(main())
