"""Speculative decoders against references: token equality with AR under greedy decoding, and the
model's exact distribution for the lossless modes (SSD exact, multi-token heads, draft model)."""
import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from specgen.backbones.shapes_llama import ShapesLlama
from specgen.decoding import ar, mtp1d, sjd, specdec, ssd, ssd_columns, zipar
from specgen.decoding.sampling import make_rngs
from specgen.drafters.fphi import FPhi
from specgen.drafters.mtp import MTPHeads
from helpers import tiny_llama

PROMPTS = ["a photo of a red circle", "two squares", "a large blue cross in the top left ."]


def tiny(eol: bool, codes: int = 24, grid: int = 5, sharpen: float = 20.0) -> ShapesLlama:
    return tiny_llama(eol, codes, grid, sharpen)


def noisy_drafter(m: ShapesLlama, left: bool = False) -> FPhi:
    """An imperfect drafter (many rejections); `left`: with row and left context (drafts a down row left to right)."""
    torch.manual_seed(1)
    d = FPhi(m.hidden_size, "xs", **(dict(context_kernel=3, left_context=True) if left else {}))
    for net in d.nets.values():
        torch.nn.init.normal_(net[-1].weight, std=0.05)
    if left:
        for lin in (d.left_in, d.left_block.mlp[-1]):
            torch.nn.init.normal_(lin.weight, std=0.05)
    return d


@pytest.mark.parametrize("eol", [True, False])
@pytest.mark.parametrize("kw", [dict(rounds=5), dict(exact=True), dict(rounds=5, vertical=False),
                                dict(exact=True, vertical=False), dict(rounds=0, carry=True),
                                dict(rounds=1, carry=True, vertical=False), dict(rounds=0, carry=True,
                                                                                  acceptance="typical"),
                                dict(rounds=0, carry=True, acceptance="typical_carried", redraft=2),
                                dict(rounds=0, carry=True, left_draft="above"), dict(rounds=5, left_draft="above"),
                                dict(rounds=0, carry=True, left_draft="sequential"),
                                dict(rounds=0, carry=True, left_draft="refine"),
                                dict(rounds=0, carry=True, siblings=3, redraft=2),
                                dict(rounds=0, carry=True, left_draft="sequential", redraft=2, reweight=3)])
def test_greedy_ssd_equals_greedy_ar(eol, kw):
    m = tiny(eol)
    p = m.prompts(PROMPTS)
    drafter = noisy_drafter(m, left="left_draft" in kw)
    for scale in (1.0, 3.0):
        ref, _ = ar.generate(m, p, cfg_scale=scale, temperature=0)
        out, st = ssd.generate(m, p, drafter, cfg_scale=scale, temperature=0, **kw)
        assert torch.equal(out, ref)
        assert len(torch.unique(ref)) > 3


def noisy_heads(m: ShapesLlama, k: int = 3) -> MTPHeads:
    torch.manual_seed(3)
    heads = MTPHeads(m.hidden_size, k)
    for net in heads.nets.values():
        torch.nn.init.normal_(net[-1].weight, std=0.05)
    return heads


def draft_model(m: ShapesLlama, seed: int = 4) -> ShapesLlama:
    torch.manual_seed(seed)
    g = m.grid
    d = ShapesLlama(num_codes=g.num_visual, grid_size=g.height, eol=g.eol_id is not None, preset="tiny").eval()
    with torch.no_grad():
        d.model.lm_head.weight.mul_(3)
    return d


@pytest.mark.parametrize("eol", [True, False])
def test_greedy_1d_speculation_equals_greedy_ar(eol):
    m = tiny(eol)
    p = m.prompts(PROMPTS)
    for scale in (1.0, 3.0):
        ref, _ = ar.generate(m, p, cfg_scale=scale, temperature=0)
        out, _ = mtp1d.generate(m, p, noisy_heads(m), cfg_scale=scale, temperature=0)
        assert torch.equal(out, ref)
        out, _ = specdec.generate(m, p, draft_model(m), cfg_scale=scale, temperature=0, window=3)
        assert torch.equal(out, ref)
        for init in sjd.INITS:
            out, _ = sjd.generate(m, p, cfg_scale=scale, temperature=0, window=6, init=init)
            assert torch.equal(out, ref)
    # drafting with the target itself: every draft accepted, window + 1 tokens per pass
    out, st = specdec.generate(m, p, m, cfg_scale=3.0, temperature=0, window=3)
    assert torch.equal(out, ref)
    assert st["nfe"] == 1 + -(-m.grid.num_visual_tokens // 4)


@pytest.mark.parametrize("eol", [True, False])
def test_zipar_window_w_is_ar_and_smaller_windows_save_passes(eol):
    """window = W must reproduce AR exactly (this checks the 4-D masks of non-contiguous feeding)."""
    m = tiny(eol)
    p = m.prompts(PROMPTS)
    ref, st_ar = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    out, st = zipar.generate(m, p, cfg_scale=3.0, temperature=0, window=m.grid.width)
    assert torch.equal(out, ref) and st["nfe"] == st_ar["nfe"]
    out, st = zipar.generate(m, p, cfg_scale=3.0, temperature=0, window=2)
    assert torch.equal(out[:, 0], ref[:, 0])  # the first row sees its whole causal context
    assert st["nfe"] < st_ar["nfe"]


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_nfe_is_bounded_by_rows_times_rounds_plus_one(rounds):
    m = tiny(True)
    _, st = ssd.generate(m, m.prompts(PROMPTS), noisy_drafter(m), cfg_scale=3.0, rounds=rounds,
                         rngs=make_rngs([0, 1, 2]))
    assert st["nfe"] <= m.grid.height * (rounds + 1) + 1
    assert st["accept_map"].shape == (3, m.grid.height, m.grid.width)
    assert (st["rounds_per_row"] <= rounds + 1).all()


def test_unchecked_tokens_count_what_the_last_round_left_unverified():
    """Auto-correct reports the tokens never judged with their final left context: some at r = 0 with a
    poor drafter, none once every row has converged (greedy, r = W), none with carry."""
    m = tiny(True)
    p = m.prompts(PROMPTS)
    _, st0 = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rounds=0, rngs=make_rngs([0, 1, 2]))
    assert st0["unchecked_tokens"].sum() > 0
    assert (st0["unchecked_tokens"] <= m.grid.num_visual_tokens).all()
    _, stw = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, temperature=0, rounds=m.grid.width)
    assert (stw["unchecked_tokens"] == 0).all()
    _, stc = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rounds=0, carry=True,
                          rngs=make_rngs([0, 1, 2]))
    assert (stc["unchecked_tokens"] == 0).all()


@pytest.mark.parametrize("rounds", [0, 2])
def test_carry_spends_the_row_budget_then_only_the_flush(rounds):
    """carry=True: at most rounds + 1 passes per row, then passes only until the last carried token is
    final."""
    m = tiny(True)
    _, st = ssd.generate(m, m.prompts(PROMPTS), noisy_drafter(m), cfg_scale=3.0, rounds=rounds, carry=True,
                         rngs=make_rngs([0, 1, 2]))
    assert st["flush_passes"] <= m.grid.num_visual_tokens
    assert st["nfe"] <= m.grid.height * (rounds + 1) + 1 + st["flush_passes"]
    assert (st["rounds_per_row"] <= rounds + 1).all()


@pytest.mark.parametrize("rounds", [0, 2])
def test_carry_pass_statistics_account_for_every_token_once(rounds):
    """Where the passes go: every visual token is judged fresh once and finalised once, so tokens finalised per
    pass times the image's passes is the grid, sampled or greedy; a noisy drafter's fresh drafts change more often
    than carried tokens (which are checked against the last pass's p)."""
    m = tiny(True)
    p = m.prompts(PROMPTS)
    n = m.grid.num_visual_tokens
    _, st = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rounds=rounds, carry=True, rngs=make_rngs([0, 1, 2]))
    assert torch.allclose(st["final_per_pass"] * (st["image_passes"] - 1), torch.full((3,), float(n)))
    for key in ("fresh_change_rate", "carried_change_rate", "first_change_fresh"):
        assert ((st[key] >= 0) & (st[key] <= 1)).all(), key
    assert (st["fresh_change_rate"] > st["carried_change_rate"]).all() and (st["fresh_change_rate"] > 0.2).all()
    # cascades: by distance, every token is judged fresh once; the bins add up to the change rates; a pass whose
    # window's first token (distance 0) changed finalised only that token
    by = st["change_by_distance"]  # (B, fresh/carried, judged/changed, distance)
    assert by.shape == (3, 2, 2, 2 * m.grid.width)
    assert torch.equal(by[:, 0, 0].sum(-1), torch.full((3,), float(n)))
    for kind, key in enumerate(("fresh_change_rate", "carried_change_rate")):
        assert torch.allclose(by[:, kind, 1].sum(-1) / by[:, kind, 0].sum(-1).clamp_min(1), st[key])
    assert torch.allclose(st["single_token_passes"] * (st["image_passes"] - 1), by[:, :, 1, 0].sum(1))
    assert ((st["after_change_rate"] >= 0) & (st["after_change_rate"] <= 1)).all()
    assert (by[:, :, 1] <= by[:, :, 0]).all() and (st["single_token_passes"] > 0).all()
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    out, st = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, temperature=0, rounds=rounds, carry=True)
    assert torch.equal(out, ref)
    assert torch.allclose(st["final_per_pass"] * (st["image_passes"] - 1), torch.full((3,), float(n)))


def _exact_joint(m: ShapesLlama, prompt: str, cfg_scale: float) -> np.ndarray:
    """Exact probability of every image of the model's (small) grid (temperature 1), by enumeration: (V ** (H W),)
    in the order of `_cells`, one batched forward for the conditional and one for the unconditional prompt."""
    g = m.grid
    V, n = g.num_visual, g.height * g.width
    cells = torch.tensor(list(itertools.product(range(V), repeat=n)))  # (V ** n, n)
    seqs = g.grid_to_sequence(cells.view(-1, g.height, g.width))
    prompts = [m.prompt_ids([prompt])] + ([m.null_prompt_ids(1)] if cfg_scale != 1 else [])
    cols = [g.position(r, c) - 1 for r, c in itertools.product(range(g.height), range(g.width))]  # logits before
    with torch.no_grad():
        lv = [m(torch.cat([ids.expand(len(cells), -1), seqs], 1))[:, cols, g.visual_start:g.visual_start + V]
              for ids in prompts]
    logits = lv[0] if cfg_scale == 1 else lv[1] + cfg_scale * (lv[0] - lv[1])
    lp = torch.log_softmax(logits.double(), -1).gather(-1, cells[..., None]).squeeze(-1).sum(1)
    return torch.softmax(lp, 0).numpy()


