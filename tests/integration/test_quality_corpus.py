"""OCR quality of the CPU engine on the shared research corpus, held to thresholds.

The baseline (docs/quality.md, written by ``python -m bench.quality``, never by this test) is a
mean loose CER of 0.253 and a mean bag error of 0.073 over 22 English images; the thresholds
leave room for noise but not for a regression (a broken detector, a wrong decode, a reading
order scrambled beyond the bag score's tolerance). The corpus lives next to the repository.
"""

from __future__ import annotations

import pytest

from bench.quality import CORPUS, REPORT, english_images, score, score_corpus

pytestmark = pytest.mark.integration

#: mean over the corpus (baseline 0.253 loose CER, 0.073 bag)
MAX_MEAN_LOOSE = 0.30
MAX_MEAN_BAG = 0.10
#: no single image may lose most of its characters (worst baseline bag: 0.567, a scene photo)
MAX_IMAGE_BAG = 0.70
#: clean printed pages are read exactly in the baseline
CLEAN_PAGES = {"tess_phototest.tif": 0.02, "icdar15_img_8.jpg": 0.05}


@pytest.mark.skipif(not (CORPUS / "manifest.tsv").is_file(), reason=f"corpus absent: {CORPUS}")
def test_quality_on_corpus() -> None:
    before = REPORT.stat().st_mtime_ns if REPORT.exists() else None
    scores, _ = score_corpus()
    assert len(scores) == len(english_images()) >= 20, len(scores)
    mean_loose = sum(s.loose for s in scores) / len(scores)
    mean_bag = sum(s.bag for s in scores) / len(scores)
    print(f"mean loose CER {mean_loose:.3f}, mean bag {mean_bag:.3f} over {len(scores)} images")
    assert mean_loose <= MAX_MEAN_LOOSE, mean_loose
    assert mean_bag <= MAX_MEAN_BAG, mean_bag
    worst = max(scores, key=lambda s: s.bag)
    assert worst.bag <= MAX_IMAGE_BAG, worst
    by_name = {s.name: s for s in scores}
    for name, bound in CLEAN_PAGES.items():
        assert by_name[name].cer <= bound, by_name[name]
    # the test only reads: the report is bench's to write
    assert (REPORT.stat().st_mtime_ns if REPORT.exists() else None) == before


def test_the_scores_tell_a_right_text_from_a_wrong_one() -> None:
    # the thresholds mean something only if the scores separate a right reading from a wrong one
    row = {"filename": "page", "image_type": "scan-page"}
    truth = "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs."
    assert score(row, truth, truth.replace("\n", " ")).cer == 0.0
    wrong = score(row, truth, "Lorem ipsum dolor sit amet")
    assert wrong.cer > MAX_MEAN_LOOSE and wrong.bag > MAX_MEAN_BAG
    assert score(row, truth, "").bag == 1.0


def test_your_own_images_are_scored_with_the_same_report(tmp_path):
    from bench.quality import OWN_IMAGES, main

    # Given a folder of two images with their ground truth beside them, and one without
    examples = REPORT.parents[1] / "examples" / "images"
    for name, truth in (("invoice_en.png", "INVOICE"), ("single_line.png", None), ("receipt_en.png", "RECEIPT")):
        (tmp_path / name).write_bytes((examples / name).read_bytes())
        if truth:
            (tmp_path / name).with_suffix(".txt").write_text(truth)
    out = tmp_path / "mine.md"
    before = REPORT.stat().st_mtime_ns
    # When it is scored as docs/quality.md says
    assert main(["--images", str(tmp_path), "--out", str(out)]) == 0
    # Then the report has a row per image with truth, names the command, and docs/quality.md is untouched
    text = out.read_text()
    assert "| invoice_en.png | own |" in text and "| receipt_en.png | own |" in text and "single_line" not in text
    assert f"`python -m bench quality --images {tmp_path}`" in text
    assert REPORT.stat().st_mtime_ns == before
    # and docs/quality.md says how, in the words the report's generator writes
    assert "\n".join(OWN_IMAGES) in REPORT.read_text()
    (tmp_path / "empty").mkdir()
    assert main(["--images", str(tmp_path / "empty")]) == 2  # nothing to score: said so, exit 2
