"""bench/bench_build.py in a seconds-long run: its tree is a valid input of the build, and its tables
hold every row. No speed is asserted."""

import json

import pytest

pytest.importorskip("skimage")

from bench import bench_build  # noqa: E402


def test_a_small_run_writes_every_row(tmp_path):
    bench_build.main(
        ["--out", str(tmp_path / "out"), "--data", str(tmp_path / "tree"), "--images", "12", "--rounds", "1"]
    )
    result = json.loads((tmp_path / "out/results.json").read_text())
    assert set(result["summary"]) == {"fasttrain", "fasttrain+index", "fasttrain+rows"}
    for row in result["summary"].values():
        assert row["images"] == 12 and row["job_cpu_ms"] > 0 and row["images_per_core_second"] > 0
    assert (tmp_path / "out/results.md").read_text().count("\n") == 5
    tree = json.loads((tmp_path / "tree/tree.json").read_text())
    assert tree["want"] == {"images": 12, "synsets": 16, "seed": 0}
    assert len(list((tmp_path / "tree/train").glob("*/*.JPEG"))) == 12
