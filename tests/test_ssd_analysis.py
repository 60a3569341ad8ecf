"""The SSD analysis tools: where the passes go per row (row_passes), how the pass ratio scales with the grid
(grid_scaling), the cost split of a pass (ssd_costs, through the decoders' trace hook), the oracle drafter
(oracle_passes, through the decoders' drafting hook), and the column-by-column down draft against its loop."""
import json

import numpy as np
import pytest
import torch

from decoder_helpers import PROMPTS, default_carry, noisy_drafter, tiny
from specgen.decoding import ar, ssd_carry, ssd_columns
from specgen.decoding.sampling import make_rngs
from specgen.decoding.ssd_drafting import Drafting
from specgen.drafters.fphi import FPhi


def _world(tiny_exports) -> list[str]:
    return ["--backbone", str(tiny_exports / "ar"), "--tokenizer", str(tiny_exports / "vq"),
            "--drafter", str(tiny_exports / "fphi"), "--prompts", "2"]


def test_row_passes_analysis_summarises_and_writes(tmp_path, tiny_exports):
    from specgen.analysis import row_passes

    s = row_passes.summarise(np.array([[3.0, 5, 7, 9], [5.0, 7, 9, 11]]), width=4, rounds=2)
    assert s["passes"] == [4, 6, 8, 10] and s["passes_per_row"] == pytest.approx(2.0)
    assert s["ratio"] == pytest.approx([4 / 4, 8 / 6, 12 / 8, 16 / 10]) and s["rounds_plus_one"] == 3
    out = row_passes.main([*_world(tiny_exports), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "row_passes.json").read_text())
    assert set(saved) == set(out) == set(row_passes.config_strategies())
    assert (tmp_path / "row_passes.png").stat().st_size > 0
    assert all(len(r["passes"]) == 16 and r["images"] == 2 for r in saved.values())
    cascades = saved["ssd"]["cascades"]  # carry: the window's cascades; the paper's rule has no window
    assert "cascades" not in saved["ssd_paper"] and saved["ssd"]["unchecked"] == 0
    assert len(cascades["carried_rate_by_distance"]) == 32 and 0 <= cascades["single_token_passes"] <= 1
    # two images, each token judged fresh at least once (the default re-drafts the first row's tokens after a change)
    assert sum(cascades["fresh_judged_by_distance"]) >= 2 * 256
    name, options = row_passes.parse_variant("dt=draft_temperature:null,max_window_rows:3,tails:[]")
    assert name == "dt" and options == {**row_passes.decoding_options("ssd"), "draft_temperature": None,
                                        "max_window_rows": 3, "tails": []}
    assert row_passes.parse_variant("r1=base:ssd_paper,rounds:1")[1] == {**row_passes.decoding_options("ssd_paper"),
                                                                         "rounds": 1}
    with pytest.raises(ValueError, match="NAME=key:value"):
        row_passes.parse_variant("rounds:0")
    with pytest.raises(ValueError, match="no decoding config 'ssd_nope'"):
        row_passes.parse_variant("x=base:ssd_nope")
    out = row_passes.main([*_world(tiny_exports), "--out", str(tmp_path), "--variant", "a=tails:[]",
                           "--variant", "b=max_window_rows:1,tails:[]",
                           "--variant", f"c=tails:[],drafter:{tiny_exports / 'fphi'}"])
    assert list(out) == ["a", "b", "c"]
    # c is a with the same drafter given as a variant's: the same images, so a paired difference of exactly zero
    assert out["c"]["image_passes"] == out["a"]["image_passes"] and len(out["a"]["image_passes"]) == 2
    assert out["c"]["paired_vs"] == "a" and out["c"]["paired_diff"] == 0 and out["c"]["paired_diff_ci95"] == 0
    diff = np.array(out["b"]["image_passes"]) - np.array(out["a"]["image_passes"])
    assert out["b"]["paired_diff"] == pytest.approx(diff.mean()) and "paired_diff" not in out["a"]


