"""Analysis scripts run from their command lines, every path given as an argument."""
import json
import math
import shutil

import pytest

from specgen.analysis import context_probe, tokenizer_report


def test_tokenizer_report_writes_its_numbers_into_the_given_folder(tmp_path, tiny_exports, capsys):
    folder = tmp_path / "vq"
    shutil.copytree(tiny_exports / "vq", folder)
    (folder / "metrics.json").write_text('{"val/psnr": 20.0}')
    metrics = tokenizer_report.main([str(folder), "--n", "4", "--write"])
    assert set(metrics) == {f"report/{t}/{k}" for t in ("plain", "textured")
                            for k in ("psnr", "parser_acc_reconstructed", "parser_acc_rendered", "num_objects")}
    assert metrics["report/plain/parser_acc_rendered"] == 1.0  # the parser is exact on rendered scenes
    assert 0 <= metrics["report/plain/parser_acc_reconstructed"] <= 1 and math.isfinite(metrics["report/plain/psnr"])
    written = json.loads((folder / "metrics.json").read_text())
    assert written["val/psnr"] == 20.0 and written["report/plain/psnr"] == metrics["report/plain/psnr"]
    assert "report/textured/psnr" in capsys.readouterr().out


def test_context_probe_takes_every_path_and_writes_its_json(tmp_path, tiny_exports):
    out = tmp_path / "probe" / "mar.json"
    res = context_probe.main(["--backbone", str(tiny_exports / "mar_p2"), "--tokenizer", str(tiny_exports / "kl"),
                              "--images", "4", "--out", str(out), "--losses"])
    assert json.loads(out.read_text()).keys() == res.keys()
    assert 0 < res["foreground_share"] < 1 and set(res["losses"]) >= {"snr/t500", "prompt/t500/eps_mse"}
    with pytest.raises(SystemExit):  # no tokenizer default: a path is never guessed
        context_probe.main(["--backbone", str(tiny_exports / "mar_p2"), "--out", str(out)])