def _gof_pvalue(out: torch.Tensor, joint: np.ndarray) -> float:
    """Chi-square p-value of sampled images (N, H, W) against `_exact_joint` (cells with expected count < 5 pooled)."""
    n, tokens = out.shape[0], out[0].numel()
    V = round(len(joint) ** (1 / tokens))
    flat = (out.reshape(n, tokens) * V ** torch.arange(tokens - 1, -1, -1)).sum(1).numpy()
    observed = np.bincount(flat, minlength=len(joint))
    expected = joint * n
    keep = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("decoder", ["ar", "ssd_exact", "ssd_exact_horizontal", "ssd_exact_argmax_draft", "mtp1d",
                                     "specdec", "sjd", "ssd_carry_default", "ssd_row_draft", "ssd_siblings",
                                     "ssd_reweight", "broken", "ssd_typical"])
def test_lossless_modes_sample_the_models_distribution(decoder, monkeypatch):
    """Chi-square goodness of fit of 4000 sampled 2x2 images against the exact joint (256 cells).

    `ssd_carry_default` is the carry window with the default `ssd`'s settings (approximately lossless: carried tokens
    are checked against the last pass's p); `ssd_row_draft` the same with a left-context drafter whose down rows are
    drafted in one call (`left_draft="above"`), `ssd_siblings` the default's with alternatives fed for the token after
    a change (`siblings=2`), `ssd_reweight` the default's with the token after a change in a down row drawn again from
    the reweighted p (`reweight=2`, a left-context drafter). `broken` (every draft accepted: samples from the drafter) and
    `ssd_typical` (typical acceptance keeps plausible drafts: not lossless) show that the test has power."""
    if decoder == "ssd_siblings":  # 2 codes: a change always draws the fed alternative; 3x3 without end-of-row
        m = tiny(False, codes=2, grid=3, sharpen=3.0)  # tokens (after a row's last token: the next row's first)
    else:
        m = tiny(True, codes=4, grid=2, sharpen=3.0)
    joint = _exact_joint(m, PROMPTS[0], cfg_scale=2.0)
    n = 4000
    prompt_ids = m.prompts([PROMPTS[0]] * n)
    rngs = make_rngs(range(n))
    if decoder == "ar":
        out, _ = ar.generate(m, prompt_ids, cfg_scale=2.0, rngs=rngs)
    elif decoder == "mtp1d":
        out, _ = mtp1d.generate(m, prompt_ids, noisy_heads(m, 2), cfg_scale=2.0, rngs=rngs)
    elif decoder == "sjd":
        out, _ = sjd.generate(m, prompt_ids, cfg_scale=2.0, rngs=rngs, window=3, init="vertical")
    elif decoder == "specdec":
        out, _ = specdec.generate(m, prompt_ids, draft_model(m), cfg_scale=2.0, rngs=rngs, window=2)
    elif decoder in ("ssd_carry_default", "ssd_row_draft", "ssd_siblings", "ssd_reweight", "ssd_typical"):
        kw = dict(rounds=0, carry=True, max_window_rows=2, draft_temperature=0.5, redraft=4, redraft_rows=1,
                  second_row_wait=2, acceptance="typical" if decoder == "ssd_typical" else "speculative")
        if decoder == "ssd_row_draft":
            kw["left_draft"] = "above"
        if decoder == "ssd_siblings":
            kw["siblings"] = 2
        if decoder == "ssd_reweight":
            kw["reweight"] = 2
        left = decoder in ("ssd_row_draft", "ssd_reweight")
        out, st = ssd.generate(m, prompt_ids, noisy_drafter(m, left=left), cfg_scale=2.0, rngs=rngs, **kw)
        if decoder == "ssd_reweight":  # the reweighted draws happen: more draft calls than the same without
            _, plain = ssd.generate(m, prompt_ids, noisy_drafter(m, left=True), cfg_scale=2.0, rngs=make_rngs(range(n)),
                                    **dict(kw, reweight=0))
            assert st["draft_calls"] > plain["draft_calls"] + 200
        if decoder == "ssd_siblings":
            hits = (st["sibling_hits"] * st["image_passes"]).sum()  # per image: hits per pass
            assert hits > 500, hits  # the alternatives are used
    else:
        if decoder == "broken":
            monkeypatch.setattr(ssd, "accept_or_resample", lambda t, p, q, g: (t, torch.ones_like(t, dtype=bool)))
        out, _ = ssd.generate(m, prompt_ids, noisy_drafter(m), cfg_scale=2.0, exact=True,
                              vertical=decoder != "ssd_exact_horizontal", rngs=rngs,
                              draft_temperature=0.0 if decoder == "ssd_exact_argmax_draft" else None)
    p_value = _gof_pvalue(out, joint)
    if decoder in ("broken", "ssd_typical"):
        assert p_value < 1e-6, p_value
    else:
        assert p_value > 1e-3, p_value


def test_greedy_decoders_equal_ar_on_the_shipped_backbone_and_images_hold_objects():
    """The trained backbone with the shipped drafters: greedy AR at CFG 2 draws objects (checked with the
    parser), and every verified strategy reproduces it token for token (SSD with rounds >= W or carry, exact SSD,
    SJD, 1D-MTP, draft-model decoding)."""
    from pathlib import Path

    from specgen.backbones.loading import load_shapes_generator
    from specgen.utils.checkpoints import load_exported
    from specgen.world.parse import parse

    ck = Path(__file__).resolve().parents[1] / "checkpoints"
    m = load_shapes_generator(ck / "ar_shapes", ck / "vq_shapes")
    prompts = ["a photo of a blue circle", "a photo of two triangles", "a drawing of a circle right of a triangle"]
    p = m.prompts(prompts)
    ref, _ = ar.generate(m, p, cfg_scale=2.0, temperature=0)
    images = (m.decode(ref).clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()
    assert all(len(parse(im)) >= 1 for im in images)
    fphi, heads, draft = (load_exported(ck / n) for n in ("fphi_shapes", "mtp_shapes", "ar_shapes_draft"))
    W = m.grid.width
    outs = {"ssd": ssd.generate(m, p, fphi, cfg_scale=2.0, temperature=0, rounds=W)[0],
            "ssd_carry": ssd.generate(m, p, fphi, cfg_scale=2.0, temperature=0, rounds=1, carry=True)[0],
            "ssd_exact": ssd.generate(m, p, fphi, cfg_scale=2.0, temperature=0, exact=True)[0],
            "sjd": sjd.generate(m, p, cfg_scale=2.0, temperature=0, window=16)[0],
            "mtp1d": mtp1d.generate(m, p, heads, cfg_scale=2.0, temperature=0)[0],
            "specdec": specdec.generate(m, p, draft, cfg_scale=2.0, temperature=0, window=4)[0]}
    for name, out in outs.items():
        assert torch.equal(out, ref), name


@pytest.mark.parametrize("eol", [True, False])
def test_token_id_drafter_plugs_into_ssd_and_stays_exact(eol):
    """The token-space ablation drafter goes through the same verification: greedy output equals AR."""
    from specgen.drafters.fphi import TokenDrafter

    m = tiny(eol)
    torch.manual_seed(5)
    drafter = TokenDrafter(m.hidden_size, m.grid.num_visual, preset="xs")
    p = m.prompts(PROMPTS)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for kw in (dict(rounds=m.grid.width), dict(exact=True)):
        out, st = ssd.generate(m, p, drafter, cfg_scale=3.0, temperature=0, **kw)
        assert torch.equal(out, ref) and st["draft_calls"] > 0


def test_bad_decoder_inputs_name_the_value():
    m = tiny(True)
    p = m.prompts(PROMPTS[:1])
    d = noisy_drafter(m)
    with pytest.raises(ValueError, match="rounds must be >= 0, got -1"):
        ssd.generate(m, p, d, rounds=-1)
    with pytest.raises(ValueError, match=r"cfg_scale must lie in \[0.0, None\], got -1"):
        ssd.generate(m, p, d, cfg_scale=-1.0)
    with pytest.raises(ValueError, match=r"cfg_scale must lie in \[0.0, None\], got -0.5"):
        ar.generate(m, p, cfg_scale=-0.5)
    wide = FPhi(2 * m.hidden_size, "xs")
    with pytest.raises(ValueError, match=rf"width {2 * m.hidden_size} but the backbone's are {m.hidden_size}"):
        ssd.generate(m, p, wide)
    d.backbone_id, m.identity = "aaaa", "bbbb-cccc"  # distilled from other weights (or another row layout)
    with pytest.raises(ValueError, match="distilled from backbone weights 'aaaa' but the backbone in use is 'bbbb'"):
        ssd.generate(m, p, d)
    with pytest.raises(ValueError, match="distilled from backbone weights 'aaaa'"):
        mtp1d.generate(m, p, type("H", (), {"hidden_size": m.hidden_size, "backbone_id": "aaaa", "num_heads": 2})())
    right_only = FPhi(m.hidden_size, "xs", directions=("right",))
    with pytest.raises(ValueError, match=r"drafts \['right', 'down'\] but the drafter predicts only \['right'\]"):
        ssd.generate(tiny(True), p, right_only)
    ssd.generate(tiny(True), p, right_only, vertical=False)  # horizontal-only needs no down predictor
    with pytest.raises(ValueError, match=f"window=9 does not fit the grid: a row has {m.grid.width} tokens"):
        zipar.generate(m, p, window=9)


def test_exported_drafter_carries_the_backbone_it_was_distilled_from(tmp_path):
    import json

    from specgen.utils.checkpoints import export, load_exported

    cfg = {"_target_": "specgen.drafters.fphi.FPhi", "hidden_size": 32, "preset": "xs"}
    export(tmp_path / "d", FPhi(32, "xs"), cfg, extra={"backbone_id": "1234abcd"})
    assert load_exported(tmp_path / "d").backbone_id == "1234abcd"
    assert json.loads((tmp_path / "d" / "extra.json").read_text())["backbone_id"] == "1234abcd"


def test_carry_images_progress_alone_in_a_batch():
    """Per-image rows: an image's tokens and its pass count are those it gets at batch 1 (greedy and sampled),
    the batch's passes are its slowest image's without a lead bound, and more with max_lead=0 (lockstep rows)."""
    m = tiny(True, grid=6)
    prompts = PROMPTS + ["a green diamond"]
    p = m.prompts(prompts)
    for temperature in (0.0, 1.0):
        kw = dict(cfg_scale=3.0, temperature=temperature, rounds=1, carry=True)
        out, st = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), max_lead=None, **kw)
        for i in range(4):
            one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), **kw)
            assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"] == st1["image_passes"][0]
        assert st["nfe"] == st["image_passes"].max()
        assert len(set(st["image_passes"].tolist())) > 1  # images do differ in the passes they need
        _, lock = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), max_lead=0, **kw)
        assert torch.equal(lock["image_passes"], st["image_passes"]) and lock["nfe"] >= st["nfe"]
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    assert torch.equal(ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, temperature=0, rounds=0, carry=True,
                                    max_lead=1)[0], ref)


