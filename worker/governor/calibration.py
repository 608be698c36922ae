"""Online calibration of the governor's memory model: ``peak ≈ base + slope · tokens``.

Refitted on a window of recent batches. Least squares when the window's batches differ enough
in size to separate base from slope (a pseudo-point at zero tokens, the prior base, keeps the fit
sane with few points); otherwise base stays at its prior and slope is the mean ratio. The safety
margin is a floor plus 1.5× the worst under-prediction seen (in the window's residuals, and in
recent predictions made before their batch ran), so it shrinks to the floor as the fit gets good
and grows at once when the engine surprises us.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: a measured peak below this fraction of the prediction is suspect
_LOW_GLITCH = 0.5
#: ... until this many come in a row
_LOW_GLITCH_RUN = 3
#: the margin covers this multiple of the worst under-prediction seen
_SAFETY = 1.5


@dataclass(frozen=True)
class _Point:
    tokens: float
    peak: float
    #: OOM: the true peak was at least ``peak`` (a lower bound, kept out of the margin)
    censored: bool = False
    #: a low reading before warm-up, stored as half the prediction (a damped step, not a
    #: measurement): dropped from the window once ``warmup`` real points exist
    provisional: bool = False


class Calibrator:
    def __init__(
        self,
        base_prior: float,
        slope_prior: float,
        *,
        window: int = 32,
        warmup: int = 3,
        min_margin: float = 0.02,
        prior_margin: float = 0.20,
        max_margin: float = 1.0,
        error_window: int = 10,
    ) -> None:
        if slope_prior <= 0:
            raise ValueError(f"slope prior must be positive, got {slope_prior}")
        self.base_prior = max(0.0, base_prior)
        self.slope_prior = slope_prior
        self.warmup = warmup
        self.min_margin = min_margin
        self.prior_margin = prior_margin
        self.max_margin = max_margin
        self.base = self.base_prior
        self.slope = slope_prior
        self.observations = 0
        self.rejected = 0
        self._low_streak = 0
        self._points: deque[_Point] = deque(maxlen=window)
        self._errors: deque[float] = deque(maxlen=error_window)
        self._surprises: deque[float] = deque(maxlen=16)
        self._margin = max(min_margin, prior_margin)

    def predict(self, tokens: float) -> float:
        return self.base + self.slope * tokens

    def tokens_within(self, peak: float) -> float:
        """Most tokens whose predicted peak stays within ``peak`` (negative: not even zero)."""
        return (peak - self.base) / self.slope

    def margin(self) -> float:
        return self._margin

    def error(self) -> float | None:
        """Mean |predicted − measured| / measured over recent batches, predicted before each was
        seen (what planning actually faced)."""
        if not self._errors:
            return None
        return round(sum(self._errors) / len(self._errors), 4)

    def add(self, tokens: float, peak: float, *, predicted: float | None = None) -> None:
        if tokens <= 0 or peak <= 0:
            return
        expected = self.predict(tokens)
        # once calibrated, a peak far below the fit is a glitch (a lost counter, a lazy
        # allocator) more often than news, and trusting it would make the next batch bigger:
        # ignore it unless it keeps happening. Before that, a low prior comes down halfway a step.
        provisional = False
        if peak < _LOW_GLITCH * expected:
            if self.observations >= self.warmup and self._low_streak < _LOW_GLITCH_RUN:
                self._low_streak += 1
                self.rejected += 1
                return
            provisional = self.observations < self.warmup
            peak = _LOW_GLITCH * expected
        else:
            self._low_streak = 0
        guess = expected if predicted is None else predicted
        self._errors.append(abs(guess - peak) / peak)
        if self.observations >= self.warmup:
            # what planning actually faced; in-sample residuals flatter a fit made from them
            self._surprises.append((peak - guess) / guess)
        self._points.append(_Point(float(tokens), peak, provisional=provisional))
        self.observations += 1
        self._refit()

    def add_lower_bound(self, tokens: float, peak: float) -> None:
        if tokens > 0 and peak > 0:
            self._points.append(_Point(float(tokens), peak, censored=True))
            self._refit()

    def snapshot(self) -> dict[str, Any]:
        """What was learned, as plain JSON-able data (``restore`` takes it back)."""
        return {
            "points": [[p.tokens, p.peak, p.censored, p.provisional] for p in self._points],
            "surprises": list(self._surprises),
            "errors": list(self._errors),
            "observations": self.observations,
        }

    def restore(self, snap: Mapping[str, Any]) -> None:
        """Continue from a ``snapshot`` (a restarted worker on the same model and device).
        Malformed data raises ValueError and leaves the calibrator as it was."""
        try:
            points = [_Point(float(t), float(peak), bool(c), bool(prov)) for t, peak, c, prov in snap["points"]]
            surprises = [float(x) for x in snap.get("surprises", [])]
            errors = [float(x) for x in snap.get("errors", [])]
            observations = int(snap["observations"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad calibration snapshot: {exc}") from exc
        if any(p.tokens <= 0 or p.peak <= 0 for p in points) or observations < 0:
            raise ValueError("bad calibration snapshot: non-positive values")
        self._points.clear()
        self._points.extend(points)
        self._surprises.clear()
        self._surprises.extend(surprises)
        self._errors.clear()
        self._errors.extend(errors)
        self.observations = observations
        if points:
            self._refit()

    def _refit(self) -> None:
        if any(p.provisional for p in self._points) and sum(
            1 for p in self._points if not (p.provisional or p.censored)
        ) >= self.warmup:
            kept = [p for p in self._points if not p.provisional]
            self._points.clear()
            self._points.extend(kept)
        points = list(self._points)
        ts = [p.tokens for p in points]
        spread = len(points) >= 2 and max(ts) - min(ts) >= 0.1 * max(ts)
        if not (spread and self._least_squares(points)):
            ratios = [(p.peak - self.base_prior) / p.tokens for p in points]
            self.base = self.base_prior
            self.slope = max(0.1 * self.slope_prior, sum(ratios) / len(ratios))
        self._margin = self._fit_margin(points)

    def _least_squares(self, points: list[_Point]) -> bool:
        # a pseudo-point (0, base_prior) anchors the intercept while points are few; its weight
        # fades so a wrong weights figure cannot bias a well-fed fit
        w0 = 1.0 / len(points)
        n = len(points) + w0
        st = sum(p.tokens for p in points)
        sy = sum(p.peak for p in points) + w0 * self.base_prior
        stt = sum(p.tokens * p.tokens for p in points)
        sty = sum(p.tokens * p.peak for p in points)
        det = n * stt - st * st
        if det <= 0:
            return False
        slope = (n * sty - st * sy) / det
        base = (sy - slope * st) / n
        if slope < 0.1 * self.slope_prior or base < 0:
            return False
        self.base, self.slope = base, slope
        return True

    def _fit_margin(self, points: list[_Point]) -> float:
        real = [p for p in points if not (p.censored or p.provisional)]
        if len(real) < self.warmup:
            return max(self.min_margin, self.prior_margin)
        fitted = max((p.peak - self.predict(p.tokens)) / self.predict(p.tokens) for p in real)
        # the worst of n samples understates the worst to come, the more so for small n; and a
        # fit refitted on noisy peaks wobbles by part of the noise again
        worst = max(fitted * (1.0 + 2.0 / len(real)), max(self._surprises, default=0.0))
        return min(self.max_margin, self.min_margin + _SAFETY * max(0.0, worst))
