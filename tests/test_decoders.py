"""Every discrete decoder against a reference: token equality with AR under greedy decoding, and the model's exact
distribution for the lossless modes (SSD exact, multi-token heads, draft model, SJD) by a chi-square test whose
power is shown on decoders that are not lossless."""
from pathlib import Path

import pytest
import torch

from decoder_helpers import PROMPTS, default_carry, draft_model, exact_joint, gof_pvalue, noisy_drafter, noisy_heads, \
    spy_fed, tiny
from specgen.decoding import ar, mtp1d, sjd, specdec, ssd, ssd_carry, zipar
from specgen.decoding.sampling import make_rngs
from specgen.decoding.ssd_carry.acceptance import Latent, Typical
from specgen.decoding.ssd_carry.tails import Redraft, Reweight
from specgen.drafters.fphi import FPhi, TokenDrafter

PAPER = [dict(rounds=5), dict(exact=True), dict(rounds=5, vertical=False), dict(exact=True, vertical=False)]
CARRY = [dict(rounds=0), dict(rounds=1, vertical=False), dict(rounds=0, acceptance=Typical()),
         dict(rounds=0, acceptance=Typical(carried_only=True), tails=[Redraft(2, rows=None)]),
         dict(rounds=0, left=True), dict(rounds=0, left=True, tails=[Redraft(2, rows=None), Reweight(3)]),
         dict(rounds=0, max_window_rows=1, tails=[Reweight(2)]), default_carry(left=True)]


@pytest.mark.parametrize("eol", [True, False])
@pytest.mark.parametrize("kw", [("paper", k) for k in PAPER] + [("carry", k) for k in CARRY],
                         ids=[f"paper{i}" for i in range(len(PAPER))] + [f"carry{i}" for i in range(len(CARRY))])
def test_greedy_ssd_equals_greedy_ar(eol, kw):
    kind, kw = kw
    kw = dict(kw)
    m = tiny(eol)
    p = m.prompts(PROMPTS)
    drafter = noisy_drafter(m, left=kw.pop("left", False))
    decode = ssd.generate if kind == "paper" else ssd_carry.generate
    for scale in (1.0, 3.0):
        ref, _ = ar.generate(m, p, cfg_scale=scale, temperature=0)
        out, _ = decode(m, p, drafter, cfg_scale=scale, temperature=0, **kw)
        assert torch.equal(out, ref)
        assert len(torch.unique(ref)) > 3


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


LOSSLESS = ["ar", "ssd_exact", "ssd_exact_horizontal", "ssd_exact_argmax_draft", "mtp1d", "specdec", "sjd",
            "ssd_carry_default", "ssd_no_reweight", "broken", "ssd_typical"]


@pytest.mark.parametrize("decoder", LOSSLESS)
def test_lossless_modes_sample_the_models_distribution(decoder, monkeypatch):
    """Chi-square goodness of fit of 4000 sampled 2x2 images against the exact joint (256 cells).

    `ssd_carry_default` is the carry window with the default `ssd`'s settings (approximately lossless: carried tokens
    are checked against the last pass's p; its reweighted tokens after a change with a left-context drafter, whose
    reweighted draws are shown to happen), `ssd_no_reweight` the same without the `Reweight` tail. `broken` (every
    draft accepted: samples from the drafter) and `ssd_typical` (typical acceptance keeps plausible drafts: not
    lossless) show that the test has power."""
    m = tiny(True, codes=4, grid=2, sharpen=3.0)
    joint = exact_joint(m, PROMPTS[0], cfg_scale=2.0)
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
    elif decoder in ("ssd_carry_default", "ssd_no_reweight", "ssd_typical"):
        kw = default_carry()
        if decoder == "ssd_no_reweight":
            kw["tails"] = [Redraft(4, rows=1)]
        if decoder == "ssd_typical":
            kw = default_carry(tails=[Redraft(4, rows=1)], acceptance=Typical())
        left = decoder == "ssd_carry_default"
        out, st = ssd_carry.generate(m, prompt_ids, noisy_drafter(m, left=left), cfg_scale=2.0, rngs=rngs, **kw)
        if decoder == "ssd_carry_default":  # the reweighted draws happen: more draft calls than the same without
            _, plain = ssd_carry.generate(m, prompt_ids, noisy_drafter(m, left=True), cfg_scale=2.0,
                                          rngs=make_rngs(range(n)), **dict(kw, tails=[Redraft(4, rows=1)]))
            assert st["draft_calls"] > plain["draft_calls"] + 200
    else:
        if decoder == "broken":
            monkeypatch.setattr(ssd, "accept_or_resample", lambda t, p, q, g: (t, torch.ones_like(t, dtype=bool)))
        out, _ = ssd.generate(m, prompt_ids, noisy_drafter(m), cfg_scale=2.0, exact=True,
                              vertical=decoder != "ssd_exact_horizontal", rngs=rngs,
                              draft_temperature=0.0 if decoder == "ssd_exact_argmax_draft" else None)
    p_value = gof_pvalue(out, joint)
    if decoder in ("broken", "ssd_typical"):
        assert p_value < 1e-6, p_value
    else:
        assert p_value > 1e-3, p_value


