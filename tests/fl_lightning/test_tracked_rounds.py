"""The run's record of what it logged to W&B per round: appended durably, cut back on resume, read after a kill."""

import math

import numpy as np
import torch

from fl_lightning.outputs import tracked_rounds


def test_cut_back_keeps_the_done_rounds_and_drops_a_line_a_kill_cut_off(tmp_path):
    for r in (1, 2, 2, 3):
        tracked_rounds.append(tmp_path, r, {"eval/global/acc": 0.5 * r, "nan": math.nan}, None)
    path = tmp_path / tracked_rounds.JOURNAL
    path.write_text(path.read_text() + '{"round": 4, "metr')  # killed while writing round 4
    kept = tracked_rounds.cut_back(tmp_path, 2)
    assert [e["round"] for e in kept] == [1, 2, 2] and kept[1]["metrics"]["eval/global/acc"] == 1.0
    assert math.isnan(kept[0]["metrics"]["nan"])
    assert tracked_rounds.cut_back(tmp_path, 5) == kept  # the file now holds exactly them
    assert tracked_rounds.cut_back(tmp_path / "absent", 3) == []


def test_numbers_of_other_types_are_recorded_as_floats(tmp_path):
    tracked_rounds.append(tmp_path, 1, {"a": np.float32(0.25), "b": torch.tensor(2.0)}, [["client", "x"], [["s0", 1]]])
    (entry,) = tracked_rounds.cut_back(tmp_path, 1)
    assert entry["metrics"] == {"a": 0.25, "b": 2.0} and entry["clients"] == [["client", "x"], [["s0", 1]]]


def test_the_rounds_to_log_again_run_from_the_first_gap_to_the_checkpoint():
    assert tracked_rounds.rounds_to_log_again([1, 2], 3) == [3]
    assert tracked_rounds.rounds_to_log_again([1, 3], 4) == [2, 3, 4]  # from the gap on: the history stays in order
    assert tracked_rounds.rounds_to_log_again([1, 2, 3, 4], 3) == []
    assert tracked_rounds.rounds_to_log_again([], 2) == [1, 2]
