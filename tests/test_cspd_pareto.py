"""The Pareto table of CSpD against the target at fewer steps (specgen.analysis.cspd_pareto), from a metrics file."""
import json

import pytest

from specgen.analysis import cspd_pareto


def _metrics():
    m = {}
    for name, passes, score, ci, wall16, alpha in (("mar", 64, 0.70, 0.04, 1.0, None), ("mar21", 21, 0.62, 0.04, 2.2, None),
                                                   ("cspd", 20, 0.75, 0.04, 1.8, 0.45), ("cspd_g8", 12, 0.60, 0.04, 2.5, 0.4)):
        m.update({f"{name}/geneval/overall": score, f"{name}/geneval/overall_ci95": ci,
                  f"{name}/speed/target_calls_bs1": passes, f"{name}/speed/target_sets_bs1": passes,
                  f"{name}/speed/wall_ratio_bs1": wall16, f"{name}/speed/wall_ratio_bs16": wall16})
        if alpha is not None:
            m.update({f"{name}/accept_rate": alpha, f"{name}/geneval/overall_diff": score - 0.70,
                      f"{name}/geneval/overall_diff_ci95": 0.03})
    return m


def test_front_and_ahead_of(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps(_metrics()))
    res = cspd_pareto.main([str(tmp_path / "metrics.json"), "--out", str(tmp_path / "out")])
    assert res["front_passes"] == ["cspd", "cspd_g8"]  # mar and mar21 cost as many passes or more for less GenEval
    assert res["front_wall16"] == ["mar21", "cspd", "cspd_g8"]  # mar21 is faster than cspd on the clock
    assert res["ahead_of"] == {"cspd": ["mar21"], "cspd_g8": []}  # 0.75 - 0.62 > hypot(0.04, 0.04); mar: 0.05 is not
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "cspd > mar21" in text and (tmp_path / "out" / "pareto.png").stat().st_size > 1000
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="has no '<strategy>/geneval/overall'"):
        cspd_pareto.main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "out")])
