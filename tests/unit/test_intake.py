"""producer.intake: every file accounted for, and what the producer refuses before publishing."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from ocrq.errors import HostNotFound, StorageUnavailable
from ocrq.net.addresses import public_addresses
from ocrq.settings import LimitSettings
from producer.intake import plan_intake
from producer.name_filter import NameFilter


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    path = (tmp_path / "root").resolve()
    path.mkdir()
    return path


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_counts_add_up_and_accepted_refs_come_back_deduplicated(root: Path) -> None:
    for name in ("a.png", "b.jp2", "c.pdf", ".hidden", "m.csv"):
        touch(root / name)
    limits = LimitSettings(allowed_roots=[root])
    plan = plan_intake([str(root), str(root / "a.png")], limits)
    assert (plan.accepted, plan.skipped, plan.refused, plan.duplicates) == (3, 2, 0, 1)
    assert plan.summary() == "3 accepted, 2 skipped, 0 refused (1 duplicate refs merged)"
    assert [ref for ref, _ in plan.entries()] == [str(root / n) for n in ("a.png", "b.jp2", "c.pdf")]
    assert {e.reason for e in plan.skipped_sample} == {
        "hidden", "a manifest inside a folder (pass it by name to expand it)"}
    # the merged one is named, with the ref it became
    assert [(e.value, e.reason) for e in plan.merged_sample] == [
        (str(root / "a.png"), f"the same file as {root / 'a.png'}, submitted once")]
    plan.close()


def test_match_takes_files_found_by_name_and_skips_the_rest_with_why(root: Path) -> None:
    for name in ("a.png", "sub/B.JPG", "a.txt", "sub/b.json", "notes.md"):
        touch(root / name)
    (root / "link.jpg").symlink_to(root / "a.txt")  # matched by the name it is listed under
    limits = LimitSettings(allowed_roots=[root])
    plan = plan_intake([str(root), str(root / "notes.md")], limits, match=NameFilter.of(["*.png", "*.jpg"]))
    # a file named on its own is taken whatever its name: the caller chose it
    assert sorted(ref for ref, _ in plan.entries()) == sorted(
        [str(root / "a.png"), str(root / "sub/B.JPG"), str(root / "a.txt"), str(root / "notes.md")])
    assert (plan.accepted, plan.skipped, plan.refused) == (4, 3, 0)
    why = "its name matches none of *.png, *.jpg"
    assert sorted((e.value, e.reason) for e in plan.skipped_sample) == sorted(
        [(str(root / "a.txt"), why), (str(root / "sub/b.json"), why), (str(root / "notes.md"), why)])
    plan.close()


def test_a_symlink_to_a_listed_file_is_merged_by_its_own_name(root: Path) -> None:
    touch(root / "top.png")
    (root / "link_to_top.png").symlink_to(root / "top.png")
    plan = plan_intake([str(root)], LimitSettings(allowed_roots=[root]))
    assert [ref for ref, _ in plan.entries()] == [str(root / "top.png")] and plan.duplicates == 1
    # found first (name order), the link is what top.png merges into, and either way both are named
    assert [(e.value, e.reason) for e in plan.merged_sample] == [
        (str(root / "top.png"), f"the same file as {root / 'link_to_top.png'}, submitted once")]
    plan.close()
    plan = plan_intake([str(root / "top.png"), str(root / "link_to_top.png")], LimitSettings(allowed_roots=[root]))
    assert [(e.value, e.reason) for e in plan.merged_sample] == [
        (str(root / "link_to_top.png"), f"the same file as {root / 'top.png'}, submitted once")]
    plan.close()


def test_missing_files_outside_roots_and_bad_schemes_are_refused(root: Path, tmp_path: Path) -> None:
    touch(root / "a.png")
    outside = touch(tmp_path / "outside.png")
    limits = LimitSettings(allowed_roots=[root])
    plan = plan_intake([str(root / "a.png"), str(root / "nope.png"), str(outside), "ftp://h/x.png"], limits)
    assert (plan.accepted, plan.refused) == (1, 3)
    reasons = [e.reason for e in plan.refused_sample]
    assert reasons[0] == f"no such file: {root / 'nope.png'}"
    assert reasons[1].startswith(f"outside allowed roots ({root})") and str(outside) in reasons[1]
    assert "scheme 'ftp'" in reasons[2]
    hint = plan.hint() or ""  # names the setting and the directory to allow
    assert f"OCRQ_LIMITS__ALLOWED_ROOTS='[\"{tmp_path.resolve()}\"]'" in hint
    assert f"ocrq up --allow {tmp_path.resolve()}" in hint


def test_local_refs_must_be_inside_a_live_workers_roots(root: Path) -> None:
    touch(root / "in" / "a.png")
    touch(root / "other" / "b.png")
    plan = plan_intake([str(root)], LimitSettings(allowed_roots=[root]), worker_roots=[root / "in"])
    assert plan.accepted == 1 and plan.refused == 1
    assert "outside the allowed roots of the running workers" in plan.refused_sample[0].reason


def test_manifest_rows_travel_with_their_refs(root: Path) -> None:
    touch(root / "a.png")
    manifest = touch(root / "m.jsonl", "\n".join([
        json.dumps({"ref": "a.png", "id": "r1", "metadata": {"k": 1}}),
        json.dumps({"ref": "a.png", "id": "r2"}),  # same file, another row: another result
        json.dumps({"ref": "a.png", "id": "r1", "metadata": {"k": 1}}),  # an exact repeat: merged
    ]).encode())
    plan = plan_intake([str(manifest)], LimitSettings(allowed_roots=[root]))
    assert list(plan.entries()) == [(str(root / "a.png"), {"id": "r1", "metadata": {"k": 1}}),
                                    (str(root / "a.png"), {"id": "r2"})]
    assert plan.duplicates == 1


def test_private_hosts_are_refused_once_per_host() -> None:
    plan = plan_intake(["http://127.0.0.1:9/a.png", "http://127.0.0.1:9/b.png", "http://[::1]/c.png"],
                       LimitSettings())
    assert plan.refused == 3 and "non-public" in plan.refused_sample[0].reason
    allowed = plan_intake(["http://127.0.0.1:9/a.png"], LimitSettings(http_allow_private=True))
    assert allowed.accepted == 1


def test_nxdomain_is_host_not_found_and_other_dns_failures_stay_retryable(monkeypatch: pytest.MonkeyPatch) -> None:
    # fake resolver (unit test): the error codes getaddrinfo gives for NXDOMAIN and for DNS down
    def fake_getaddrinfo(host: str, *args: object, **kwargs: object) -> object:
        code = socket.EAI_NONAME if host == "gone.example" else socket.EAI_AGAIN
        raise socket.gaierror(code, "fake")

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    with pytest.raises(HostNotFound) as info:
        public_addresses("gone.example", 80, LimitSettings())
    assert info.value.to_dict()["retryable"] is False
    with pytest.raises(StorageUnavailable):
        public_addresses("flaky.example", 80, LimitSettings())
    plan = plan_intake(["https://gone.example/a.png", "https://flaky.example/b.png"], LimitSettings())
    assert plan.refused == 1 and plan.accepted == 1  # DNS down at submit: left to the worker
    assert "does not resolve" in plan.refused_sample[0].reason


def test_the_embedded_worker_gets_absolute_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ocrq.settings import Settings
    from ocrq_cli.embedded.stack import Stack

    monkeypatch.chdir(tmp_path)
    assert Stack(Settings(), allow=[Path("scans"), tmp_path]).roots == [str(tmp_path.resolve()),
                                                                       str((tmp_path / "scans").resolve())]
    configured = Settings(limits={"allowed_roots": ["/data"]})
    assert Stack(configured, allow=[Path("/srv/in")]).roots == ["/data", "/srv/in"]