def test_options_that_do_not_combine_raise():
    m = tiny(True)
    with pytest.raises(ValueError, match="carry=True and exact=True do not combine"):
        ssd.generate(m, m.prompts(PROMPTS[:1]), noisy_drafter(m), carry=True, exact=True)
    with pytest.raises(ValueError, match="max_lead"):
        ssd.generate(m, m.prompts(PROMPTS[:1]), noisy_drafter(m), carry=True, max_lead=-1)


def test_carry_rule_holds_every_window_option_of_generate_with_its_default():
    """The window's options travel as one `CarryRule`: each of its fields is an `ssd.generate` keyword whose value
    reaches the window unchanged (its default included), so an option cannot be dropped on the way."""
    import dataclasses
    import inspect

    from specgen.decoding.ssd_rule import CarryRule
    from specgen.decoding.ssd_window import CarryWindow

    params = inspect.signature(ssd.generate).parameters
    fields = {f.name for f in dataclasses.fields(CarryRule)}
    assert fields <= set(params)
    m = tiny(True, grid=6)
    seen = []
    init = CarryWindow.__init__

    def spy(self, st, rule, drafter=None):
        seen.append(rule)
        init(self, st, rule, drafter)

    values = dict(rounds=1, max_lead=3, max_window_rows=2, draft_temperature=0.5, redraft=2, redraft_rows=1,
                  max_row_passes=4, second_row_wait=1, acceptance="typical", typical_epsilon=0.2, typical_delta=0.5,
                  left_draft="above", siblings=2, max_fed=5, reweight=2, latent_k=8, latent_delta=0.2)
    assert set(values) == fields
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CarryWindow, "__init__", spy)
        ssd.generate(m, m.prompts(PROMPTS[:1]), noisy_drafter(m, left=True), cfg_scale=3.0, carry=True,
                     rngs=make_rngs([0]), **values)
        ssd.generate(m, m.prompts(PROMPTS[:1]), noisy_drafter(m), cfg_scale=3.0, carry=True,
                     rngs=make_rngs([0]))
        ssd.generate(m, m.prompts(PROMPTS[:2]), noisy_drafter(m, left=True), cfg_scale=3.0, carry=True, slots=1,
                     rngs=make_rngs([0, 1]), **values)
    assert seen[0] == CarryRule(**values)
    assert seen[1] == CarryRule(**{f: params[f].default for f in fields})
    assert seen[2:] and all(r == CarryRule(**dict(values, max_lead=None)) for r in seen[2:])  # a stream has no lead


def test_window_bound_keeps_greedy_equality_and_batch_invariance():
    """max_window_rows: no image has more rows than the bound not final when it drafts; outputs stay exact."""
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS + ["a green diamond"])
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for rows in (1, 2):
        out, st = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, temperature=0, rounds=0, carry=True,
                               max_window_rows=rows)
        assert torch.equal(out, ref)
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=1)
    out, st = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), **kw)
    for i in range(4):
        one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), **kw)
        assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"]
    with pytest.raises(ValueError, match="max_window_rows"):
        ssd.generate(m, p, noisy_drafter(m), carry=True, max_window_rows=0)


@pytest.mark.parametrize("left", [False, True])
def test_max_fed_bounds_each_pass_and_keeps_greedy_equality_batch_invariance_and_streams(monkeypatch, left):
    """max_fed=k: no pass feeds more than k slots after the prefill (one image: each image's own pass; a batch feeds
    the union of its images' ranges), greedy output = AR, a batch's images and pass counts are batch 1's, the stream
    decodes the same images, and the bound costs passes as it saves slots (k = 1 feeds what AR feeds)."""
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS + ["a green diamond"])
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=2, redraft=2, redraft_rows=1, second_row_wait=2)
    fed = _spy_fed(monkeypatch, m)
    passes = {}
    for k in (1, 3, 6, None):
        for siblings in (0, 2):
            out, _ = ssd.generate(m, p, noisy_drafter(m, left), temperature=0, max_fed=k, siblings=siblings, **kw)
            assert torch.equal(out, ref)
        fed.clear()
        out, st = ssd.generate(m, p[:1], noisy_drafter(m, left), rngs=make_rngs([0]), max_fed=k, **kw)
        if k is not None:  # the prefill first; a range ending at an end-of-row slot feeds it with the token before
            assert max(fed[1:]) <= k + 1 and sum(fed[1:]) == st["tokens_fed"][0]
        passes[k] = (st["nfe"], st["tokens_fed"][0].item())
        many, st4 = ssd.generate(m, p, noisy_drafter(m, left), rngs=make_rngs(range(4)), max_fed=k, **kw)
        stream, _ = ssd.generate(m, p, noisy_drafter(m, left), rngs=make_rngs(range(4)), slots=2, max_fed=k, **kw)
        assert torch.equal(stream, many) and torch.equal(many[0], out[0]) and st4["image_passes"][0] == st["nfe"]
        for i in (1, 3):
            one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m, left), rngs=make_rngs([i]), max_fed=k, **kw)
            assert torch.equal(many[i], one[0]) and st4["image_passes"][i] == st1["nfe"]
    off, st_off = ssd.generate(m, p[:1], noisy_drafter(m, left), rngs=make_rngs([0]), **kw)
    wide, st_wide = ssd.generate(m, p[:1], noisy_drafter(m, left), rngs=make_rngs([0]), max_fed=1000, **kw)
    assert torch.equal(wide, off)  # a cap past every window is no cap: the same passes, feeds and acceptance maps
    assert all(torch.equal(torch.as_tensor(st_wide[k]), torch.as_tensor(st_off[k]))
               for k in ("nfe", "tokens_fed", "accept_map", "image_passes"))
    H, W = m.grid.height, m.grid.width
    assert passes[1][1] == H * W - 1 + H - 1  # one slot a pass: every image token but the last, as AR
    assert passes[1][0] > passes[None][0] and passes[1][1] < passes[None][1]
    for bad, error in ((0, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match="max_fed"):
            ssd.generate(m, p, noisy_drafter(m), carry=True, max_fed=bad)
    with pytest.raises(ValueError, match="max_fed=4 .* needs carry=true"):
        ssd.generate(m, p, noisy_drafter(m), carry=False, max_fed=4)


def test_redraft_keeps_greedy_equality_batch_invariance_and_refuses_what_it_cannot_serve():
    """redraft=k: the tail after a change is drafted again by f_phi.right; every token is still verified (greedy
    output = AR), an image's draws are its own (batch = batch 1), and the re-drafts are counted as draft calls."""
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS + ["a green diamond"])
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for rounds in (0, 1):
        out, st = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, temperature=0, rounds=rounds, carry=True,
                               redraft=3)
        assert torch.equal(out, ref)
    kw = dict(cfg_scale=3.0, rounds=1, carry=True, max_window_rows=2, redraft=2)
    out, st = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), **kw)
    _, plain = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), **dict(kw, redraft=0))
    assert st["draft_calls"] > plain["draft_calls"]
    for i in range(4):
        one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), **kw)
        assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"]
    with pytest.raises(ValueError, match="redraft=2 .* needs carry=true"):
        ssd.generate(m, p, noisy_drafter(m), carry=False, redraft=2)


def test_redraft_rows_limits_the_redrafts_to_the_first_rows():
    """redraft_rows=1: only the first (horizontally drafted) row is re-drafted: greedy output = AR, batch = batch 1,
    fewer re-drafts than in every row and more than none; redraft_rows=H is every row; 0 is refused."""
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS + ["a green diamond"])
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    out, _ = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, temperature=0, rounds=0, carry=True, redraft=3,
                          redraft_rows=1)
    assert torch.equal(out, ref)
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, redraft=3)
    calls = {rows: ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), redraft_rows=rows, **kw)[1]
             for rows in (1, 6, None)}
    _, plain = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), **dict(kw, redraft=0))
    assert plain["draft_calls"] < calls[1]["draft_calls"] < calls[None]["draft_calls"] == calls[6]["draft_calls"]
    out, st = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), redraft_rows=1, **kw)
    for i in range(4):
        one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), redraft_rows=1, **kw)
        assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"]
    with pytest.raises(ValueError, match="redraft_rows"):
        ssd.generate(m, p, noisy_drafter(m), redraft_rows=0, **kw)


def test_sjd_samples_the_tokens_of_the_dense_reference_for_fixed_seeds(one_thread):
    """tests/fixtures/sjd_reference.pt was written by make_sjd_reference.py with SJD keeping dense (B, N, V) target
    distributions; SJD now keeps them for the Jacobi window only and must sample the same tokens with the same passes
    and acceptances on the shipped backbone."""
    import sys
    from pathlib import Path

    fixtures = Path(__file__).resolve().parent / "fixtures"
    sys.path.insert(0, str(fixtures))
    try:
        from make_sjd_reference import CASES, backbone, run_case
    finally:
        sys.path.remove(str(fixtures))
    ref = torch.load(fixtures / "sjd_reference.pt", weights_only=True)
    m = backbone()
    for name, options in CASES:
        codes, nfe, accepted = run_case(m, options)
        assert torch.equal(codes, ref[name]["codes"]), name
        assert nfe == int(ref[name]["nfe"]) and torch.equal(accepted, ref[name]["accepted_drafts"]), name


def test_continuous_batching_keeps_every_image_and_counts_passes_exactly():
    """slots=S (continuous batching): greedy output equals AR's; every image's tokens and passes are its batch-1
    ones (greedy and sampled); one slot spends exactly the sum of the images' batch-1 passes, slots for every
    prompt exactly the slowest image's, and fewer slots than prompts something in between."""
    m = tiny(True, grid=6)
    prompts = PROMPTS + ["a green diamond", "two red circles", "a cross"]
    p = m.prompts(prompts)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for slots in (1, 2, 6):
        out, st = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, temperature=0, rounds=0, carry=True, slots=slots)
        assert torch.equal(out, ref)
    kw = dict(cfg_scale=3.0, temperature=1.0, rounds=1, carry=True)
    alone = [ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), **kw) for i in range(6)]
    runs = {s: ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), slots=s, **kw) for s in (1, 3, 6)}
    for s, (out, st) in runs.items():
        for i, (one, st1) in enumerate(alone):
            assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"]
    passes = [st1["nfe"] for _, st1 in alone]
    assert len(set(passes)) > 1
    assert runs[1][1]["nfe"] == sum(passes) and runs[6][1]["nfe"] == max(passes)
    assert runs[6][1]["nfe"] <= runs[3][1]["nfe"] < sum(passes)
    assert runs[3][1]["nfe"] >= sum(passes) / 3  # no pass serves more than its 3 slots
    assert 0 < runs[3][1]["slot_occupancy"] <= 1


