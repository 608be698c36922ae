"""The benchmark driver (bench/__main__.py): its table names real modules and steps, every command
the docs name is in it, the docs' generated tables match their JSON, and a run leaves a manifest."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import manifest, report
from bench.__main__ import main
from bench.scenarios import BY_NAME, H200, SCENARIOS

ROOT = Path(__file__).resolve().parents[2]
#: `python -m bench NAME` / `python3 -m bench NAME` (not `python -m bench.module`)
DRIVER = re.compile(r"python3? -m bench ([a-z][\w-]*)")


def _h200_steps() -> set[str]:
    text = (ROOT / H200).read_text()
    return set(re.findall(r"^  ([a-z0-9-]+)\)", text, re.MULTILINE))


def test_scenarios_are_unique_and_described() -> None:
    names = [s.name for s in SCENARIOS]
    assert len(names) == len(set(names))
    for s in SCENARIOS:
        assert s.about and (ROOT / s.doc).is_file(), s.name
        assert s.module or s.step, s.name
        assert s.gpu or not s.step, f"{s.name}: h200_vllm.sh steps need a GPU"


def test_every_module_exists() -> None:
    for s in SCENARIOS:
        if s.module:
            assert importlib.util.find_spec(s.module) is not None, (s.name, s.module)


def test_every_step_is_in_the_script_and_every_step_in_the_table() -> None:
    steps = _h200_steps()
    table = {s.step for s in SCENARIOS if s.step}
    assert table <= steps, table - steps
    # a step no scenario runs is a step nobody can find: drop it from the script or add a scenario
    assert steps <= table, steps - table


def test_every_driver_command_in_the_docs_exists() -> None:
    texts = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "docs" / "bench").glob("*.md")]
    named = {(p.name, m) for p in texts for m in DRIVER.findall(p.read_text())}
    assert named, "the docs name no driver command"
    unknown = sorted((doc, n) for doc, n in named if n not in BY_NAME and n not in ("list", "report"))
    assert not unknown, unknown


def test_every_gpu_doc_names_its_commands() -> None:
    for doc in ("gpu-vllm.md", "gpu-governor.md", "gpu-worker.md", "gpu-multi.md"):
        assert DRIVER.search((ROOT / "docs" / "bench" / doc).read_text()), doc
    assert "bash bench/h200_vllm.sh" not in (ROOT / "docs" / "bench" / "gpu-vllm.md").read_text()


def test_report_check_passes_on_the_committed_docs() -> None:
    docs = report.documents()
    assert {p.name for p in docs} >= {"gpu-vllm.md", "gpu-governor.md", "gpu-worker.md", "gpu-multi.md", "scale.md"}
    for path in docs:
        assert report.rebuild(path.read_text(), path.parent) == path.read_text(), path
    assert report.main(["--check"]) == 0


def test_report_restores_an_edited_figure() -> None:
    doc = ROOT / "docs" / "bench" / "gpu-vllm.md"
    text = doc.read_text()
    edited = text.replace("| `ocrq-vllm` | 24 | 65536 | 16.52 |", "| `ocrq-vllm` | 24 | 65536 | 17.52 |")
    edited = edited.replace("| `ocrq-vllm` | 24 | 65536 | 13.56 |", "| `ocrq-vllm` | 24 | 65536 | 3.56 |")
    assert edited.count("17.52") == text.count("17.52") + 1 and "| 3.56 |" in edited
    assert report.rebuild(edited, doc.parent) == text
    # a missing run folder is an error, not an empty table
    with pytest.raises(FileNotFoundError):
        report.render("gpu-vllm-rows", doc.parent / "runs" / "no-such-run")


def test_help_lists_the_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(s.name in out for s in SCENARIOS)


def test_print_shows_the_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["scale", "--print", "--run-dir", str(tmp_path), "--images", "20"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith("-m bench.scale --images 1000000 --images 20")
    assert main(["gpu-start", "--print", "--run-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"OUT={tmp_path} bash bench/h200_vllm.sh start"
    assert not list(tmp_path.iterdir()), "--print runs nothing"


def test_a_run_writes_its_manifest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "bench", "server-bodies", "--run-dir", str(run),
                           "--seconds", "0.1", "--passes", "1", "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = json.loads((run / "manifest.json").read_text())
    assert m["scenario"] == "server-bodies" and m["exit_code"] == 0 and m["wall_s"] > 0
    assert re.fullmatch(r"[0-9a-f]{40}", m["commit"]) and isinstance(m["dirty"], bool)
    assert m["versions"]["python"] and "celery" in m["versions"] and "redis" in m["versions"]
    assert m["command"][1:3] == ["-m", "bench.server_bodies"] and "--seconds" in m["argv"]
    assert isinstance(m["gpus"], list) and m["started_utc"].endswith("Z")
    assert "output.log" in m["outputs"] and (run / "output.log").read_text()


def test_the_exit_code_is_the_commands(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench", "submit", "--run-dir", str(tmp_path), "--refs", "x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert json.loads((tmp_path / "manifest.json").read_text())["exit_code"] == 2


def test_manifest_writer(tmp_path: Path) -> None:
    info = manifest.build("x", ["python -m bench", "x"], ["true"], gpu=False)
    manifest.write(tmp_path, info, exit_code=0, wall_s=1.234)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["wall_s"] == 1.23 and m["exit_code"] == 0 and m["host"]["cpus"]


def test_make_test_runs_chaos_through_the_driver() -> None:
    make = (ROOT / "Makefile").read_text()
    assert "$(PY) -m bench reliability-quick --run-dir var/bench/reliability-quick" in make
    assert "test-gpu:" in make