def test_decoding_options_build_the_configs_objects(tmp_path):
    """A strategy's options name its decoder and carry its objects as configs; `decoder` builds them fresh, and the
    result decodes as the config says (here: the default, against ssd_carry.generate with the same objects)."""
    from specgen.analysis.row_passes import decoder, decoding_options

    options = decoding_options("ssd")
    assert options["_target_"] == "specgen.decoding.ssd_carry.generate"
    fn, kwargs = decoder(options)
    assert fn is ssd_carry.generate and [type(t).__name__ for t in kwargs["tails"]] == ["Redraft", "Reweight"]
    assert decoder(options)[1]["tails"][0] is not kwargs["tails"][0]  # fresh objects each time
    from specgen.utils.checkpoints import load_exported  # noqa: F401  (the shipped drafter is used below)
    m = tiny(True)
    from decoder_helpers import noisy_drafter
    d = noisy_drafter(m, left=True)
    p = m.prompts(PROMPTS[:2])
    want = {k: v for k, v in default_carry().items()}
    ours = {k: v for k, v in kwargs.items() if k in want}
    a, _ = fn(m, p, d, cfg_scale=2.0, rngs=make_rngs([0, 1]), **ours)
    b, _ = ssd_carry.generate(m, p, d, cfg_scale=2.0, rngs=make_rngs([0, 1]), **want)
    assert torch.equal(a, b)


def test_grid_scaling_table_across_world_sizes(tmp_path, tiny_exports):
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
    paper = "specgen.decoding.ssd.generate"
    assert grid_scaling.scaling_table(fake, {"e": {"_target_": paper, "exact": True}})["e"]["row_bound"] == [None, None]
    assert grid_scaling.scaling_table(fake, {"e": {"_target_": paper, "rounds": 3}})["e"]["row_bound"] == \
        pytest.approx([2.0, 4.0])  # n / (r + 1)
    assert (tmp_path / "gs" / "grid_scaling.png").stat().st_size > 0
    assert (tmp_path / "gs" / "row_passes_8.png").is_file()


def test_ssd_cost_split_sees_every_forward_and_fits_the_pass_cost(tmp_path, tiny_exports, monkeypatch):
    """analysis.ssd_costs: the clock (a `Trace` the decoders are given) sees every target forward (one per pass,
    each decode's prefill flagged), the draft clock runs for SSD only, passes and positions fed are the decoders'
    own counts (AR's: every image token but the last, and the end-of-row tokens but the last), and the fit leaves
    the prefills out and recovers a known linear cost."""
    from specgen.analysis import ssd_costs

    line = lambda q: 0.002 + 0.0005 * q  # noqa: E731
    fake = {"ar": {"forwards": [(40, 2, 1.0, True)] + [(q, 2, line(q), False) for q in (1, 2, 1, 2)]},
            "ssd": {"forwards": [(40, 2, 1.0, True)] + [(q, 2, line(q), False) for q in (10, 20, 40)]}}
    a, b = ssd_costs.fit_pass_cost(fake)  # the prompt's forwards are left out of the fit
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0005)
    measured, report = {}, ssd_costs.report
    monkeypatch.setattr(ssd_costs, "report", lambda result, ratio: measured.update(result) or report(result, ratio))
    out = ssd_costs.main([*_world(tiny_exports), "--out", str(tmp_path), "--strategy", "ssd", "--strategy",
                          "ssd_paper", "--variant", "carry1=rounds:1,tails:[]"])
    saved = json.loads((tmp_path / "ssd_costs.json").read_text())
    assert list(saved["strategies"]) == ["ar", "ssd", "ssd_paper", "carry1"]
    for name, r in out["strategies"].items():
        forwards = measured[name]["forwards"]
        assert len(forwards) == round(r["passes"] * 2) and sum(f[3] for f in forwards) == 2  # 2 images, 2 prefills
        assert sum(f[0] for f in forwards if not f[3]) == round(r["tokens_fed"] * 2)
        assert r["target_s"] > 0 and r["other_s"] > 0 and (r["draft_s"] > 0) == (name != "ar")
        assert r["tokens_fed"] >= 16 * 16 - 1 + 15
    assert out["strategies"]["ar"]["passes"] == 256 and out["strategies"]["ar"]["tokens_fed"] == 16 * 16 - 1 + 15
    assert out["strategies"]["ar"]["wall_ratio"] == 1.0  # the fit is of the forwards measured (its sign is timing's)
    assert (out["pass_cost"]["fixed_s"], out["pass_cost"]["per_position_s"]) == pytest.approx(
        ssd_costs.fit_pass_cost(measured))
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
    assert ops["ssd"]["ops_per_pass"] == pytest.approx(ops["ssd"]["total"] / ops["ssd"]["passes"])


