"""Analysis scripts run from their command lines, every path given as an argument."""
import json
import math
import shutil

import pytest
import torch

from specgen.analysis import context_probe, tokenizer_report
from specgen.backbones.mar import ShapesMAR
from specgen.tokenizers.kl import KLAutoencoder


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


def test_context_probe_neighbour_estimate_and_probe_values():
    x0 = torch.arange(9.0).reshape(1, 9, 1)  # a 3x3 token grid, one channel
    mask = torch.zeros(1, 9)
    mask[0, [4, 0, 1, 3]] = 1  # centre and the top-left corner with both its neighbours unknown
    est = context_probe.neighbour_mean(x0, mask, torch.full((1, 1, 1), -1.0))
    assert float(est[0, 4, 0]) == (5 + 7) / 2  # known neighbours of the centre: 5 and 7 (1 and 3 are masked)
    assert float(est[0, 0, 0]) == -1.0  # no known neighbour: the background
    assert float(est[0, 1, 0]) == 2.0  # token 1: of its neighbours 0, 2 and 4, only 2 is known
    torch.manual_seed(0)
    mar = ShapesMAR(grid_size=16, token_dim=3, preset="tiny", sample_steps=5, patch_size=2).eval()
    kl = KLAutoencoder(image_size=64, ch=8, mults=(2, 4), z_dim=3).eval()
    res = context_probe.probe(mar, kl, num_images=4, known=(0.0, 0.9), timesteps=(1, 900))
    assert 0 < res["foreground_share"] < 1
    assert set(res) - {"foreground_share"} == {f"{c}/known{k}/t{t}" for c in ("prompt", "null") for k in ("0", "0.9")
                                               for t in (1, 900)} | {"neighbours/known0", "neighbours/known0.9"}
    assert all(math.isfinite(v) and v <= 1 for v in res.values())
    # at t=1 x_t is the latent up to 1e-4 of noise: any bounded denoiser's x0-estimate explains it almost fully
    assert min(res[f"{c}/known{k}/t1"] for c in ("prompt", "null") for k in ("0", "0.9")) > 0.9
    # loss by timestep: the fresh head outputs epsilon = 0, so its epsilon MSE is E[noise^2] = 1 at every t,
    # and the x0 MSE it implies grows as SNR_t falls
    losses = context_probe.timestep_losses(mar, kl, num_images=4, timesteps=(0, 500, 950))
    for c in ("prompt", "null"):
        assert all(abs(losses[f"{c}/t{t}/eps_mse"] - 1) < 0.1 for t in (0, 500, 950))
        assert losses[f"{c}/t0/x0_mse"] < losses[f"{c}/t500/x0_mse"] < losses[f"{c}/t950/x0_mse"]
        assert math.isclose(losses[f"{c}/t500/x0_mse"] * losses["snr/t500"], losses[f"{c}/t500/eps_mse"])


def test_sure_accept_terms_and_splits_against_a_hand_computation():
    from specgen.analysis.sure_accept import position_terms, split_means

    p = torch.tensor([[0.95, 0.05], [0.6, 0.4]])
    q = torch.tensor([[0.5, 0.5], [0.2, 0.8]])
    stacked = lambda x: torch.cat([x.log(), torch.zeros_like(x)])  # noqa: E731  [cond; uncond]: CFG 1 keeps cond
    terms = position_terms(stacked(p), stacked(q), cfg_scale=1.0, draft_temperature=0.5)
    cold = torch.tensor([0.04, 0.64]) / 0.68  # q ** (1 / 0.5), normalised
    expect = {"accept": [0.55, 0.6], "accept_cold": [0.55, float(cold[0]) + 0.4], "accept_argmax": [0.95, 0.4],
              "ceiling_argmax": [0.95, 0.6], "top1": [1.0, 0.0]}
    for key, values in expect.items():
        assert torch.allclose(terms[key], torch.tensor(values), atol=1e-6), key
    splits = split_means(terms, threshold=0.9)
    assert splits["sure"]["share"] == 0.5 and splits["sure"]["accept"] == pytest.approx(0.55)
    assert splits["unsure"]["accept_argmax"] == pytest.approx(0.4)
    assert splits["all"]["accept"] == pytest.approx(0.575)
    assert set(split_means(terms, threshold=0.99)["sure"]) == {"share"}  # no sure position: no means


def test_sure_accept_runs_from_its_command_line(tmp_path, tiny_exports):
    from specgen.analysis import sure_accept

    out = tmp_path / "r" / "sure.json"
    res = sure_accept.main(["--drafter", str(tiny_exports / "fphi"), "--backbone", str(tiny_exports / "ar"),
                            "--tokenizer", str(tiny_exports / "vq"), "--images", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert res["positions"] == 2 * 15 * 16  # every down position of a 16 x 16 grid
    shares = [res["splits"][s]["share"] for s in ("sure", "unsure")]
    assert sum(shares) == pytest.approx(1.0) and res["splits"]["all"]["share"] == 1.0
    r = res["splits"]["all"]
    assert 0 < r["accept"] <= 1 and 0 < r["accept_cold"] <= 1
    assert r["accept_argmax"] <= r["ceiling_argmax"] + 1e-6  # p at q's argmax is at most p's largest probability
    with pytest.raises(SystemExit):
        sure_accept.main(["--drafter", "x", "--backbone", "x", "--tokenizer", "x", "--images", "0", "--out", "x"])