def test_row_pass_cap_keeps_rows_after_their_budget_and_counts_what_it_leaves_unchecked():
    """max_row_passes=k: no row is judged more than k times, so an image spends at most H x k passes after its
    prefill; the tokens kept without a check against their final left context are counted (some at k = 1 with a
    noisy drafter) and enter the finalised-per-pass accounting like every other token; a cap no row reaches
    changes nothing (tokens, passes, zero unchecked); every image keeps its batch-1 tokens and passes in a fixed
    batch and in continuous batching."""
    m = tiny(True, grid=6)
    prompts = PROMPTS + ["a green diamond", "two red circles", "a cross"]
    p, H, n = m.prompts(prompts), m.grid.height, m.grid.num_visual_tokens
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=2)
    free, stf = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), **kw)
    same, sts = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), max_row_passes=10 * n, **kw)
    assert torch.equal(same, free) and torch.equal(sts["image_passes"], stf["image_passes"])
    assert (stf["unchecked_tokens"] == 0).all() and (sts["unchecked_tokens"] == 0).all()
    for cap in (1, 2):
        out, st = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), max_row_passes=cap, **kw)
        assert (st["image_passes"] - 1 <= H * cap).all()
        assert torch.allclose(st["final_per_pass"] * (st["image_passes"] - 1), torch.full((6,), float(n)))
        assert ((st["unchecked_tokens"] >= 0) & (st["unchecked_tokens"] <= n)).all()
        if cap == 1:
            assert st["unchecked_tokens"].sum() > 0 and st["image_passes"].sum() < stf["image_passes"].sum()
        for slots in (None, 3):
            batch, stb = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), max_row_passes=cap,
                                      slots=slots, **kw)
            for i in range(6):
                one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), max_row_passes=cap, **kw)
                assert torch.equal(batch[i], one[0]) and stb["image_passes"][i] == st1["nfe"]
                assert stb["unchecked_tokens"][i] == st1["unchecked_tokens"][0]
    with pytest.raises(ValueError, match="max_row_passes=2 .* needs carry=true"):
        ssd.generate(m, p, noisy_drafter(m), carry=False, max_row_passes=2)
    with pytest.raises(ValueError, match="max_row_passes"):
        ssd.generate(m, p, noisy_drafter(m), carry=True, max_row_passes=0)


def test_continuous_batching_refuses_what_it_cannot_serve():
    m = tiny(True)
    p = m.prompts(PROMPTS)
    with pytest.raises(ValueError, match="needs carry=true"):
        ssd.generate(m, p, noisy_drafter(m), carry=False, slots=2)
    with pytest.raises(ValueError, match="slots"):
        ssd.generate(m, p, noisy_drafter(m), carry=True, slots=0)

    class NoRagged:  # a backbone without per-row cache lengths (the protocol's minimum)
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name == "new_ragged_cache":
                raise AttributeError(name)
            return getattr(self.inner, name)

    with pytest.raises(ValueError, match="new_ragged_cache"):
        ssd.generate(NoRagged(m), p, noisy_drafter(m), carry=True, slots=2)


def test_row_final_pass_records_when_each_row_is_done():
    """row_final_pass: non-decreasing along the rows; with carry its last entry is the image's passes; the paper's
    rule spends at most rounds + 1 passes per row (the first after the prefill)."""
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS)
    _, st = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rngs=make_rngs(range(3)), rounds=0, carry=True)
    rf = st["row_final_pass"]
    assert rf.shape == (3, 6) and bool((rf[:, 1:] >= rf[:, :-1]).all()) and bool((rf > 1).all())
    assert torch.equal(rf[:, -1].float(), st["image_passes"])
    _, st = ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rngs=make_rngs(range(3)), rounds=2)
    steps = torch.diff(torch.cat([torch.ones(3, 1, dtype=torch.long), st["row_final_pass"]], 1), dim=1)
    assert bool((steps >= 1).all()) and bool((steps <= 3).all()) and int(st["row_final_pass"][0, -1]) == st["nfe"]


def test_row_passes_analysis_summarises_and_writes(tmp_path, tiny_exports):
    import json

    import numpy as np

    from specgen.analysis import row_passes

    s = row_passes.summarise(np.array([[3.0, 5, 7, 9], [5.0, 7, 9, 11]]), width=4, rounds=2)
    assert s["passes"] == [4, 6, 8, 10] and s["passes_per_row"] == pytest.approx(2.0)
    assert s["ratio"] == pytest.approx([4 / 4, 8 / 6, 12 / 8, 16 / 10]) and s["rounds_plus_one"] == 3
    out = row_passes.main(["--backbone", str(tiny_exports / "ar"), "--tokenizer", str(tiny_exports / "vq"),
                           "--drafter", str(tiny_exports / "fphi"), "--prompts", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "row_passes.json").read_text())
    assert set(saved) == set(out) == set(row_passes.config_strategies())
    assert (tmp_path / "row_passes.png").stat().st_size > 0
    assert all(len(r["passes"]) == 16 and r["images"] == 2 for r in saved.values())
    cascades = saved["ssd"]["cascades"]  # carry: the window's cascades; the paper's rule has no window
    assert "cascades" not in saved["ssd_paper"]
    assert len(cascades["carried_rate_by_distance"]) == 32 and 0 <= cascades["single_token_passes"] <= 1
    # two images, each token judged fresh at least once (the default re-drafts the first row's tokens after a change)
    assert sum(cascades["fresh_judged_by_distance"]) >= 2 * 256
    assert row_passes.parse_variant("dt=rounds:0,carry:true,draft_temperature:0.5,max_window_rows:null") == \
        ("dt", {"rounds": 0, "carry": True, "draft_temperature": 0.5, "max_window_rows": None})
    with pytest.raises(ValueError, match="NAME=key:value"):
        row_passes.parse_variant("rounds:0")
    out = row_passes.main(["--backbone", str(tiny_exports / "ar"), "--tokenizer", str(tiny_exports / "vq"),
                           "--drafter", str(tiny_exports / "fphi"), "--prompts", "2", "--out", str(tmp_path),
                           "--variant", "a=rounds:0,carry:true", "--variant", "b=rounds:0,carry:true,redraft:2",
                           "--variant", f"c=rounds:0,carry:true,drafter:{tiny_exports / 'fphi'}"])
    assert list(out) == ["a", "b", "c"]
    # c is a with the same drafter given as a variant's: the same images, so a paired difference of exactly zero
    assert out["c"]["image_passes"] == out["a"]["image_passes"] and len(out["a"]["image_passes"]) == 2
    assert out["c"]["paired_vs"] == "a" and out["c"]["paired_diff"] == 0 and out["c"]["paired_diff_ci95"] == 0
    diff = np.array(out["b"]["image_passes"]) - np.array(out["a"]["image_passes"])
    assert out["b"]["paired_diff"] == pytest.approx(diff.mean()) and "paired_diff" not in out["a"]


def test_grid_scaling_table_across_world_sizes(tmp_path, tiny_exports):
    import json

    from specgen.analysis import grid_scaling
    from specgen.utils.checkpoints import build as instantiate, export

    assert grid_scaling.loglog_slope([16, 32], [4.0, 8.0]) == pytest.approx(1.0)
    assert grid_scaling.loglog_slope([16, 32], [5.0, 5.0]) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="NAME=<backbone folder>"):
        grid_scaling.parse_world("16=a,b")
    # a second, smaller world: 32 px through a factor-4 tokenizer = an 8x8 grid
    torch.manual_seed(1)
    vq_cfg = {"_target_": "specgen.tokenizers.vq.VQAutoencoder", "image_size": 32, "ch": 16, "mults": [2, 2],
              "z_dim": 8, "num_codes": 64}
    ar_cfg = {"_target_": "specgen.backbones.shapes_llama.ShapesLlama", "num_codes": 64, "grid_size": 8,
              "preset": "tiny"}
    export(tmp_path / "vq8", instantiate(vq_cfg), vq_cfg)
    export(tmp_path / "ar8", instantiate(ar_cfg), ar_cfg)
    small = f"8={tmp_path / 'ar8'},{tmp_path / 'vq8'},{tiny_exports / 'fphi'}"
    big = f"16={tiny_exports / 'ar'},{tiny_exports / 'vq'},{tiny_exports / 'fphi'}"
    out = grid_scaling.main(["--world", big, "--world", small, "--prompts", "2", "--out", str(tmp_path / "gs")])
    saved = json.loads((tmp_path / "gs" / "grid_scaling.json").read_text())
    assert saved["table"] == json.loads(json.dumps(out["table"]))
    for name, t in out["table"].items():
        assert t["sides"] == [8, 16] and t["worlds"] == ["8", "16"]  # sorted by side, whatever the order given
        rounds_plus_one = out["worlds"]["8"]["strategies"][name]["rounds_plus_one"]
        if name == "ssd_paper":  # the paper's rule: at most r + 1 passes a row, so n / (r + 1)
            assert t["row_bound"] == pytest.approx([8 / rounds_plus_one, 16 / rounds_plus_one])
        else:  # carry has no bound on a row's passes
            assert t["row_bound"] == [None, None]
        assert out["worlds"]["8"]["strategies"][name]["unchecked"] >= 0
        for w, side, ratio in zip(t["worlds"], t["sides"], t["ratios"]):
            passes = out["worlds"][w]["strategies"][name]["passes"]
            assert len(passes) == side and ratio == pytest.approx(side * side / passes[-1])
        assert t["loglog_slope"] == pytest.approx(grid_scaling.loglog_slope(t["sides"], t["ratios"]))
    assert set(out["table"]) == {"ssd", "ssd_paper"}
    fake = {"8": {"side": 8, "strategies": {"e": {"ratio": [2.0], "rounds_plus_one": 1, "passes_per_row": 3.0}}},
            "16": {"side": 16, "strategies": {"e": {"ratio": [3.0], "rounds_plus_one": 1, "passes_per_row": 4.0}}}}
    assert grid_scaling.scaling_table(fake, {"e": {"exact": True, "carry": False}})["e"]["row_bound"] == [None, None]
    capped = {"e": {"carry": True, "max_row_passes": 4}}  # carry with a per-row cap: n / max_row_passes
    assert grid_scaling.scaling_table(fake, capped)["e"]["row_bound"] == pytest.approx([2.0, 4.0])
    assert (tmp_path / "gs" / "grid_scaling.png").stat().st_size > 0
    assert (tmp_path / "gs" / "row_passes_8.png").is_file()


def _spy_fed(monkeypatch, m):
    """Record the positions each target forward feeds after the prefill (one entry per call)."""
    fed, orig = [], m.forward_embeds

    def spy(embeds, slots, cache, attn_mask=None):
        fed.append(embeds.shape[1])
        return orig(embeds, slots, cache, attn_mask)
    monkeypatch.setattr(m, "forward_embeds", spy)
    return fed


