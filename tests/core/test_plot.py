"""``trellis plot``: curves of several runs overlaid in one PNG; run folders and metric names as
positional arguments."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from trellis.cli import main

COLORS = {"C0": (0x1F, 0x77, 0xB4), "C1": (0xFF, 0x7F, 0x0E), "C2": (0x2C, 0xA0, 0x2C)}  # matplotlib's first line colours


def write_run(folder, rewards):
    folder.mkdir()
    rows = [{"step": i + 1, "reward/mean": r, "actor/entropy": 1.0 - r, "timing/step_s": 0.5} for i, r in enumerate(rewards)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def has_colour(image, rgb) -> bool:
    return bool((np.abs(image[..., :3] * 255 - np.array(rgb)) < 8).all(-1).any())


def test_several_runs_overlay_into_one_png(tmp_path, capsys):
    import matplotlib.image

    a = write_run(tmp_path / "a", [0.1, 0.2, 0.4])
    b = write_run(tmp_path / "b", [0.3, 0.3, 0.5])
    out = tmp_path / "curves.png"
    assert main(["plot", a, b, "reward/mean", "actor/entropy", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    image = matplotlib.image.imread(out)
    assert has_colour(image, COLORS["C0"]) and has_colour(image, COLORS["C1"])  # one line per run...
    assert not has_colour(image, COLORS["C2"])  # ...and only two runs
    assert image.shape[1] > image.shape[0]  # two panels side by side


def test_default_metrics_and_default_output(tmp_path):
    a = write_run(tmp_path / "a", [0.1, 0.2])
    assert main(["plot", a]) == 0
    assert (tmp_path / "a" / "curves.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no/such/run", "reward/mean"], "none of ['no/such/run', 'reward/mean'] is a run folder"),
        (["{a}", "reward/maen"], "none of the metrics ['reward/maen'] appear in"),
        (["{a}", "reward/maen"], "; they have: actor/entropy, reward/mean, timing/step_s"),
    ],
)
def test_plot_errors_name_the_fix(tmp_path, capsys, args, message):
    a = write_run(tmp_path / "a", [0.1])
    assert main(["plot", *[x.format(a=a) for x in args]]) == 2
    assert message in capsys.readouterr().err


def test_the_default_plot_has_held_out_greedy_accuracy(tmp_path):
    """A panel more when the runs validated greedily (it was left out of the default curves)."""
    import matplotlib.image

    plain = write_run(tmp_path / "plain", [0.1, 0.2])
    greedy = write_run(tmp_path / "greedy", [0.1, 0.2])
    with open(f"{greedy}/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "val/greedy_reward_mean": 0.5}) + "\n")
    assert main(["plot", plain]) == 0 and main(["plot", greedy]) == 0
    sizes = [matplotlib.image.imread(f"{run}/curves.png").shape[:2] for run in (plain, greedy)]
    assert sizes[1][0] > sizes[0][0], sizes  # 3 panels fill a row; the 4th starts a second


def test_without_matplotlib_the_command_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the [plot] extra imports
    assert main(["plot", write_run(tmp_path / "a", [0.1, 0.2])]) == 2
    assert (
        capsys.readouterr().err.strip() == "trellis: error: plots are drawn with matplotlib, which is not installed: pip install trellis-core[plot]"
    )
