"""analysis.sample_nll: the target's log-probability of sampled tokens, and its excess over the entropy."""
import json

import numpy as np
import pytest
import torch
from helpers import tiny_llama

from specgen.analysis import sample_nll
from specgen.decoding import ar
from specgen.decoding.sampling import make_rngs
from specgen.drafters.fphi import FPhi

PROMPTS = ["a photo of a red circle", "two squares", "a large blue cross in the top left ."]


def test_token_logprobs_are_the_distributions_ar_sampled_from():
    """The teacher-forced scores equal the log-probability and entropy of the very distributions AR drew each token
    from (captured from AR's own single-position passes), guided at CFG 3."""
    m = tiny_llama(True, sharpen=3.0)
    p = m.prompts(PROMPTS)
    seen = []
    draw = ar.sample

    def spy(logits, temperature=1.0, top_k=None, rngs=None):
        tok = draw(logits, temperature, top_k, rngs)
        seen.append((torch.log_softmax(logits.float(), -1), tok))
        return tok

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ar, "sample", spy)
        codes, _ = ar.generate(m, p, cfg_scale=3.0, rngs=make_rngs([0, 1, 2]))
    logp, entropy = sample_nll.token_logprobs(m, p, codes, cfg_scale=3.0)
    want_logp = torch.stack([lp.gather(-1, t[:, None])[:, 0] for lp, t in seen], 1).view_as(logp)
    want_entropy = torch.stack([-(lp.exp() * lp).sum(-1) for lp, _ in seen], 1).view_as(entropy)
    assert torch.allclose(logp, want_logp, atol=1e-4)
    assert torch.allclose(entropy, want_entropy, atol=1e-4)
    assert float(want_entropy.mean()) > 0.3  # the test is not about one-hot distributions


def test_excess_is_zero_for_exact_samplers_and_negative_for_cold_ones():
    """AR and SSD with carry draw each token from the target given its prefix: their mean excess over the entropy
    is zero within its interval; the paper's auto-correction keeps tokens never checked against their final context
    (too unlikely ones); SSD sampling at temperature 0.5, scored at 1, keeps too-likely tokens."""
    m = tiny_llama(True, sharpen=3.0)
    torch.manual_seed(1)
    d = FPhi(m.hidden_size, "xs")
    for net in d.nets.values():
        torch.nn.init.normal_(net[-1].weight, std=0.05)
    prompts = [PROMPTS[i % 3] for i in range(96)]
    carry, paper = "specgen.decoding.ssd_carry.generate", "specgen.decoding.ssd.generate"
    runs = {"ar": None, "ssd": {"_target_": carry}, "paper": {"_target_": paper, "rounds": 0},
            "cold": {"_target_": carry, "temperature": 0.5}}
    res = {name: sample_nll.summarise(sample_nll.sample_logprobs(m, d, prompts, 2.0, 0, opts, 32).numpy(), None)
           for name, opts in runs.items()}
    for name in ("ar", "ssd"):
        assert abs(res[name]["excess"]) < 2 * res[name]["excess_ci95"], (name, res[name]["excess"])
    assert res["paper"]["excess"] - res["paper"]["excess_ci95"] > 0
    assert res["cold"]["excess"] + res["cold"]["excess_ci95"] < 0
    assert res["cold"]["nll"] < res["ar"]["nll"]


def test_summarise_pairs_by_prompt_and_main_writes_its_files(tmp_path, tiny_exports):
    rng = np.random.default_rng(0)
    ref = np.stack([np.log(rng.uniform(0.1, 1, (8, 2, 3))), rng.uniform(0, 1, (8, 2, 3))])
    other = ref.copy()
    other[0] -= 0.5  # every token half a nat less likely
    r = sample_nll.summarise(other, ref)
    assert r["nll_minus_ar"] == pytest.approx(0.5) and r["nll_minus_ar_ci95"] == pytest.approx(0, abs=1e-9)
    assert r["excess"] == pytest.approx(float((-other[0] - other[1]).mean()))
    assert len(r["excess_per_row"]) == 2 and len(r["excess_per_col"]) == 3
    out = tmp_path / "nll"
    args = ["--backbone", str(tiny_exports / "ar"), "--tokenizer", str(tiny_exports / "vq"), "--drafter",
            str(tiny_exports / "fphi"), "--prompts", "4", "--batch-size", "2", "--out", str(out),
            "--variant", "carry=rounds:0,tails:[]"]
    res = sample_nll.main(args)
    assert set(res) == {"ar", "carry"} and res["carry"]["images"] == 4 and "nll_minus_ar" in res["carry"]
    assert json.loads((out / "sample_nll.json").read_text()) == res
    assert (out / "sample_nll.png").is_file()
    with pytest.raises(SystemExit):
        sample_nll.main(args[:7] + ["--prompts", "1", "--out", str(out)])
