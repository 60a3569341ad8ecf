"""The CSpD trace (specgen.analysis.cspd_trace): per-step terms that add up to the decoder's ratios, from its CLI."""
import json

import pytest
import torch

from specgen.analysis import cspd_trace
from test_cspd_decoding import _near, _tiny_mar


def test_trace_splits_the_log_ratios_by_step():
    m = _tiny_mar(0)
    d = _near(m, 0.02, seed=3)
    res = cspd_trace.trace(m, d, ["a red circle", "two squares"], [0, 1], num_iter=4)
    K = m.diffusion.sample_steps
    assert res["aligned"].shape == res["exact"].shape == res["norm_aligned"].shape == (res["sigma"].shape[0], K)
    rows = cspd_trace.bands(res, num_bands=5)
    for key in ("exact", "norm_aligned"):
        total = float(res[key].sum(1).mean())
        assert abs(sum(r[f"logr_{key}"] for r in rows) - total) < 1e-4 * max(1.0, abs(total))
    assert float(res["exact"].sum(1).abs().max()) > 1e-3  # a different draft is seen
    same = cspd_trace.trace(m, m, ["a red circle"], [0], num_iter=4)
    for key in ("exact", "aligned", "norm_aligned"):
        assert float(same[key].abs().max()) < 1e-4, key
    summ = cspd_trace.summary(same, inner_temperatures=(5.0,))
    assert summ["exact/accept"] > 0.999 and summ["aligned/accept"] > 0.999 and summ["paper/T5/accept"] > 0.999
    assert summ["paper_noalign/T5/accept"] < 0.999  # the target's chain with other noise ends elsewhere
    c = cspd_trace.costs(m, d, batch=2, num_iter=4, gamma=2, prefill_ratio=0.25)
    assert c["target_only"] == pytest.approx(c["target/transformer"] + c["target/head_sampling"])
    assert c["paper_ceiling_speedup"] > 0 and c["exact_ceiling_speedup"] > 0


def test_trace_takes_every_path_and_writes_its_files(tmp_path, tiny_exports):
    out = tmp_path / "trace"
    res = cspd_trace.main(["--backbone", str(tiny_exports / "mar_p2"), "--draft", str(tiny_exports / "mar_p2"),
                           "--out", str(out), "--prompts", "2", "--inner-temperatures", "42",
                           "--num-iter", "4"])
    saved = json.loads((out / "trace.json").read_text())
    assert saved["num_iter"] == 4
    assert saved["summary"] == pytest.approx(res["summary"]) and saved["summary"]["paper/T42/accept"] > 0.999
    assert (out / "trace.txt").read_text().startswith("      steps")
    with pytest.raises(SystemExit):
        cspd_trace.main(["--backbone", str(tiny_exports / "mar_p2"), "--out", str(out)])  # --draft is required
