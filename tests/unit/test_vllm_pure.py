"""The pure pieces the two vLLM engines share (``worker.engines.vllm.answers``, ``gpu_share``); no vLLM needed."""

from __future__ import annotations

import pytest

from ocrq.errors import TooLargeForDevice


def test_gpu_share_leaves_room_for_other_processes() -> None:
    from worker.engines.vllm.gpu_share import gpu_utilization

    gib = 1 << 30
    assert gpu_utilization(0.85, 80 * gib, 79 * gib) == 0.85  # an idle card: the setting stands
    assert gpu_utilization(0.85, 80 * gib, 41 * gib) == 0.5  # another process holds 39 GiB
    with pytest.raises(TooLargeForDevice):
        gpu_utilization(0.85, 80 * gib, 2 * gib)


def test_loop_cut_keeps_one_copy_of_the_unit() -> None:
    from worker.engines.vllm.answers import cut_repetition

    head = list(range(100, 110))
    kept, rep = cut_repetition(head + [1, 2, 3] * 12, 12)
    assert rep is not None and rep.unit == 3 and kept == head + [1, 2, 3]
    assert cut_repetition(head, 12) == (head, None)
