"""ocrq.refs and producer.expand on local files: parsing, confinement, directories, manifests, local fetch."""

from __future__ import annotations

import itertools
import json
import os
import threading
from pathlib import Path

import pytest

from ocrq.errors import MissingObject, RefusedRef, TooLarge
from ocrq.net.fetch import fetch
from ocrq.refs import BAD_REF_PREFIX, canonical, is_local, parse
from ocrq.settings import LimitSettings
from producer.expand import expand, expand_entries


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path.resolve()


@pytest.fixture()
def limits(root: Path) -> LimitSettings:
    return LimitSettings(allowed_roots=[root], max_bytes=1000)


@pytest.fixture(params=["descriptor", "realpath"])
def confinement(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Local fetch both ways: confined on the opened descriptor (Linux) and by realpath first."""
    import ocrq.net.fetch

    if request.param == "realpath":
        monkeypatch.setattr(ocrq.net.fetch, "_FD_DIR", None)
    elif ocrq.net.fetch._FD_DIR is None:
        pytest.skip("no O_PATH or /proc/self/fd here")
    return str(request.param)


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --- parsing and confinement -------------------------------------------------------------------

def test_local_forms_canonicalise_to_absolute_paths(root: Path, limits: LimitSettings,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(root)
    want = str(root / "a b.png")
    assert canonical(want, limits) == want
    assert canonical("a b.png", limits) == want
    assert canonical("./sub/../a b.png", limits) == want
    assert canonical(f"file://{root}/a%20b.png", limits) == want
    assert canonical(f"file://localhost{root}/a%20b.png", limits) == want


def test_empty_roots_mean_current_directory(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(root)
    assert canonical("x.png", LimitSettings()) == str(root / "x.png")
    with pytest.raises(RefusedRef):
        canonical("../x.png", LimitSettings())


@pytest.mark.parametrize("ref", [
    "/etc/passwd", "../outside.png", "file:///etc/passwd", "file://otherhost/x.png",
    "sub/../../outside.png", "", "a\x00b.png",
])
def test_refused_local_refs(ref: str, root: Path, limits: LimitSettings,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(root)
    with pytest.raises(RefusedRef):
        parse(ref, limits)


def test_symlink_escape_is_refused(root: Path, limits: LimitSettings, confinement: str) -> None:
    outside = touch(root.parent / "secret.png", b"secret")
    (root / "link.png").symlink_to(outside)
    (root / "linkdir").symlink_to(root.parent)
    # the refusal names where the link leads (the link itself is inside the root)
    with pytest.raises(RefusedRef, match=f"link.png \\(resolves to {outside}\\)"):
        canonical(str(root / "link.png"), limits)
    with pytest.raises(RefusedRef, match=f"resolves to {outside}"):
        fetch(str(root / "linkdir" / "secret.png"), limits)
    inside = touch(root / "real.png")
    (root / "alias.png").symlink_to(inside)
    assert canonical(str(root / "alias.png"), limits) == str(inside)


def test_a_sibling_sharing_the_roots_name_is_outside_and_a_symlink_loop_is_refused(
        root: Path, limits: LimitSettings) -> None:
    # the roots are checked on path strings: "/x/root" must not admit "/x/root-other/a.png"
    sibling = touch(root.parent / (root.name + "-other") / "a.png")
    with pytest.raises(RefusedRef, match="outside allowed roots"):
        canonical(str(sibling), limits)
    assert canonical(str(root), limits) == str(root.resolve())  # the root itself is inside
    (root / "loop").symlink_to(root / "loop")
    with pytest.raises(RefusedRef, match="unresolvable"):
        canonical(str(root / "loop"), limits)


def test_is_local() -> None:
    assert is_local("/a/b.png") and is_local("rel/b.png") and is_local("file:///a.png") and is_local("C:/x.png")
    assert not any(is_local(r) for r in ("s3://b/k", "https://h/a.png", "invalid:why"))


def test_schemes(limits: LimitSettings) -> None:
    assert parse("s3://bucket/dir/a.png", limits).key == "dir/a.png"
    assert parse("S3://bucket/k?v=1#x", limits).value == "s3://bucket/k?v=1#x"  # keys are literal
    assert parse("s3://bucket/dir/", limits).is_prefix
    assert parse("s3://bucket", limits).is_prefix
    assert parse("https://example.com/a.png?x=1", limits).kind == "http"
    for bad in ("ftp://example.com/a.png", "data:image/png;base64,AAAA", "s3:///key", "s3:/b/k",
                "http:///nohost", "http://host:notaport/x", "invalid:whatever"):
        with pytest.raises(RefusedRef):
            parse(bad, limits)
    only_files = LimitSettings(allowed_schemes=["file"], allowed_roots=limits.allowed_roots)
    for bad in ("s3://bucket/a.png", "https://example.com/a.png"):
        with pytest.raises(RefusedRef, match="not allowed"):
            parse(bad, only_files)
        with pytest.raises(RefusedRef):
            fetch(bad, only_files)


# --- expansion ---------------------------------------------------------------------------------

def test_directory_expands_every_regular_file_and_accounts_for_the_rest(root: Path, limits: LimitSettings) -> None:
    for name in ("b.PNG", "a.jpg", "notes.txt", "sub/c.tiff", "sub/deeper/d.webp", ".hidden.png",
                 "sub/e.gif", "z.bmp", "y.jpeg", "x.tif", "manifest.jsonl", "scan.jp2", "noext",
                 ".git/config", "sub/.DS_Store"):
        touch(root / name)
    os.mkfifo(root / "pipe")
    got = list(expand_entries([str(root)], limits))
    rel = [(e.kind, str(Path(e.value).relative_to(root))) for e in got]
    # every regular file, whatever its name, in name order, depth first; the worker sniffs content
    assert [r for k, r in rel if k == "ref"] == [
        "a.jpg", "b.PNG", "noext", "notes.txt", "scan.jp2", "sub/c.tiff", "sub/deeper/d.webp", "sub/e.gif",
        "x.tif", "y.jpeg", "z.bmp"]
    skipped = {r: e.reason for (k, r), e in zip(rel, got, strict=True) if k == "skipped"}
    assert skipped.keys() == {".git", ".hidden.png", "manifest.jsonl", "pipe", "sub/.DS_Store"}
    assert skipped[".git"] == "hidden" and "manifest" in skipped["manifest.jsonl"]
    assert skipped["pipe"] == "not a regular file"
    assert len(got) == 16  # nothing unaccounted: 11 refs + 5 skipped
    # the string form (refs only) for callers that only want what to submit
    assert len(list(expand([str(root)], limits))) == 11


def test_manifest_rows_carry_their_extra_columns(root: Path, limits: LimitSettings) -> None:
    touch(root / "a.png")
    touch(root / "dir" / "b.png")
    jsonl = touch(root / "m.jsonl", "\n".join([
        json.dumps({"ref": "a.png", "id": "doc-1", "metadata": {"customer": 7, "tags": ["x"]}}),
        json.dumps({"path": "dir", "id": "doc-2"}),  # a directory row: every file gets the row
        json.dumps("a.png"),
    ]).encode())
    got = list(expand_entries([str(jsonl)], limits))
    assert [(e.value, e.row) for e in got] == [
        (str(root / "a.png"), {"id": "doc-1", "metadata": {"customer": 7, "tags": ["x"]}}),
        (str(root / "dir" / "b.png"), {"id": "doc-2"}),
        (str(root / "a.png"), None),
    ]
    csv_manifest = touch(root / "m.csv", b'id,path,metadata\n9,a.png,"{""k"": 1}"\n')
    (entry,) = expand_entries([str(csv_manifest)], limits)
    assert entry.row == {"id": "9", "metadata": '{"k": 1}'}  # CSV cells come back as the text they are
    huge = touch(root / "big.jsonl", json.dumps({"ref": "a.png", "metadata": "x" * 20000}).encode())
    (entry,) = expand_entries([str(huge)], limits)
    assert entry.kind == "refused" and "extra columns" in entry.reason


def test_directory_symlinks(root: Path, limits: LimitSettings) -> None:
    touch(root / "pics" / "a.png")
    (root / "pics" / "loop").symlink_to(root / "pics")           # entered once, no loop
    (root / "pics" / "out.png").symlink_to(touch(root.parent / "o.png"))
    (root / "pics" / "outdir").symlink_to(root.parent)
    got = list(expand([str(root / "pics")], limits))
    assert got[0] == str(root / "pics" / "a.png")
    refused = got[1:]
    assert len(refused) == 2 and all(r.startswith(BAD_REF_PREFIX) for r in refused)
    for ref in refused:  # recorded, and fetch refuses them
        with pytest.raises(RefusedRef, match="outside allowed roots"):
            fetch(ref, limits)


def test_refused_inputs_are_yielded_as_invalid_not_dropped(root: Path, limits: LimitSettings) -> None:
    good = str(touch(root / "ok.png"))
    got = list(expand(["  ", good, "/etc/passwd", "ftp://h/x.png", " " + good + " "], limits))
    assert got[0] == good and got[-1] == good
    assert got[1].startswith(BAD_REF_PREFIX) and "/etc/passwd" in got[1]
    assert got[2].startswith(BAD_REF_PREFIX) and "ftp" in got[2]


def test_jsonl_manifest(root: Path, limits: LimitSettings) -> None:
    touch(root / "imgs" / "d1.png")
    touch(root / "imgs" / "d2.png")
    lines = [
        json.dumps({"ref": "a.png", "label": 1}),
        json.dumps({"path": str(root / "b.png")}),
        json.dumps({"url": "https://example.com/c.png"}),
        json.dumps({"uri": "s3://bkt/k/d.png"}),
        json.dumps("e.png"),
        "",
        json.dumps({"name": "no ref field"}),
        "{not json",
        json.dumps("../../escape.png"),
        json.dumps("../imgs"),  # a directory entry expands
    ]
    manifest = touch(root / "lists" / "m.jsonl", ("\n".join(lines) + "\n").encode())
    got = list(expand([str(manifest)], limits))
    lists = root / "lists"
    assert got[:5] == [str(lists / "a.png"), str(root / "b.png"), "https://example.com/c.png",
                       "s3://bkt/k/d.png", str(lists / "e.png")]  # relative to the manifest
    assert got[5] == f"{BAD_REF_PREFIX}no reference on line 7 of {manifest}"
    assert got[6] == f"{BAD_REF_PREFIX}no reference on line 8 of {manifest}"
    assert got[7].startswith(BAD_REF_PREFIX) and "escape.png" in got[7]
    assert got[8:] == [str(root / "imgs" / "d1.png"), str(root / "imgs" / "d2.png")]
    assert len(got) == 10
    for bad in got[5:8]:
        with pytest.raises(RefusedRef):
            fetch(bad, limits)


def test_csv_manifest_with_header_column(root: Path, limits: LimitSettings) -> None:
    body = b'\xef\xbb\xbfid,URL,label\r\n1,a.png,x\r\n2,"b, c.png",y\r\n3,,z\r\n\r\n'
    manifest = touch(root / "m.csv", body)
    got = list(expand([str(manifest)], limits))
    assert got == [str(root / "a.png"), str(root / "b, c.png"),
                   f"{BAD_REF_PREFIX}no reference on line 4 of {manifest}"]


def test_csv_manifest_without_header_uses_first_column(root: Path, limits: LimitSettings) -> None:
    manifest = touch(root / "m.csv", b"a.png,1\nb.png,2\n")
    assert list(expand([str(manifest)], limits)) == [str(root / "a.png"), str(root / "b.png")]


def test_nested_manifests_are_capped(root: Path, limits: LimitSettings) -> None:
    touch(root / "self.jsonl", json.dumps("self.jsonl").encode())  # lists itself
    got = list(expand([str(root / "self.jsonl")], limits))
    assert len(got) == 1 and got[0].startswith(BAD_REF_PREFIX) and "nested" in got[0]


def test_missing_manifest_raises(root: Path, limits: LimitSettings) -> None:
    with pytest.raises(MissingObject):
        list(expand([str(root / "nope.jsonl")], limits))


def test_expand_is_lazy(root: Path, limits: LimitSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(root)
    endless = (f"img{i}.png" for i in itertools.count())
    assert list(itertools.islice(expand(endless, limits), 2)) == [str(root / "img0.png"),
                                                                   str(root / "img1.png")]


def test_manifest_is_streamed_line_by_line(root: Path, limits: LimitSettings) -> None:
    # A FIFO manifest: the first ref must come out while the writer is still blocked.
    fifo = root / "live.jsonl"
    os.mkfifo(fifo)
    release = threading.Event()

    def writer() -> None:
        with open(fifo, "w") as handle:
            handle.write(json.dumps("first.png") + "\n")
            handle.flush()
            release.wait(10)
            handle.write(json.dumps("second.png") + "\n")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    stream = expand([str(fifo)], limits)
    assert next(stream) == str(root / "first.png")
    release.set()
    assert list(stream) == [str(root / "second.png")]
    thread.join(5)


def test_s3_containers_need_a_client(limits: LimitSettings) -> None:
    assert list(expand(["s3://b/k.png"], limits)) == ["s3://b/k.png"]  # single refs need none
    with pytest.raises(RefusedRef):
        list(expand(["s3://b/prefix/"], limits))
    with pytest.raises(RefusedRef):
        fetch("s3://b/k.png", limits)


# --- local fetch -------------------------------------------------------------------------------

def test_fetch_local(root: Path, limits: LimitSettings, confinement: str) -> None:
    path = touch(root / "a.png", b"\x89PNG data")
    assert fetch(str(path), limits) == b"\x89PNG data"
    assert fetch(f"file://{path}", limits) == b"\x89PNG data"
    touch(root / "exact.png", b"x" * 1000)
    assert len(fetch(str(root / "exact.png"), limits)) == 1000
    touch(root / "big.png", b"x" * 1001)
    with pytest.raises(TooLarge):
        fetch(str(root / "big.png"), limits)
    with pytest.raises(MissingObject):
        fetch(str(root / "missing.png"), limits)
    with pytest.raises(MissingObject):
        fetch(str(root / "a.png" / "child.png"), limits)
    with pytest.raises(RefusedRef):
        fetch(str(root), limits)
    with pytest.raises(RefusedRef):
        fetch("s3://bucket/prefix/", limits)


def test_fetch_fifo_refused_without_blocking(root: Path, limits: LimitSettings, confinement: str) -> None:
    os.mkfifo(root / "pipe.png")
    with pytest.raises(RefusedRef, match="not a regular file"):
        fetch(str(root / "pipe.png"), limits)


def test_s3_bucket_allowlist() -> None:
    only = LimitSettings(s3_buckets=["scans"])
    assert parse("s3://scans/a.png", only).bucket == "scans"
    with pytest.raises(RefusedRef, match="not in limits.s3_buckets"):
        parse("s3://payroll/a.png", only)
    assert parse("s3://payroll/a.png", LimitSettings()).key == "a.png"


def test_a_directory_swapped_for_a_symlink_after_the_check_cannot_point_the_read_outside(
        root: Path, limits: LimitSettings, confinement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the race a realpath-then-open check leaves: someone who can write in a root swaps a
    # directory for a symlink between the check and the open. Confined on the descriptor of the
    # file actually opened, the read is refused.
    touch(root.parent / "outside" / "a.png", b"secret")
    path = touch(root / "sub" / "a.png", b"inside")
    real_open = os.open

    def swapping_open(target: object, *args: object, **kwargs: object) -> int:
        if os.fspath(target) == str(path) and not (root / "sub").is_symlink():  # type: ignore[arg-type]
            (root / "sub").rename(root / "moved")
            (root / "sub").symlink_to(root.parent / "outside")
        return real_open(target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", swapping_open)
    if confinement == "realpath":  # the race is real on the fallback path: the secret is read
        assert fetch(str(path), limits) == b"secret"
    else:
        with pytest.raises(RefusedRef, match="outside allowed roots"):
            fetch(str(path), limits)


def test_descriptor_confinement_walks_no_realpath(root: Path, limits: LimitSettings, confinement: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if confinement == "realpath":
        pytest.skip("the fallback is the realpath walk")
    path = touch(root / "sub" / "a.png", b"data")
    real = os.path.realpath

    def no_realpath(target: str, **kwargs: object) -> str:
        assert "a.png" not in os.fspath(target), "realpath walked for the image"
        return real(target, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os.path, "realpath", no_realpath)
    assert fetch(str(path), limits) == b"data"
    (root / "dev.png").symlink_to("/dev/null")  # resolved on the handle: refused, never opened
    with pytest.raises(RefusedRef, match="outside allowed roots"):
        fetch(str(root / "dev.png"), limits)


def test_an_expansion_reuses_resolved_directories_with_the_full_walks_answers(
        root: Path, limits: LimitSettings) -> None:
    # one expand call resolves each directory once (refs._resolve); every answer must equal the
    # realpath walk of that reference alone
    touch(root / "real" / "a.png")
    touch(root / "real" / "b.png")
    (root / "linkdir").symlink_to(root / "real")
    (root / "real" / "alias.png").symlink_to(root / "real" / "a.png")
    (root / "real" / "out.png").symlink_to(touch(root.parent / "o.png"))
    (root / "loop").symlink_to(root / "loop")
    (root / "escape").symlink_to(root.parent)
    raws = [str(root / p) for p in ("real/a.png", "linkdir/b.png", "real/alias.png", "real/out.png",
                                     "real/missing.png", "linkdir/../real/b.png", "loop/x.png",
                                     "escape/o.png", "linkdir/a.png")]

    def alone(raw: str) -> str:
        try:
            return canonical(raw, limits)
        except RefusedRef:
            return "refused"

    got = ["refused" if r.startswith(BAD_REF_PREFIX) else r for r in expand(raws + raws, limits)]
    assert got == [alone(r) for r in raws + raws]
    assert got[:3] == [str(root / "real" / "a.png"), str(root / "real" / "b.png"), str(root / "real" / "a.png")]
    assert got[3] == "refused" and got[6] == "refused" and got[7] == "refused"