def test_greedy_decoders_equal_ar_on_the_shipped_backbone_and_images_hold_objects():
    """The trained backbone with the shipped drafters: greedy AR at CFG 2 draws objects (checked with the
    parser), and every verified strategy reproduces it token for token (the paper's SSD with rounds >= W, the
    default carry window, exact SSD, SJD, 1D-MTP, draft-model decoding)."""
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
    outs = {"ssd_paper": ssd.generate(m, p, fphi, cfg_scale=2.0, temperature=0, rounds=W)[0],
            "ssd": ssd_carry.generate(m, p, fphi, cfg_scale=2.0, temperature=0, **default_carry())[0],
            "ssd_exact": ssd.generate(m, p, fphi, cfg_scale=2.0, temperature=0, exact=True)[0],
            "sjd": sjd.generate(m, p, cfg_scale=2.0, temperature=0, window=16)[0],
            "mtp1d": mtp1d.generate(m, p, heads, cfg_scale=2.0, temperature=0)[0],
            "specdec": specdec.generate(m, p, draft, cfg_scale=2.0, temperature=0, window=4)[0]}
    for name, out in outs.items():
        assert torch.equal(out, ref), name


@pytest.mark.parametrize("eol", [True, False])
def test_token_id_drafter_plugs_into_ssd_and_stays_exact(eol):
    """The token-space ablation drafter goes through the same verification: greedy output equals AR."""
    m = tiny(eol)
    torch.manual_seed(5)
    drafter = TokenDrafter(m.hidden_size, m.grid.num_visual, preset="xs")
    p = m.prompts(PROMPTS)
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    for kw in (dict(rounds=m.grid.width), dict(exact=True)):
        out, st = ssd.generate(m, p, drafter, cfg_scale=3.0, temperature=0, **kw)
        assert torch.equal(out, ref) and st["draft_calls"] > 0
    out, st = ssd_carry.generate(m, p, drafter, cfg_scale=3.0, temperature=0)
    assert torch.equal(out, ref) and st["draft_calls"] > 0


def test_bad_decoder_inputs_name_the_value():
    m = tiny(True)
    p = m.prompts(PROMPTS[:1])
    d = noisy_drafter(m)
    with pytest.raises(ValueError, match="rounds must be >= 0, got -1"):
        ssd.generate(m, p, d, rounds=-1)
    with pytest.raises(ValueError, match="rounds must be >= 0, got -1"):
        ssd_carry.generate(m, p, d, rounds=-1)
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
        mtp1d.generate(m, p, type("H", (), {"hidden_size": m.hidden_size, "backbone_id": "aaaa", "num_heads": 2,
                                             "directions": ("ahead_1", "ahead_2"), "predicts": "hidden",
                                             "left_context": False, "left_tokens": 0})())
    with pytest.raises(TypeError, match=r"H is not a drafter: it has no directions.*specgen.api.load_drafter"):
        ssd.generate(m, p, type("H", (), {"hidden_size": m.hidden_size, "backbone_id": ""})())
    right_only = FPhi(m.hidden_size, "xs", directions=("right",))
    with pytest.raises(ValueError, match=r"drafts \['right', 'down'\] but the drafter predicts only \['right'\]"):
        ssd.generate(tiny(True), p, right_only)
    ssd.generate(tiny(True), p, right_only, vertical=False)  # horizontal-only needs no down predictor
    with pytest.raises(ValueError, match=f"window=9 does not fit the grid: a row has {m.grid.width} tokens"):
        zipar.generate(m, p, window=9)


def test_the_papers_ssd_takes_only_the_papers_options():
    """`ssd.generate` is the paper's algorithm: its options are the sampling settings, the rounds, the exact and
    horizontal-only variants and the draft temperature; everything beyond the paper is `ssd_carry`'s."""
    import inspect

    assert list(inspect.signature(ssd.generate).parameters) == [
        "backbone", "prompts", "drafter", "cfg_scale", "temperature", "top_k", "rngs", "rounds", "exact", "vertical",
        "draft_temperature", "trace"]
    m = tiny(True)
    with pytest.raises(TypeError, match="tails"):
        ssd.generate(m, m.prompts(PROMPTS[:1]), noisy_drafter(m), tails=[Redraft()])