@pytest.mark.parametrize("decode", ["ar", "ssd_carry", "ssd_paper", "sjd", "zipar"])
def test_tokens_fed_counts_the_positions_every_pass_feeds(monkeypatch, decode):
    """stats["tokens_fed"]: per image, the positions fed to the target after the prefill, as the forwards saw them
    (AR: every visual token but the last, and the end-of-row tokens but the last); a speculative decoder feeds at
    least as many."""
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS)
    fed = _spy_fed(monkeypatch, m)
    run = {"ar": lambda: ar.generate(m, p, cfg_scale=3.0, rngs=make_rngs(range(3))),
           "ssd_carry": lambda: ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rngs=make_rngs(range(3)), rounds=0,
                                             carry=True, max_window_rows=2),
           "ssd_paper": lambda: ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rngs=make_rngs(range(3)), rounds=2),
           "sjd": lambda: sjd.generate(m, p, cfg_scale=3.0, rngs=make_rngs(range(3))),
           "zipar": lambda: zipar.generate(m, p, cfg_scale=3.0, rngs=make_rngs(range(3)), window=2)}[decode]
    _, st = run()
    H, W = m.grid.height, m.grid.width
    assert torch.equal(st["tokens_fed"], torch.full((3,), float(sum(fed[1:]))))
    assert st["tokens_fed"][0] >= H * W - 1 + H - 1
    if decode == "ar":
        assert st["tokens_fed"][0] == H * W - 1 + H - 1


def test_continuous_batching_reports_each_images_own_tokens_fed():
    m = tiny(True, grid=6)
    prompts = PROMPTS + ["a green diamond"]
    p = m.prompts(prompts)
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=2)
    _, st = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), slots=2, **kw)
    for i in range(4):
        _, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), **kw)
        assert st["tokens_fed"][i] == st1["tokens_fed"][0]



def test_ssd_cost_split_sees_every_forward_and_fits_the_pass_cost(tmp_path, tiny_exports, monkeypatch):
    """analysis.ssd_costs: the clock sees every target forward (one per pass, each decode's prefill flagged), the
    draft clock runs for SSD only, passes and positions fed are the decoders' own counts (AR's: every image token but
    the last, and the end-of-row tokens but the last), and the fit leaves the prefills out and recovers a known
    linear cost."""
    import json

    from specgen.analysis import ssd_costs

    line = lambda q: 0.002 + 0.0005 * q  # noqa: E731
    fake = {"ar": {"forwards": [(40, 2, 1.0, True)] + [(q, 2, line(q), False) for q in (1, 2, 1, 2)]},
            "ssd": {"forwards": [(40, 2, 1.0, True)] + [(q, 2, line(q), False) for q in (10, 20, 40)]}}
    a, b = ssd_costs.fit_pass_cost(fake)  # the prompt's forwards are left out of the fit
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0005)
    measured, report = {}, ssd_costs.report
    monkeypatch.setattr(ssd_costs, "report", lambda result, ratio: measured.update(result) or report(result, ratio))
    out = ssd_costs.main(["--backbone", str(tiny_exports / "ar"), "--tokenizer", str(tiny_exports / "vq"),
                          "--drafter", str(tiny_exports / "fphi"), "--prompts", "2", "--out", str(tmp_path),
                          "--strategy", "ssd", "--strategy", "ssd_paper", "--variant", "carry1=rounds:1,carry:true"])
    saved = json.loads((tmp_path / "ssd_costs.json").read_text())
    assert list(saved["strategies"]) == ["ar", "ssd", "ssd_paper", "carry1"]
    for name, r in out["strategies"].items():
        forwards = measured[name]["forwards"]
        assert len(forwards) == round(r["passes"] * 2) and sum(f[3] for f in forwards) == 2  # 2 images, 2 prefills
        assert sum(f[0] for f in forwards if not f[3]) == round(r["tokens_fed"] * 2)
        assert r["target_s"] > 0 and r["other_s"] > 0 and (r["draft_s"] > 0) == (name != "ar")
        assert r["tokens_fed"] >= 16 * 16 - 1 + 15
    assert out["strategies"]["ar"]["passes"] == 256 and out["strategies"]["ar"]["tokens_fed"] == 16 * 16 - 1 + 15
    assert out["strategies"]["ar"]["wall_ratio"] == 1.0 and out["pass_cost"]["per_position_s"] > 0
    ar_wall = out["strategies"]["ar"]["wall_s"]
    for r in out["strategies"].values():  # the passes 3.5x allows at the strategy's own cost per pass, by hand
        assert r["passes_allowed"] == pytest.approx(ar_wall / 3.5 * r["passes"] / r["wall_s"])
        assert r["passes_allowed_free"] == pytest.approx(ar_wall / 3.5 * r["passes"] / r["model_target_s"])
        assert r["passes_allowed"] * r["wall_s"] / r["passes"] == pytest.approx(ar_wall / 3.5)
    ops = saved["ops"]  # one image per strategy: AR drafts nothing, SSD does; every pass is in a target forward
    assert list(ops) == ["ar", "ssd", "ssd_paper", "carry1"] and ops["ar"]["draft"] == 0 and ops["ar"]["passes"] == 256
    assert saved["dtype"] == "float32" and saved["threads"] == torch.get_num_threads()
    for name, o in ops.items():
        assert o["total"] == o["target"] + o["draft"] + o["other"] and o["target"] >= 3 * o["passes"]
        assert (o["draft"] > 0) == (name != "ar") and o["other"] > 0
    assert ssd_costs.ssd._draft_down.__name__ == "_draft_down"  # the counting wrappers are gone
    with ssd_costs._OpCounter(["x"]) as counter:
        torch.ones(3).add(1).mul(2)
    assert counter.counts["x"] == 3  # ones, add, mul


def test_second_row_wait_drafts_row_one_only_once_row_zero_has_settled(monkeypatch):
    """second_row_wait=m: when the second row is drafted, at most m of the first row's tokens are not final (without
    the wait, some images draft it earlier with a noisy drafter); greedy output stays AR's; each image keeps its
    batch-1 tokens and passes in a fixed batch and in continuous batching; refused without carry or below 0."""
    from specgen.decoding.ssd_window import CarryWindow

    m = tiny(True, grid=6)
    prompts = PROMPTS + ["a green diamond", "two red circles", "a cross"]
    p, g = m.prompts(prompts), m.grid.at(m.prompts(prompts[:1]).rows(True).length)
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=2)
    seen, add = [], CarryWindow.add

    def spy(self, images, rows, q):
        unsettled = [max(g.position(0, g.width - 1) + 1 - self.final_upto[b], 0) for b in images]
        seen.extend(u for u, r in zip(unsettled, rows) if r == 1)
        return add(self, images, rows, q)
    monkeypatch.setattr(CarryWindow, "add", spy)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), **kw)
    assert len(seen) == 6 and max(seen) > 1  # without the wait, row 1 comes while row 0 is unsettled
    for wait in (0, 1):
        seen.clear()
        out, _ = ssd.generate(m, p, noisy_drafter(m), temperature=0, second_row_wait=wait, **kw)
        assert torch.equal(out, ref)
        seen.clear()
        ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), second_row_wait=wait, **kw)
        assert len(seen) == 6 and max(seen) <= wait
        for slots in (None, 3):
            batch, stb = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), second_row_wait=wait,
                                      slots=slots, **kw)
            for i in range(6):
                one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), second_row_wait=wait,
                                        **kw)
                assert torch.equal(batch[i], one[0]) and stb["image_passes"][i] == st1["nfe"]
    with pytest.raises(ValueError, match="second_row_wait=2 .* needs carry=true"):
        ssd.generate(m, p, noisy_drafter(m), carry=False, second_row_wait=2)
    with pytest.raises(ValueError, match="second_row_wait"):
        ssd.generate(m, p, noisy_drafter(m), carry=True, second_row_wait=-1)



def test_typical_acceptance_against_a_hand_computation():
    """typical_accept keeps t when p(t) > min(epsilon, delta * exp(-H(p))) and redraws a refused token from p."""
    from specgen.decoding.sampling import typical_accept

    p = torch.tensor([[0.90, 0.08, 0.02],   # H = 0.375, delta e^-H = 0.206: threshold epsilon = 0.09
                      [0.40, 0.35, 0.25],   # H = 1.081, delta e^-H = 0.102: threshold 0.09
                      [0.34, 0.33, 0.33]])  # H = 1.099, delta e^-H = 0.100 -> with delta 0.3, eps 0.2: 0.100
    tokens = torch.tensor([[1, 2, 2], [0, 2, 1]])  # rows: (token, p(token)) pairs judged below
    pp = p[None].expand(2, 3, 3)
    out, ok = typical_accept(tokens, pp, epsilon=0.09, delta=0.3)
    # p(t): [0.08, 0.25, 0.33] and [0.90, 0.25, 0.33] against thresholds [0.09, 0.09, 0.09]
    assert ok.tolist() == [[False, True, True], [True, True, True]]
    out, ok = typical_accept(tokens, pp, epsilon=0.5, delta=0.3)  # thresholds [0.206, 0.102, 0.100]
    assert ok.tolist() == [[False, True, True], [True, True, True]]
    out, ok = typical_accept(tokens, pp, epsilon=0.5, delta=0.9)  # thresholds [0.5, 0.305, 0.300]
    assert ok.tolist() == [[False, False, True], [True, False, True]]
    # a refused token is redrawn from p (itself included): frequencies of 20,000 redraws
    n = 20000
    t = torch.ones(1, n, dtype=torch.long)
    out, ok = typical_accept(t, p[0].expand(1, n, 3), epsilon=0.09, delta=0.3, rngs=make_rngs([5]))
    assert not ok.any()
    freq = torch.bincount(out[0], minlength=3).float() / n
    assert torch.allclose(freq, p[0], atol=0.01), freq
    # greedy (p one-hot): only the argmax is kept
    onehot = torch.nn.functional.one_hot(torch.tensor([[0, 2]]), 3).float()
    out, ok = typical_accept(torch.tensor([[0, 1]]), onehot, epsilon=0.09, delta=0.3)
    assert ok.tolist() == [[True, False]] and out.tolist() == [[0, 2]]


def test_typical_acceptance_in_the_carry_window():
    """acceptance='typical' with a zero threshold keeps every draft: each row costs exactly one pass (prefill + H);
    the exact rule with the same noisy drafter spends more; images stay batch-invariant; bad settings are named."""
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS + ["a green diamond"])
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=2)
    out, st = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), acceptance="typical",
                           typical_epsilon=0.0, typical_delta=0.0, **kw)
    assert st["image_passes"].tolist() == [1.0 + m.grid.height] * 4
    assert float(st["carried_change_rate"].max()) == 0.0 and float(st["fresh_change_rate"].max()) == 0.0
    _, exact = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), **kw)
    _, typ = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), acceptance="typical", **kw)
    assert float(exact["image_passes"].mean()) > float(typ["image_passes"].mean()) >= 1 + m.grid.height
    out, st = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), acceptance="typical_carried", **kw)
    for i in range(4):
        one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), acceptance="typical_carried",
                                **kw)
        assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"]
    with pytest.raises(ValueError, match="acceptance='typical' .* needs carry=true"):
        ssd.generate(m, p, noisy_drafter(m), carry=False, acceptance="typical")
    with pytest.raises(ValueError, match="acceptance='medusa' is not a verification rule"):
        ssd.generate(m, p, noisy_drafter(m), carry=True, acceptance="medusa")
    with pytest.raises(ValueError, match="typical_epsilon"):
        ssd.generate(m, p, noisy_drafter(m), carry=True, acceptance="typical", typical_epsilon=-0.1)


