"""The repository speaks to its users: no word in a tracked text file that only means something to
whoever wrote it (which run of ours, which machine loan, which ticket). Benchmarks are named by the
date and commit they were measured on, reference settings by what they are."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: words that name our process, not the product; each hit is a line to rewrite
TERMS = ("sessions?", "session\\d+", "leases?", "leased", "lent", "issue\\s+#?\\d+", "the seeds", "seeds'")
FORBIDDEN = re.compile("|".join(rf"\b{t}\b" if t[-1].isalpha() else rf"\b{t}" for t in TERMS) + r"|\.\./shared",
                       re.IGNORECASE)

#: real API names that contain a forbidden word: subprocess's ``start_new_session``, pytest's
#: ``scope="session"``, onnxruntime's ``InferenceSession``
ALLOWED = re.compile(r"start_new_session|scope=[\"']session[\"']|InferenceSession")

#: files another change owns; they are cleaned separately, and leave this list with that change
PENDING: tuple[str, ...] = ()

#: text we read; binary files (images, gzip) and this test's own word list are not
TEXT = (".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".json", ".jsonl", ".txt", ".xml", ".cfg", ".ini",
        ".lua", ".rules", ".conf", ".html", ".js", ".css")
NAMES = ("Makefile", "Dockerfile", ".gitignore", ".dockerignore")
SELF = "tests/unit/test_words.py"
#: third-party files shipped as they came (Swagger UI's minified bundle for the API's /docs)
VENDORED = ("api/swagger/",)


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines()
            if p != SELF and not p.startswith(VENDORED)
            and (p.endswith(TEXT) or p.rsplit("/", 1)[-1] in NAMES) and (ROOT / p).is_file()]


def offending_lines(path: str) -> list[str]:
    text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
    return [f"{path}:{n}: {line.strip()[:160]}" for n, line in enumerate(text.splitlines(), 1)
            if FORBIDDEN.search(ALLOWED.sub("", line))]


def test_no_process_words_in_tracked_files() -> None:
    files = tracked_text_files()
    assert "README.md" in files and "Makefile" in files and "pyproject.toml" in files
    hits = [hit for path in files if path not in PENDING for hit in offending_lines(path)]
    assert not hits, "words that mean nothing to a reader:\n" + "\n".join(hits)


def test_pending_files_exist() -> None:
    # a pending file that is gone, or clean, should leave the list
    for path in PENDING:
        assert (ROOT / path).is_file(), path


def test_the_word_list_catches_and_allows() -> None:
    examples = {"\\s+#?": " ", "\\d+": "12", "?": ""}
    caught = []
    for term in TERMS:  # each term as a reader would meet it
        for pattern, text in examples.items():
            term = term.replace(pattern, text)
        caught.append(f"a {term} here")
    caught += ["see ../" + "shared/x"]
    allowed = ["start_new_session=True", '@pytest.fixture(scope="session")', "ort.InferenceSession(path)",
               "vllm-seeds", "--no-seeds", "lenticular", "release", "issues"]
    assert all(FORBIDDEN.search(ALLOWED.sub("", s)) for s in caught), caught
    assert not any(FORBIDDEN.search(ALLOWED.sub("", s)) for s in allowed)