def test_exported_drafter_carries_the_backbone_it_was_distilled_from(tmp_path):
    import json

    from specgen.utils.checkpoints import export, load_exported

    cfg = {"_target_": "specgen.drafters.fphi.FPhi", "hidden_size": 32, "preset": "xs"}
    export(tmp_path / "d", FPhi(32, "xs"), cfg, extra={"backbone_id": "1234abcd"})
    assert load_exported(tmp_path / "d").backbone_id == "1234abcd"
    assert json.loads((tmp_path / "d" / "extra.json").read_text())["backbone_id"] == "1234abcd"


def test_sjd_samples_the_tokens_of_the_dense_reference_for_fixed_seeds(one_thread):
    """tests/fixtures/sjd_reference.pt was written by make_sjd_reference.py with SJD keeping dense (B, N, V) target
    distributions; SJD now keeps them for the Jacobi window only and must sample the same tokens with the same passes
    and acceptances on the shipped backbone."""
    import sys

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


@pytest.mark.parametrize("decode", ["ar", "ssd_carry", "ssd_paper", "sjd", "zipar"])
def test_tokens_fed_counts_the_positions_every_pass_feeds(monkeypatch, decode):
    """stats["tokens_fed"]: per image, the positions fed to the target after the prefill, as the forwards saw them
    (AR: every visual token but the last, and the end-of-row tokens but the last); a speculative decoder feeds at
    least as many."""
    m = tiny(True, grid=6)
    p = m.prompts(PROMPTS)
    fed = spy_fed(monkeypatch, m)
    rngs = make_rngs(range(3))
    run = {"ar": lambda: ar.generate(m, p, cfg_scale=3.0, rngs=rngs),
           "ssd_carry": lambda: ssd_carry.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rngs=rngs,
                                                   max_window_rows=2),
           "ssd_paper": lambda: ssd.generate(m, p, noisy_drafter(m), cfg_scale=3.0, rngs=rngs, rounds=2),
           "sjd": lambda: sjd.generate(m, p, cfg_scale=3.0, rngs=rngs),
           "zipar": lambda: zipar.generate(m, p, cfg_scale=3.0, rngs=rngs, window=2)}[decode]
    _, st = run()
    H, W = m.grid.height, m.grid.width
    assert torch.equal(st["tokens_fed"], torch.full((3,), float(sum(fed[1:]))))
    assert st["tokens_fed"][0] >= H * W - 1 + H - 1
    if decode == "ar":
        assert st["tokens_fed"][0] == H * W - 1 + H - 1


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
    assert torch.equal(st.embed(tokens), want)
    assert st._embed_table.shape == (g.num_visual + len(g.forced_ids), m.hidden_size)
    assert torch.equal(st.embed(tokens[0, 1]), want[0, 1])  # any shape, a 0-d token too
    monkeypatch.setattr(state, "EMBED_TABLE_MAX", (g.num_visual + len(g.forced_ids)) * m.hidden_size - 1)
    big = state.SpecState(m, m.prompts(PROMPTS[:1]), 3.0, 1.0, None, None)
    assert torch.equal(big.embed(tokens), want) and big._embed_table is None


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


def test_code_neighbours_and_the_relaxed_test_against_a_hand_computation():
    """code_neighbours: nearest other codes first; relaxed_accept (LANTERN): p(t) gains the mass of t's nearest codes
    up to delta (the longest prefix of the nearest-first list that stays within it); delta 0 is the speculative test
    draw for draw; a rejected token is redrawn from the residual norm(max(0, p - q))."""
    from specgen.decoding.sampling import accept_or_resample, code_neighbours, relaxed_accept

    e = torch.tensor([[0.0], [1.0], [3.0], [10.0]])  # on a line: 0's neighbours 1, 2, 3; 2's: 1, 0, 3
    nb = code_neighbours(e, 3)
    assert nb.tolist() == [[1, 2, 3], [0, 2, 3], [1, 0, 3], [2, 1, 0]]
    with pytest.raises(ValueError, match="k=4"):
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


def test_latent_acceptance_needs_the_tokenizers_codebook():
    m = tiny(True, grid=6)
    with pytest.raises(RuntimeError, match="attach_tokenizer"):
        ssd_carry.generate(m, m.prompts(PROMPTS[:1]), noisy_drafter(m), acceptance=Latent())
    with pytest.raises(ValueError, match="delta=1.0"):
        Latent(delta=1.0)
