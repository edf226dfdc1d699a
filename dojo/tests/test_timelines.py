"""dojo/dev/timelines.py: the pipeline schedules drawn on a clock, and the measured pictures' legend."""

from dojo.dev import timelines
from dojo.harness import timeline


def test_each_schedule_on_a_clock_is_every_action_once_never_two_at_a_time(tmp_path):
    for picture, boxes in timelines.ON_A_CLOCK:
        rows, title, names = boxes()
        assert len(rows) == 4, f"{picture}: a row per rank of the 4"
        for rank, row in enumerate(rows):
            labels = [label for _, _, label, _ in row]
            assert len(labels) == len(set(labels)), f"{picture}: rank {rank} repeats an action"
            ends = sorted((start, start + ticks) for start, ticks, _, _ in row)
            for (_, end), (start, _) in zip(ends, ends[1:]):
                assert start >= end, f"{picture}: rank {rank} runs two actions at once"
            assert {kind for *_, kind in row} <= set(names), f"{picture}: a kind without legend"
        forwards = [label for _, _, label, kind in rows[0] if kind == "F"]
        assert len(forwards) == 8 * (2 if "interleaved" in picture else 1), picture
        path = tmp_path / picture
        timelines.draw_clock(rows, str(path), title, names)
        assert path.read_bytes().startswith(b"\x89PNG"), f"{picture} is not a PNG"


def test_zero_bubble_on_a_clock_idles_a_third_of_1f1b():
    clocks = {picture: boxes() for picture, boxes in timelines.ON_A_CLOCK}
    rows, _, _ = clocks["k27_zero_bubble_schedule.png"]
    length = max(start + ticks for row in rows for start, ticks, _, _ in row)
    busy = sum(ticks for _, ticks, _, _ in rows[0])
    assert (length - busy) / busy == (4 - 1) / (3 * 8), "ZB-H1's bubble is (p-1)/(3m)"


def test_the_measured_legend_names_a_part_by_its_family_and_an_example():
    assert timeline._part_key("F0.3") == "F"
    assert timeline._part_key("W12") == "W"
    assert timeline._part_key("reduce-scatter") == "reduce-scatter"
    assert timeline._part_key("step 2") == "step"
    assert timeline._part_label("F", "F0.0") == "part: F (F0.0, ...)"
    assert timeline._part_label("reduce-scatter", "reduce-scatter") == "part: reduce-scatter"
