"""benchmarks.meters.query_latency reports a job's own peak RSS, not the meter's (Linux carries a parent's
high-water mark through fork and exec into a child's ru_maxrss)."""
import numpy as np

from benchmarks.meters.query_latency import _child


def test_a_jobs_peak_rss_is_its_own_not_the_meters(tmp_path):
    held = np.ones(400 * 2**20 // 8)  # 400 MiB touched in this process, as the meter holds its opened engine
    wall, peak_mib = _child(["json.tool", "--help"], str(tmp_path / "child.log"))
    assert held.sum() > 0 and wall > 0
    assert 0 < peak_mib < 200, peak_mib  # a bare interpreter: tens of MiB
    assert "json.tool" in (tmp_path / "child.log").read_text()