@pytest.mark.slow
def test_carry_window_samples_the_models_distribution_on_a_3x3_grid():
    """The default's carry settings on a 3x3 grid of 2 codes (512 images, longer carry chains than 2x2): chi-square
    of 20,000 samples against the exact joint, without and with the reweighted tokens after a change; typical
    acceptance of carried tokens on the same draws is rejected."""
    n = 20000
    m = tiny(True, codes=2, grid=3, sharpen=3.0)
    joint = _exact_joint(m, PROMPTS[0], cfg_scale=2.0)
    kw = dict(rounds=0, carry=True, max_window_rows=2, draft_temperature=0.5, redraft=4, redraft_rows=1,
              second_row_wait=2)
    prompts = m.prompts([PROMPTS[0]] * n)
    out, _ = ssd.generate(m, prompts, noisy_drafter(m), cfg_scale=2.0, rngs=make_rngs(range(n)), **kw)
    assert _gof_pvalue(out, joint) > 1e-3
    out, _ = ssd.generate(m, prompts, noisy_drafter(m), cfg_scale=2.0, rngs=make_rngs(range(n)),
                          acceptance="typical_carried", **kw)
    assert _gof_pvalue(out, joint) < 1e-6
    # the reweighted tokens after a change (the default's `reweight` 2) with a left-context drafter
    out, st = ssd.generate(m, prompts, noisy_drafter(m, left=True), cfg_scale=2.0, rngs=make_rngs(range(n)),
                           reweight=2, **kw)
    assert _gof_pvalue(out, joint) > 1e-3


def test_left_draft_above_drafts_a_down_row_in_one_call_from_the_tokens_above_the_left_neighbours():
    """left_draft="above": one drafter call per down row (W with "sequential_loop", between 1 and W with
    "sequential", whose fixed point gives the loop's drafts: the same decode), each column's left input the token
    above its left neighbour (column 0: the token before the row, known); a bad value is named."""
    m = tiny(True)
    p = m.prompts(PROMPTS[:1])
    d = noisy_drafter(m, left=True)
    g = m.grid
    loop_codes, loop = ssd.generate(m, p, d, rounds=0, carry=True, rngs=make_rngs([0]), left_draft="sequential_loop")
    seq_codes, seq = ssd.generate(m, p, d, rounds=0, carry=True, rngs=make_rngs([0]))
    _, one = ssd.generate(m, p, d, rounds=0, carry=True, rngs=make_rngs([0]), left_draft="above")
    right_calls = g.width - 1  # the first row's chain of right steps
    assert loop["draft_calls"] == right_calls + (g.height - 1) * g.width
    assert right_calls + g.height - 1 <= seq["draft_calls"] < loop["draft_calls"]
    assert torch.equal(seq_codes, loop_codes) and seq["nfe"] == loop["nfe"]
    assert one["draft_calls"] == right_calls + g.height - 1
    seen = []
    step = d.down_step

    def spy(trunk, hidden, left):  # left: the left neighbours' features, left_in of their embeddings
        seen.append(left)
        return step(trunk, hidden, left)

    d.down_step = spy
    codes, _ = ssd.generate(m, p, d, rounds=0, carry=True, rngs=make_rngs([0]), left_draft="above", cfg_scale=1.0,
                            max_window_rows=1)  # a row is drafted once the rows above are final: the codes above
    del d.down_step
    assert len(seen) == g.height - 1 and seen[0].shape[:2] == (1, g.width)
    from specgen.backbones.protocol import embed_image
    for r, left in enumerate(seen, start=1):  # row r's left inputs: [token before the row, x_{r-1, 0..W-2}]
        before = g.eol_token if g.eol_id is not None else codes[0, r - 1, -1]
        want = d.left_in(embed_image(m, torch.cat([torch.tensor([before]), codes[0, r - 1, :-1]])[None]))
        assert torch.allclose(left, want, atol=1e-6)
    with pytest.raises(ValueError, match="left_draft='diagonal' is not a way"):
        ssd.generate(m, p, d, carry=True, left_draft="diagonal")
    plain = noisy_drafter(m)  # no left context: a row is one call either way, and the option changes nothing
    a, sa = ssd.generate(m, p, plain, rounds=0, carry=True, rngs=make_rngs([0]), left_draft="above")
    b, sb = ssd.generate(m, p, plain, rounds=0, carry=True, rngs=make_rngs([0]))
    assert torch.equal(a, b) and sa["nfe"] == sb["nfe"] and sa["draft_calls"] == sb["draft_calls"]


def test_left_draft_refine_drafts_a_down_row_twice_the_second_time_from_the_first_calls_drafts():
    """left_draft="refine": two drafter calls per down row; the second call's left inputs are [the token before the
    row, the first call's most likely drafts of columns 0..W-2]; the drafts are drawn from the second call's q."""
    m = tiny(True)
    p = m.prompts(PROMPTS[:1])
    d = noisy_drafter(m, left=True)
    g = m.grid
    _, st = ssd.generate(m, p, d, rounds=0, carry=True, rngs=make_rngs([0]), left_draft="refine")
    assert st["draft_calls"] == g.width - 1 + 2 * (g.height - 1)
    seen = []
    step = d.down_step

    def spy(trunk, hidden, left):  # left: the left neighbours' features, left_in of their embeddings
        out = step(trunk, hidden, left)
        seen.append((left, out))
        return out

    d.down_step = spy
    ssd.generate(m, p, d, rounds=0, carry=True, rngs=make_rngs([0]), left_draft="refine", cfg_scale=1.0,
                 max_window_rows=1)
    del d.down_step
    assert len(seen) == 2 * (g.height - 1)
    from specgen.backbones.protocol import embed_image
    for (left1, out1), (left2, _) in zip(seen[::2], seen[1::2]):
        first = m.visual_logits(out1).argmax(-1)  # (1, W): the first call's most likely drafts (greedy q at T=0.5)
        want = torch.cat([left1[:, :1], d.left_in(embed_image(m, first[:, :-1]))], 1)
        assert torch.allclose(left2, want, atol=1e-6)


def test_siblings_judge_the_token_after_a_change_in_the_same_pass_and_keep_every_image_its_own():
    """siblings=k: the alternatives fed with a pass get the states of the sequence with the alternative in place
    (fixed batch: `SpecState.target_pass`; the stream: `RaggedCache` rows), so greedy output stays AR's; sampled
    images hit (a first change draws a fed alternative) and each image keeps its batch-1 tokens and passes in a
    fixed batch and in continuous batching; with no hit the tokens and passes are those without siblings."""
    m = tiny(True, codes=8, grid=6, sharpen=3.0)  # a spread p: changes often draw the proposal's runner-up
    prompts = PROMPTS + ["a green diamond", "two red circles", "a cross"]
    p = m.prompts(prompts)
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=2, siblings=3)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for slots in (None, 2):
        out, _ = ssd.generate(m, p, noisy_drafter(m), temperature=0, slots=slots, **kw)
        assert torch.equal(out, ref)
    alone = [ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), **kw) for i in range(6)]
    assert sum(float(st1["sibling_hits"][0]) for _, st1 in alone) > 0
    for slots in (None, 3):
        batch, stb = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), slots=slots, **kw)
        for i, (one, st1) in enumerate(alone):
            assert torch.equal(batch[i], one[0]) and stb["image_passes"][i] == st1["nfe"]
    off = dict(kw, siblings=0)
    monkey = ssd.CarryWindow._sibling
    try:  # alternatives fed but never used: nothing changes
        ssd.CarryWindow._sibling = lambda self, *a: 0
        fed, stf = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), **kw)
    finally:
        ssd.CarryWindow._sibling = monkey
    plain, stp = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(6)), **off)
    assert torch.equal(fed, plain) and torch.equal(stf["image_passes"], stp["image_passes"])
    with pytest.raises(ValueError, match="siblings=2 .* needs carry=true"):
        ssd.generate(m, p, noisy_drafter(m), carry=False, siblings=2)
    with pytest.raises(ValueError, match="siblings"):
        ssd.generate(m, p, noisy_drafter(m), carry=True, siblings=-1)


def test_sibling_states_are_the_states_of_the_sequence_with_the_alternative_in_place():
    """SpecState.target_pass(end, siblings): each alternative's state is the state a forward of the sequence with
    that alternative at its slot gives there; the pass's own states and cache are those of a pass without them."""
    from specgen.decoding.state import SpecState

    m = tiny(True, grid=5)
    p = m.prompts(PROMPTS[:2])
    states = []
    for alt in (None, True):
        st = SpecState(m, p, 3.0, 1.0, None, None)
        st.target_pass(st.g.prefix_len)
        g = st.g
        cols = g.position(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 2]))
        codes = torch.tensor([[1, 2, 3], [4, 5, 6]])
        st.set_tokens(cols, codes)
        end = int(cols[-1]) + 1
        sib = (cols[None, :2].expand(2, -1).clone(), torch.tensor([[7, 8], [9, 10]])) if alt else None
        out = st.target_pass(end, sib)
        states.append((st.hid[:, torch.arange(g.prefix_len, end)].clone(), out, st.cached, st.cache.get_seq_length()))
    (h0, none, c0, n0), (h1, sib_states, c1, n1) = states
    assert none is None and c0 == c1 == n0 == n1
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    for b, alts in enumerate(([7, 8], [9, 10])):
        for j, a in enumerate(alts):
            st = SpecState(m, p, 3.0, 1.0, None, None)
            st.target_pass(st.g.prefix_len)
            codes = torch.tensor([[1, 2, 3], [4, 5, 6]])
            codes[b, j] = a
            st.set_tokens(cols, codes)
            st.target_pass(int(cols[j]) + 1)
            rows = torch.tensor([b, b + 2])
            torch.testing.assert_close(sib_states[rows, j], st.hid[rows, int(cols[j])], rtol=1e-5, atol=1e-5)


