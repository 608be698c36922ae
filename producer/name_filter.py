"""Which files found in a folder or under an S3 prefix a submission takes (``ocrq submit --match``,
the API's ``match``): shell patterns on the file's name, any case, any one of them enough.

Datasets keep labels and notes beside their scans (``page.png`` with ``page.txt`` and
``page.json``). A folder's every file goes to the workers, which sniff the content and fail what
is not an image with ``BadImage``; ``--match '*.png' --match '*.jpg'`` leaves the rest out at
intake instead, each counted and listed as skipped. Files named on their own (an argument, a
manifest row) are taken whatever their name: the caller chose them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_PATTERNS", "MAX_PATTERN_CHARS", "NameFilter"]

#: patterns one submission may give, and characters each
MAX_PATTERNS = 16
MAX_PATTERN_CHARS = 128


@dataclass(frozen=True)
class NameFilter:
    patterns: tuple[str, ...] = ()

    @classmethod
    def of(cls, patterns: Sequence[str] | None) -> NameFilter:
        """The filter, or a ValueError that says what is wrong with ``patterns``."""
        patterns = tuple(patterns or ())
        if len(patterns) > MAX_PATTERNS:
            raise ValueError(f"at most {MAX_PATTERNS} name patterns, not {len(patterns)}")
        for pattern in patterns:
            if not pattern or len(pattern) > MAX_PATTERN_CHARS:
                raise ValueError(f"a name pattern has 1 to {MAX_PATTERN_CHARS} characters: {pattern[:40]!r}")
            if "/" in pattern:
                raise ValueError(f"a name pattern matches a file's name, not its path: {pattern!r} "
                                 f"(try {pattern.rpartition('/')[2] or '*'!r})")
        return cls(tuple(p.lower() for p in patterns))

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def takes(self, ref: str) -> bool:
        """Whether the file ``ref`` names (a path or an ``s3://`` key) matches; every file does
        when there are no patterns."""
        if not self.patterns:
            return True
        name = ref.rpartition("/")[2].lower()
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def reason(self) -> str:
        return "its name matches none of " + ", ".join(self.patterns)
