"""What the README promises a user stays what the code does: every image status it lists is one
the job index counts (and the other way round), its exit-code table is the one `ocrq --help`
prints from producer/errors.py, and a PDF is one line per file with `pages: N`."""

from __future__ import annotations

import re
from pathlib import Path

from ocrq.results import ImageStatus
from ocrq_cli.main import EXIT_CODES
from producer import errors

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_the_readme_lists_every_status() -> None:
    paragraph = README[README.index("**A job's images, by status**"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    listed = set(re.findall(r"`(\w+)` \(", paragraph))
    assert listed == {s.value for s in ImageStatus}, listed
    assert "`cached`" in paragraph and "`skipped`" in paragraph and "`total`" in paragraph


def test_the_exit_code_table_is_the_one_the_help_prints() -> None:
    table = dict(re.findall(r"^\| (\d) \| (.+?) \|$", README, flags=re.MULTILINE))
    codes = {errors.EXIT_OK: "every image done", errors.EXIT_ERROR: "no such job",
             errors.EXIT_REFUSED: "refused", errors.EXIT_SOME_FAILED: "some images failed",
             errors.EXIT_TIMEOUT: "timed out", errors.EXIT_NOT_REPLICATED: "not confirmed on the replicas"}
    assert set(map(int, table)) == set(codes)
    for code, words in codes.items():
        assert table[str(code)].startswith(words), (code, table[str(code)])
        assert f"{code}  {words}" in EXIT_CODES
    # and each client error exits with a code of the table
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.ClientError):
            assert cls.exit_code in codes, cls


def test_the_pdf_wording_matches_the_output() -> None:
    assert "a PDF is one result line per file, with `pages: N`" in README
    assert "each\npage is one output" not in README and "each page is one output" not in README