def test_oracle_drafter_under_greedy_takes_one_pass_a_row_and_equals_ar(tmp_path, tiny_exports):
    """The target as its own drafter (analysis.oracle_passes): under greedy decoding every draft is the target's
    argmax given a final context, so each row is accepted in its first pass (prefill + H passes) and the image is
    greedy AR's; with f_phi's first row, the rows below cost one pass each once the first row is final."""
    import json

    from specgen.analysis import oracle_passes
    from specgen.backbones.loading import load_shapes_generator
    from specgen.utils.checkpoints import load_exported

    m = load_shapes_generator(str(tiny_exports / "ar"), str(tiny_exports / "vq"))
    fphi = load_exported(str(tiny_exports / "fphi")).eval()
    p = m.prompts(PROMPTS[:1])
    kw = {**oracle_passes.strategies()["ssd"][0], "temperature": 0, "draft_temperature": None}
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    with oracle_passes.oracle_drafts("all"):
        out, st = ssd.generate(m, p, fphi, cfg_scale=3.0, **{**kw, "redraft": 0})
    assert torch.equal(out, ref) and st["nfe"] == 1 + m.grid.height
    assert st["row_final_pass"][0].tolist() == list(range(2, m.grid.height + 2))
    with oracle_passes.oracle_drafts("down"):
        out, st = ssd.generate(m, p, fphi, cfg_scale=3.0, **kw)
    first = int(st["row_final_pass"][0, 0])
    assert torch.equal(out, ref) and st["nfe"] == first + m.grid.height - 1 and first > 2  # f_phi's row: >1 pass
    assert ssd._draft_down.__name__ == "_draft_down"  # the block restored the decoder's drafters
    with pytest.raises(ValueError, match="rows='up'"):
        with oracle_passes.oracle_drafts("up"):
            pass
    res = oracle_passes.main(["--backbone", str(tiny_exports / "ar"), "--tokenizer", str(tiny_exports / "vq"),
                              "--drafter", str(tiny_exports / "fphi"), "--prompts", "2", "--out", str(tmp_path),
                              "--strategy", "ssd", "--strategy", "oracle_all"])
    saved = json.loads((tmp_path / "oracle_passes.json").read_text())
    assert list(saved) == ["ssd", "oracle_all"] and saved["oracle_all"]["oracle"] == "all"
    diff = np.array(res["oracle_all"]["image_passes"]) - np.array(res["ssd"]["image_passes"])
    assert res["oracle_all"]["paired_diff"] == pytest.approx(diff.mean())
    # sampled (T 1): q is the verifying p itself, so every draft is kept and every row takes one pass
    assert saved["oracle_all"]["accept_down"] == 1.0 and saved["oracle_all"]["passes"][-1] == 1 + 16
    assert saved["ssd"]["accept_down"] < 1.0


def test_pass_statistics_counted_at_once_equal_counting_pass_by_pass():
    """PassStats records a pass as it is and counts the recorded passes when read; the counts equal counting each
    pass as it comes (the reference below), with direct additions between passes and reads between passes."""
    from specgen.decoding.ssd_pass_stats import KEYS, PassStats

    def reference(stats, b, fresh, changed, first):
        c = stats["counts"]
        c["fresh"][b] += fresh.sum()
        c["fresh_changed"][b] += (changed & fresh).sum()
        c["carried"][b] += (~fresh).sum()
        c["carried_changed"][b] += (changed & ~fresh).sum()
        c["finalised"][b] += first + 1
        if changed.any():
            c["changed"][b] += 1
            c["first_on_fresh"][b] += fresh[first].float()
        if stats["last"][b]:
            c["after"][b] += 1
            c["after_changed"][b] += changed[0].float()
        c["single"][b] += changed[0].float()
        stats["last"][b] = changed.any()
        d = torch.arange(fresh.numel()).clamp_max(stats["dist"].shape[-1] - 1)
        kind = (~fresh).long()
        stats["dist"][b, :, 0].index_put_((kind, d), torch.ones_like(d, dtype=torch.float), accumulate=True)
        stats["dist"][b, :, 1].index_put_((kind, d), changed.float(), accumulate=True)

    torch.manual_seed(0)
    B, W = 3, 4
    new = PassStats(B, W, "cpu")
    ref = {"counts": {k: torch.zeros(B) for k in KEYS}, "last": torch.zeros(B, dtype=torch.bool),
           "dist": torch.zeros(B, 2, 2, 2 * W)}
    for step in range(60):
        b, n = int(torch.randint(B, ())), int(torch.randint(1, 3 * W, ()))  # windows longer than 2W share a bin
        fresh, changed = torch.rand(n) < 0.5, torch.rand(n) < 0.3
        first = int(changed.float().argmax()) if changed.any() else n - 1
        new.record(b, fresh, changed, first)
        reference(ref, b, fresh, changed, first)
        if step % 7 == 0:  # a direct addition (a sibling's judgement)
            new.counts["sibling_hits"][b] += 1
            ref["counts"]["sibling_hits"][b] += 1
        if step % 25 == 0:  # read in between: the counts so far, and later passes still follow the last one
            new.summary(torch.full((B,), step + 1))
    passes = torch.full((B,), 60)
    got = new.summary(passes)
    for k in KEYS:
        assert torch.equal(new.counts[k], ref["counts"][k]), k
    assert torch.equal(new.by_distance, ref["dist"]) and torch.equal(got["change_by_distance"], ref["dist"])
    assert torch.equal(new.summary(passes)["single_token_passes"], got["single_token_passes"])  # reading twice: same
    assert ref["counts"]["after"].sum() > 0 and ref["counts"]["first_on_fresh"].sum() > 0  # both branches ran


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
@pytest.mark.parametrize("solver", ["loop", "fixed_point"])
def test_column_by_column_draft_equals_the_plain_loop_over_generic_calls(cfg_scale, solver):
    """`ssd_columns.draft_columns` (how a down row is drafted) gives the tokens and proposals of the plain loop: per column, the
    left tokens' features from the lookup table, `down_step` on the flat CFG rows, `st.dist` and `inverse_cdf`, the
    draft written into the row before the next column; two images, two left tokens. The lean loop op for op; the
    fixed-point solver (every column at once, again from its own drafts until none changes) the same tokens, and the
    same proposals up to the rounding of products over more rows, from any guess of the row, in fewer calls than
    columns from the row above's tokens; its calls are counted."""
    from specgen.decoding.sampling import inverse_cdf, uniform
    from specgen.decoding.state import SpecState
    m = tiny(True)
    torch.manual_seed(3)
    d = FPhi(m.hidden_size, "xs", context_kernel=3, left_context=True, left_tokens=2)
    for lin in (d.nets["down"][-1], d.left_in, d.left_block.mlp[-1], *d.left_far):
        torch.nn.init.normal_(lin.weight, std=0.05)
    st = SpecState(m, m.prompts(PROMPTS[:2]), cfg_scale, 1.0, None, make_rngs([0, 1]))
    st.target_pass(st.g.prefix_len)
    g, k = st.g, 2
    codes = torch.randint(0, g.num_visual, (2, g.width))
    st.set_tokens(g.position(0, torch.arange(g.width)), codes)
    st.target_pass(g.position(1, 0))  # the first row's states
    images, rows = torch.arange(2), torch.ones(2, dtype=torch.long)
    above = g.position(rows[:, None] - 1, torch.arange(g.width)).repeat(st.reps, 1)
    rep = torch.cat([images + j * st.B for j in range(st.reps)])[:, None]
    hidden = st.hid[rep, above - 1]
    trunk = d.down_trunk(hidden, st.embed(st.seq[rep, above]))
    first = above[:, :1] + g.stride
    before = st.seq[rep[:, :1], first - k + torch.arange(k)]
    table = ssd.left_table(st, d)
    u = uniform((2, g.width), make_rngs([5, 6]), "cpu")
    guesses = [st.seq[rep[:2], above[:2]], torch.randint(0, g.num_visual, (2, g.width)),
               torch.zeros(2, g.width, dtype=torch.long)]  # the row above (what SSD passes), random, constant
    with torch.no_grad():
        got = []
        for guess in guesses[:1] if solver == "loop" else guesses:
            calls = st.draft_calls
            got.append((*ssd_columns.draft_columns(st, d, trunk, hidden, before, table, u, 0.5, guess.clone(), solver),
                        st.draft_calls - calls))
        buf = torch.cat([before, before.new_zeros(len(before), g.width)], 1)
        want_codes, want_q = [], []
        for c in range(g.width):
            left = sum(table[j - 1][buf[:, k + c - j]] for j in range(1, k + 1))
            q = st.dist(d.down_step(trunk[:, c], hidden[:, c], left), 0.5)
            tok = inverse_cdf(q, u[:, c])
            want_codes.append(tok)
            want_q.append(q)
            buf[:, k + c] = tok.repeat(st.reps)
    for got_codes, got_q, calls in got:
        assert torch.equal(got_codes, torch.stack(want_codes, 1))
        assert got_q.shape == (2, g.width, g.num_visual)
        if solver == "loop":
            assert torch.equal(got_q, torch.stack(want_q, 1)) and calls == g.width
        else:
            assert torch.allclose(got_q, torch.stack(want_q, 1), atol=1e-6) and 1 <= calls <= g.width
    if solver == "fixed_point":  # from the row above: fewer calls than columns
        assert got[0][2] < g.width