def test_oracle_drafter_under_greedy_takes_one_pass_a_row_and_equals_ar(tmp_path, tiny_exports):
    """The target as its own drafter (analysis.oracle_passes, a `Drafting` given to the decoder): under greedy
    decoding every draft is the target's argmax given a final context, so each row is accepted in its first pass
    (prefill + H passes) and the image is greedy AR's; with f_phi's first row, the rows below cost one pass each
    once the first row is final."""
    from specgen.analysis import oracle_passes
    from specgen.analysis.row_passes import decoder
    from specgen.backbones.loading import load_shapes_generator
    from specgen.utils.checkpoints import load_exported

    m = load_shapes_generator(str(tiny_exports / "ar"), str(tiny_exports / "vq"))
    fphi = load_exported(str(tiny_exports / "fphi")).eval()
    p = m.prompts(PROMPTS[:1])
    ref, _ = ar.generate(m, p, cfg_scale=3.0, temperature=0)
    runs = {}
    for name in ("oracle_all", "oracle_down"):
        options, rows, temperature = oracle_passes.strategies()[name]
        fn, kw = decoder(options)
        kw.update(temperature=0, draft_temperature=None, drafting=oracle_passes.oracle_drafting(rows, temperature))
        runs[name] = fn(m, p, fphi, cfg_scale=3.0, **kw)
    out, st = runs["oracle_all"]
    assert torch.equal(out, ref) and st["nfe"] == 1 + m.grid.height
    assert st["row_final_pass"][0].tolist() == list(range(2, m.grid.height + 2))
    out, st = runs["oracle_down"]
    first = int(st["row_final_pass"][0, 0])
    assert torch.equal(out, ref) and st["nfe"] == first + m.grid.height - 1 and first > 2  # f_phi's row: >1 pass
    with pytest.raises(ValueError, match="rows='up'"):
        oracle_passes.oracle_drafting("up")
    res = oracle_passes.main([*_world(tiny_exports), "--out", str(tmp_path), "--strategy", "ssd",
                              "--strategy", "oracle_all"])
    saved = json.loads((tmp_path / "oracle_passes.json").read_text())
    assert list(saved) == ["ssd", "oracle_all"] and saved["oracle_all"]["oracle"] == "all"
    diff = np.array(res["oracle_all"]["image_passes"]) - np.array(res["ssd"]["image_passes"])
    assert res["oracle_all"]["paired_diff"] == pytest.approx(diff.mean())
    # sampled (T 1): q is the verifying p itself, so every draft is kept and every row takes one pass
    assert saved["oracle_all"]["accept_down"] == 1.0 and saved["oracle_all"]["passes"][-1] == 1 + 16
    assert saved["ssd"]["accept_down"] < 1.0


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_column_by_column_draft_equals_the_plain_loop_over_generic_calls(cfg_scale):
    """`ssd_columns.draft_columns` (how a down row is drafted) gives the tokens and proposals of the plain loop: per
    column, the left tokens' features from the lookup table, `down_step` on the flat CFG rows, `st.dist` and
    `inverse_cdf`, the draft written into the row before the next column; two images, two left tokens. The lean
    loop (`draft_columns_loop`) op for op; the fixed-point solver (every column at once, again from its own drafts
    until none changes) the same tokens, and the same proposals up to the rounding of products over more rows, from
    any guess of the row, in fewer calls than columns from the row above's tokens; its calls are counted."""
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
    table = Drafting(st, d).left_table()
    u = uniform((2, g.width), make_rngs([5, 6]), "cpu")
    guesses = [st.seq[rep[:2], above[:2]], torch.randint(0, g.num_visual, (2, g.width)),
               torch.zeros(2, g.width, dtype=torch.long)]  # the row above (what SSD passes), random, constant
    with torch.no_grad():
        calls = st.draft_calls
        loop = (*ssd_columns.draft_columns_loop(st, d, trunk, hidden, before, table, u, 0.5), st.draft_calls - calls)
        fixed = []
        for guess in guesses:
            calls = st.draft_calls
            fixed.append((*ssd_columns.draft_columns(st, d, trunk, hidden, before, table, u, 0.5, guess.clone()),
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
    want_codes, want_q = torch.stack(want_codes, 1), torch.stack(want_q, 1)
    assert torch.equal(loop[0], want_codes) and torch.equal(loop[1], want_q) and loop[2] == g.width
    for got_codes, got_q, calls in fixed:
        assert torch.equal(got_codes, want_codes) and got_q.shape == (2, g.width, g.num_visual)
        assert torch.allclose(got_q, want_q, atol=1e-6) and 1 <= calls <= g.width
    assert fixed[0][2] < g.width  # from the row above: fewer calls than columns


def _forward_ops(layers: int) -> int:
    """The aten ops of one bare target forward of one position after a prompt, on a tiny model with `layers`."""
    from specgen.backbones.shapes_llama import ShapesLlama
    from specgen.decoding.trace import OpCount

    torch.manual_seed(0)
    m = ShapesLlama(num_codes=24, grid_size=5, eol=False, preset="tiny", num_layers=layers).eval()
    rows = m.prompts(PROMPTS[:1]).rows(False)
    cache = m.new_cache(rows)
    with torch.inference_mode():
        m.forward_embeds(m.embed_tokens(rows.ids), torch.arange(rows.length), cache)
        step = m.embed_tokens(rows.ids[:, :1])
        with OpCount() as ops:
            m.forward_embeds(step, torch.tensor([rows.length]), cache)
    return ops.other


def test_op_count_sees_every_forward_alike_and_a_layer_costs_a_fixed_count():
    """decoding.trace.OpCount: three ops are three; each of AR's forwards after the prefill dispatches the ops of a
    bare forward of the same model (counted apart), every one the same; a forward's ops grow by the same count per
    layer (1 -> 2 -> 3 layers); ops outside a forward are AR's sampling and embedding, drafting none. (Without
    end-of-row tokens: a forward of two positions also builds a causal mask.)"""
    from specgen.decoding.trace import OpCount

    with OpCount() as ops:
        torch.ones(3).add(1).mul(2)
    assert ops.other == 3 and ops.forwards == []  # ones, add, mul
    one, two, three = (_forward_ops(n) for n in (1, 2, 3))
    assert two - one == three - two > 0  # a layer's ops
    m = tiny(False)
    with torch.inference_mode(), OpCount() as ops:
        _, stats = ar.generate(m, m.prompts(PROMPTS[:1]), cfg_scale=1.0, rngs=make_rngs([0]), trace=ops)
    steps = [n for n, pre in zip(ops.forwards, ops.prefills) if not pre]
    assert len(steps) == stats["nfe"] - 1 == 24 and ops.prefills[0] and set(steps) == {_forward_ops(2)}
    s = ops.summary(stats["nfe"])
    assert s["ops_per_forward"] == steps[0] and s["ops_draft"] == 0 and s["drafted_tokens"] == 0
    assert s["ops"] == sum(ops.forwards) + ops.other and 0 < s["ops_other_per_pass"] < s["ops_per_forward"]


def test_op_count_of_ssd_splits_drafting_by_step_and_leaves_the_tokens_unchanged():
    """The default strategy under OpCount decodes the same tokens as without it; every drafting step's ops and
    tokens are counted (each image token drafted at least once), and the parts add up to the total."""
    from specgen.decoding.trace import OpCount

    m = tiny(True)
    d = noisy_drafter(m, left=True)
    run = lambda **kw: ssd_carry.generate(m, m.prompts(PROMPTS[:2]), d, cfg_scale=2.0,  # noqa: E731
                                          rngs=make_rngs([3, 4]), **default_carry(), **kw)
    with torch.inference_mode():
        plain, _ = run()
        with OpCount() as ops:
            counted, stats = run(trace=ops)
    assert torch.equal(plain, counted)
    s = ops.summary(stats["nfe"])
    assert set(ops.draft) >= {"right", "down"} and sum(ops.drafted.values()) >= 2 * 25
    assert s["ops"] == s["ops_target"] + s["ops_draft"] + s["ops_other"] and len(ops.forwards) == stats["nfe"]
    assert s["ops_draft"] > 0 and s["ops_per_drafted_token"] == pytest.approx(s["ops_draft"] / s["drafted_tokens"])


def test_ssd_ops_cli_counts_ar_and_ssd_at_batch_1_and_a_stream(tmp_path, tiny_exports, capsys):
    """analysis.ssd_ops on the tiny world at batch 1 and 2: AR's forwards alike at both, 256 passes; SSD's ops per
    pass, their ratio to AR's and its drafting per drafted token; SSD with carry as a stream above batch 1."""
    from specgen.analysis import ssd_ops

    out = ssd_ops.main([*_world(tiny_exports), "--out", str(tmp_path), "--batch-sizes", "1", "2"])
    saved = json.loads((tmp_path / "ssd_ops.json").read_text())
    assert saved == out and list(out) == ["bs1", "bs2"] and list(out["bs1"]) == ["ar", "ssd", "ssd_paper"]
    for key in out:
        a, s = out[key]["ar"], out[key]["ssd"]
        assert a["passes"] == 256 and a["ops_ratio"] == 1.0 and a["ops_draft"] == 0 and a["ops_per_forward"] > 0
        assert 0 < s["passes"] < 256 and s["ops_ratio"] == pytest.approx(s["ops_per_pass"] / a["ops_per_pass"])
        assert s["ops"] == s["ops_target"] + s["ops_draft"] + s["ops_other"]
        assert s["ops_per_drafted_token"] > 0 and s["draft_by_step"]["down"]["tokens"] >= 15 * 16
    assert out["bs1"]["ar"]["ops_per_forward"] == out["bs2"]["ar"]["ops_per_forward"]  # a batch adds no op
    assert out["bs2"]["ssd"]["stream"] and not out["bs2"]["ssd_paper"]["stream"] and not out["bs1"]["ssd"]["stream"]
    assert "batch 2:" in capsys.readouterr().out


def test_batch_costs_cli_times_ar_in_a_batch_and_ssd_as_a_stream(tmp_path, tiny_exports, capsys):
    """analysis.batch_costs on the tiny world at batch 2: AR decodes one fixed batch (256 passes, one position a row a
    pass but the end-of-row tokens), SSD a stream of two slots (rows: both slots' CFG rows); the row-positions and the
    positions computed per image, the ratios and both ceilings follow from the measured parts by hand."""
    from specgen.analysis import batch_costs

    out = batch_costs.main([*_world(tiny_exports), "--out", str(tmp_path), "--strategy", "ssd"])
    saved = json.loads((tmp_path / "batch_costs.json").read_text())
    assert saved["batch"] == 2 and list(saved["strategies"]) == ["ar", "ssd"]
    ar_, ssd_ = out["strategies"]["ar"], out["strategies"]["ssd"]
    assert ar_["passes"] == 256 and ar_["rows"] == ssd_["rows"] == 4  # 2 images x (conditional, unconditional)
    assert 1.0 <= ar_["positions_per_forward"] < 1.1 and ssd_["positions_per_forward"] > 2
    assert ar_["row_positions_per_image"] == pytest.approx(255 * ar_["positions_per_forward"] * 4 / 2)
    for r in (ar_, ssd_):
        assert r["wall_s"] == pytest.approx(r["target_s"] + r["draft_s"] + r["other_s"])
        assert r["ceiling_forwards"] == pytest.approx(ar_["wall_s"] / r["target_s"])
        assert r["compute_ratio"] == pytest.approx(r["computed_per_image"] / ar_["computed_per_image"])
    assert ar_["computed_per_image"] == ar_["row_positions_per_image"]  # a fixed batch computes its whole grid
    # the stream is packed: it computes its images' own tokens, fewer than its padded grid's row-positions
    assert 0 < ssd_["computed_per_image"] < ssd_["row_positions_per_image"]
    assert ssd_["draft_s"] > 0 == ar_["draft_s"] and ssd_["passes"] < 128
    assert ssd_["ceiling_ar_cost"] == pytest.approx(ar_["target_s"] / (ssd_["computed_per_image"]
                                                                     * ar_["step_s"] / ar_["rows"]))
    assert "ceiling fwd" in capsys.readouterr().out
