"""bench/gpu_setup.sh's ride/stash/unride: .whl/ cut into three pieces that each fit beside one vLLM
part, rebuilt byte for byte on the host, refused when a piece is damaged (bash, temp dirs, no GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_setup.sh"
MIB = 1 << 20

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _bash(cwd: Path, body: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", f". {SCRIPT} lib; {body}"], cwd=cwd, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_the_wheels_ride_in_three_pieces_and_come_back_whole(tmp_path: Path) -> None:
    here = tmp_path / "here"
    (here / ".whl").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(here)], check=True)
    (here / ".git" / "info" / "exclude").write_text("/.whl/\n/.gpu/\n")
    wheels = {f"w{i}-1.0-py3-none-any.whl": os.urandom(3 * MIB) for i in range(13)}  # 39 MiB
    for name, data in wheels.items():
        (here / ".whl" / name).write_bytes(data)
    for n, size in ((1, 50), (2, 50), (3, 46)):  # vLLM's parts: 48, 48 and 44 MiB leave ~15, ~15, ~19
        (here / ".gpu" / "vllm" / f"part{n}").mkdir(parents=True)
        with (here / ".gpu" / "vllm" / f"part{n}" / "chunk").open("wb") as f:
            f.truncate(size * MIB - 2 * MIB)  # sparse: only its size counts
    for name in ("stash.sh", "SHA256SUMS", "install.sh"):
        (here / ".gpu" / "vllm" / name).write_text("#\n")
    packed = _bash(here, "gpu_ride", {})
    assert packed.returncode == 0, packed.stderr
    sizes = [(here / ".gpu" / "ride" / str(n) / f"whl.tar.{n}of3").stat().st_size for n in (1, 2, 3)]
    assert all(s > 0 for s in sizes) and sum(sizes) > 39 * MIB
    for n in (1, 2, 3):  # every piece fits beside its part within one command's 64 MiB
        part = (here / ".gpu" / "vllm" / f"part{n}" / "chunk").stat().st_size
        assert part + sizes[n - 1] < 64 * MIB

    ride = {"RIDE": str(tmp_path / "ride")}  # the host's keep (default /tmp/ride)
    for n in (1, 2, 3):  # each part's command brings its own piece only
        cmd = tmp_path / f"cmd{n}"
        shutil.copytree(here / ".gpu" / "ride" / str(n), cmd / ".gpu" / "ride" / str(n))
        assert _bash(cmd, "gpu_stash", ride).returncode == 0
    host = tmp_path / "host"
    host.mkdir()
    rebuilt = _bash(host, "gpu_unride", ride)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert {p.name: p.read_bytes() for p in (host / ".whl").iterdir()} == wheels

    damaged = tmp_path / "host2"
    damaged.mkdir()
    with (tmp_path / "ride" / "whl.tar.2of3").open("ab") as f:
        f.write(b"x")
    refused = _bash(damaged, "gpu_unride", ride)
    assert refused.returncode == 3
    assert "whl.tar.2of3" in refused.stdout + refused.stderr
    assert not (damaged / ".whl").exists()

    nothing = _bash(tmp_path / "cmd1", "RIDE=/nonexistent gpu_unride", {})
    assert nothing.returncode == 3 and "no .whl/" in nothing.stderr