def test_reweight_draws_the_token_after_a_change_from_the_reweighted_p_and_keeps_images_their_own():
    """reweight=k: after a pass's first change in a down row, the next token is drawn from q' = p * f(new) / f(old),
    normalised (checked by hand for every call: the drafter's down draft through `down_column` with the new and the
    old left tokens' embeddings, or for a drafter without left context one f_phi.right step from the state before the
    change, guided by hand); an image's draws are its own (batch = batch 1); final rows leave
    the kept trunks; settings that cannot serve it are refused with the value named."""
    from specgen.decoding import ssd_tail
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS + ["a green diamond"])
    d = noisy_drafter(m, left=True)
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=2, redraft=2, redraft_rows=1, reweight=2)
    calls, kept = [], []

    def spy(win, b, own, first, fed, tokens, pb, reweight=ssd_tail.reweight):
        at = win.slots[own[first]]
        before, state = tokens.clone(), win.st.hid[ssd_tail.image_rows(win.st, b), at - 1].clone()
        out = reweight(win, b, own, first, fed, tokens, pb)
        calls.append((win.st, win.pos.clone(), own, first, fed.clone(), before, pb, state,
                      win.st.memo.get("down_rows", {}).get((b, win.st.g.row_col(at)[0])), out, tokens.clone()))
        kept.append(len(win.st.memo["down_rows"]))
        return out

    def by_hand(drafter, calls) -> tuple[int, int]:
        """Check each call's proposals: q' = p * exp(f(new) - f(old)), f the guided logits computed by hand (the
        down draft through `down_column`, or f_phi.right steps from the state before the change); for the second
        tail token, new is the first one as drawn again and old as fed. Returns the first proposals checked, and the
        second ones whose first tail token was drawn other than it stood (its left token changed)."""
        checked = moved = 0
        for state, pos, own, first, fed, before, pb, above, cached, (_, slots, qs), after in calls:
            if not slots:
                continue
            g, slot = state.g, int(own[first + 1])
            assert slots[0] == slot
            c = int(pos[slot]) - g.position(g.row_col(int(pos[slot]))[0], 0)

            def guided(toks, col):  # toks: the tokens after the change, nearest to it first
                h = above
                for tok in toks:
                    e = m.embed_visual(tok).expand(2, -1)
                    h = drafter.right(h, e) if cached is None else drafter.down_column(cached[0][:, col],
                                                                                       cached[1][:, col], e)
                cond, uncond = m.visual_logits(h)  # (2, D) in: the conditional and unconditional rows
                return uncond + 3.0 * (cond - uncond)

            new, old = before[own[first]], fed[own[first]]
            want = pb[slot] * torch.exp(guided([new], c) - guided([old], c))
            assert torch.allclose(qs[0], want / want.sum(), atol=1e-5)
            checked += 1
            if len(slots) > 1:  # the second: after the first tail token as drawn again, and as fed
                nxt = slots[1]
                path_new, path_old = ([new, after[slot]], [old, fed[slot]]) if cached is None else \
                    ([after[slot]], [fed[slot]])
                want = pb[nxt] * torch.exp(guided(path_new, c + 1) - guided(path_old, c + 1))
                assert torch.allclose(qs[1], want / want.sum(), atol=1e-5)
                moved += int(after[slot] != before[slot])
        return checked, moved

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ssd_tail, "reweight", spy)
        out, st = ssd.generate(m, p, d, rngs=make_rngs(range(4)), **kw)
        checked, moved = by_hand(d, calls)
        assert checked >= 5 and moved >= 1 and all(c[8] is not None for c in calls if c[9][1])  # down rows
        assert max(kept) <= 4 * 2  # at most the rows not final yet of each image
        calls.clear()
        point = noisy_drafter(m)  # no left context: every row's tokens after a change from f_phi.right's chain
        ssd.generate(m, p, point, rngs=make_rngs(range(4)), **kw)
        assert by_hand(point, calls)[0] >= 5 and all(c[8] is None for c in calls)
    _, plain = ssd.generate(m, p, d, rngs=make_rngs(range(4)), **dict(kw, reweight=0))
    assert st["draft_calls"] > plain["draft_calls"]
    for i in range(4):
        one, st1 = ssd.generate(m, p[i:i + 1], d, rngs=make_rngs([i]), **kw)
        assert torch.equal(out[i], one[0]) and st["image_passes"][i] == st1["nfe"]
    with pytest.raises(ValueError, match="reweight=2 .* needs carry=true"):
        ssd.generate(m, p, d, carry=False, reweight=2)
    with pytest.raises(ValueError, match="reweight=2 .* needs a hidden-state drafter"):
        from specgen.drafters.fphi import TokenDrafter
        ssd.generate(m, p, TokenDrafter(m.hidden_size, m.grid.num_visual), carry=True, reweight=2)
    out, st = ssd.generate(m, p, point, rngs=make_rngs(range(4)), **kw)
    _, plain = ssd.generate(m, p, point, rngs=make_rngs(range(4)), **dict(kw, reweight=0))
    assert st["draft_calls"] > plain["draft_calls"]
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    assert torch.equal(ssd.generate(m, p, point, temperature=0, **kw)[0], ref)
    with pytest.raises(ValueError, match="reweight"):
        ssd.generate(m, p, d, carry=True, reweight=-1)


def _with_codebook(m: ShapesLlama, dim: int = 4, seed: int = 0) -> ShapesLlama:
    """Attach a tiny random VQ tokenizer so that `acceptance=latent` finds the codebook's neighbours."""
    from specgen.tokenizers.vq import VQAutoencoder

    torch.manual_seed(seed)
    return m.attach_tokenizer(VQAutoencoder(ch=8, mults=(2, 2), z_dim=dim, num_codes=m.grid.num_visual).eval())


def test_code_neighbours_and_the_relaxed_test_against_a_hand_computation():
    """code_neighbours: nearest other codes first; relaxed_accept (LANTERN): p(t) gains the mass of t's nearest codes
    up to delta (the longest prefix of the nearest-first list that stays within it); delta 0 is the speculative test
    draw for draw; a rejected token is redrawn from the residual norm(max(0, p - q))."""
    from specgen.decoding.sampling import accept_or_resample, code_neighbours, relaxed_accept

    e = torch.tensor([[0.0], [1.0], [3.0], [10.0]])  # on a line: 0's neighbours 1, 2, 3; 2's: 1, 0, 3
    nb = code_neighbours(e, 3)
    assert nb.tolist() == [[1, 2, 3], [0, 2, 3], [1, 0, 3], [2, 1, 0]]
    with pytest.raises(ValueError, match="latent_k=4"):
        code_neighbours(e, 4)
    big = torch.randn(2500, 8, generator=torch.Generator().manual_seed(0))  # rows in blocks of 1024: as all at once
    full = torch.cdist(big, big).fill_diagonal_(float("inf")).topk(5, dim=-1, largest=False).indices
    assert torch.equal(code_neighbours(big, 5), full)
    p = torch.tensor([0.10, 0.05, 0.25, 0.60])
    q = torch.tensor([0.70, 0.10, 0.10, 0.10])
    # token 0: p 0.10, neighbours 1 (0.05), 2 (0.25), 3 (0.60): cumulative 0.05, 0.30, 0.90
    for delta, want in ((0.0, 0.10), (0.05, 0.15), (0.2, 0.15), (0.3, 0.40), (0.95, 1.0)):
        n = 40000
        t = torch.zeros(1, n, dtype=torch.long)
        out, ok = relaxed_accept(t, p.expand(1, n, 4), q.expand(1, n, 4), nb, delta, make_rngs([3]))
        rate = float(ok.float().mean())
        assert abs(rate - min(1.0, want / 0.70)) < 0.01, (delta, rate)
        redrawn = out[~ok]
        if redrawn.numel():  # the residual max(0, p - q) = (0, 0, 0.15, 0.5) / 0.65
            freq = torch.bincount(redrawn, minlength=4).float() / redrawn.numel()
            assert torch.allclose(freq, torch.tensor([0, 0, 0.15, 0.5]) / 0.65, atol=0.02), freq
    # delta 0: the speculative test, draw for draw
    tokens = torch.randint(0, 4, (2, 50), generator=torch.Generator().manual_seed(0))
    pp = torch.softmax(torch.randn(2, 50, 4, generator=torch.Generator().manual_seed(1)), -1)
    qq = torch.softmax(torch.randn(2, 50, 4, generator=torch.Generator().manual_seed(2)), -1)
    a = relaxed_accept(tokens, pp, qq, nb, 0.0, make_rngs([4, 5]))
    b = accept_or_resample(tokens, pp, qq, make_rngs([4, 5]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # greedy (p one-hot): only the argmax is kept, even when it is the judged token's nearest code
    onehot = torch.nn.functional.one_hot(torch.tensor([[1, 1]]), 4).float()
    out, ok = relaxed_accept(torch.tensor([[1, 0]]), onehot, onehot, nb, 0.5)
    assert ok.tolist() == [[True, False]] and out.tolist() == [[1, 1]]


def test_latent_acceptance_in_the_carry_window():
    """acceptance='latent': greedy output still equals AR's; latent_delta 0 decodes the speculative test's images and
    passes; a large delta with many neighbours accepts more, so fewer passes; batch = batch 1; bad settings and a
    backbone without a codebook are named."""
    m = _with_codebook(tiny(True, grid=6))
    p = m.prompts(PROMPTS + ["a green diamond"])
    kw = dict(cfg_scale=3.0, rounds=0, carry=True, max_window_rows=2, redraft=2)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for rule in ("latent", "latent_carried"):
        out, _ = ssd.generate(m, p, noisy_drafter(m), temperature=0, acceptance=rule, latent_k=8, latent_delta=0.5,
                              **kw)
        assert torch.equal(out, ref)
    spec, st_spec = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), **kw)
    zero, st_zero = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), acceptance="latent",
                                 latent_delta=0.0, **kw)
    assert torch.equal(spec, zero) and torch.equal(st_spec["image_passes"], st_zero["image_passes"])
    loose, st_loose = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)), acceptance="latent",
                                   latent_k=20, latent_delta=0.6, **kw)
    assert float(st_loose["image_passes"].mean()) < float(st_spec["image_passes"].mean())
    for i in range(4):
        one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), acceptance="latent",
                                latent_k=20, latent_delta=0.6, **kw)
        assert torch.equal(loose[i], one[0]) and st_loose["image_passes"][i] == st1["nfe"]
    carried, st_carried = ssd.generate(m, p, noisy_drafter(m), rngs=make_rngs(range(4)),
                                       acceptance="latent_carried", latent_k=20, latent_delta=0.6, **kw)
    assert float(st_carried["carried_change_rate"].mean()) < float(st_spec["carried_change_rate"].mean())
    for i in range(2):
        one, st1 = ssd.generate(m, p[i:i + 1], noisy_drafter(m), rngs=make_rngs([i]), acceptance="latent_carried",
                                latent_k=20, latent_delta=0.6, **kw)
        assert torch.equal(carried[i], one[0]) and st_carried["image_passes"][i] == st1["nfe"]
    with pytest.raises(ValueError, match="latent_delta=1.0"):
        ssd.generate(m, p, noisy_drafter(m), acceptance="latent", latent_delta=1.0, **kw)
    with pytest.raises(ValueError, match="latent_k"):
        ssd.generate(m, p, noisy_drafter(m), acceptance="latent", latent_k=0, **kw)
    with pytest.raises(ValueError, match="acceptance='latent' .* needs carry=true"):
        ssd.generate(m, p, noisy_drafter(m), carry=False, acceptance="latent")
    with pytest.raises(RuntimeError, match="attach_tokenizer"):
        ssd.generate(tiny(True, grid=6), p, noisy_drafter(m), acceptance="latent", **kw)


def test_spec_state_looks_up_image_embeddings_in_a_table_only_where_it_is_small(monkeypatch):
    """`SpecState.embed` gives `embed_image`'s embeddings of visual codes and forced tokens (end-of-row), mixed in one
    call, from a per-generation table where every image token's embedding fits in `EMBED_TABLE_MAX` values, and
    through `embed_image` (no table) where it does not."""
    from specgen.backbones.protocol import embed_image
    from specgen.decoding import state

    m = tiny(True, grid=6)
    g = m.grid
    tokens = torch.tensor([[0, 5, g.num_visual, 23], [g.num_visual, 1, 2, 0]])  # visual codes and end-of-row tokens
    want = embed_image(m, tokens)
    st = state.SpecState(m, m.prompts(PROMPTS[:1]), 3.0, 1.0, None, None)
    assert torch.equal(st.embed(tokens), want) and st.memo["embed_table"].shape == (g.num_visual + len(g.forced_ids), m.hidden_size)
    assert torch.equal(st.embed(tokens[0, 1]), want[0, 1])  # any shape, a 0-d token too
    monkeypatch.setattr(state, "EMBED_TABLE_MAX", (g.num_visual + len(g.forced_ids)) * m.hidden_size - 1)
    big = state.SpecState(m, m.prompts(PROMPTS[:1]), 3.0, 1.0, None, None)
    assert torch.equal(big.embed(tokens), want) and "embed_table" not in big.memo
