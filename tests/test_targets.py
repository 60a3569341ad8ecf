"""The targets a speed run checks under its table, from hand-made metrics."""
import pytest

from specgen.evaluation.targets import check_targets, format_targets, targets_report, validate_targets

SPEC = dict(strategy="ssd", pass_ratio_bs1=[8.0, 6.0], wall_ratio_bs1=[3.5, 3.0], wall_ratio_bs16=[1.3, 1.0],
            batch_share=[16, 0.85],
            geneval_max_ci95=0.03, peers=["sjd", "zipar"])


def metrics(**over):
    m = {"ssd/speed/nfe_ratio_bs1": 6.5, "ssd/speed/nfe_ratio_ci95_bs1": 0.3, "ssd/speed/wall_ratio_bs1": 3.6,
         "ssd/speed/wall_ratio_bs16": 1.1,
         "ssd/speed/nfe_ratio_bs16": 5.0, "ssd/speed/nfe_bs1": 40.0, "sjd/speed/nfe_bs1": 80.0,
         "zipar/speed/nfe_bs1": 30.0, "ssd/geneval/overall_diff": -0.01, "ssd/geneval/overall_diff_ci95": 0.03,
         "ssd/geneval/overall_ci95": 0.024, "ar/geneval/overall_ci95": 0.025, "zipar/geneval/overall_diff": -0.2}
    m.update(over)
    return {k: v for k, v in m.items() if v is not None}


def verdicts(m):
    """target -> (value, verdict); a peer's target as `peers:<name>`."""
    out = {}
    for r in check_targets(m, SPEC, "ar"):
        key, _, rest = r["target"].partition(": ")
        out[key + (":" + rest.split("'")[0] if key == "peers" else "")] = (r["value"], r["verdict"])
    return out


def test_each_target_is_met_at_its_floor_or_missed_by_hand():
    v = verdicts(metrics())
    assert v["pass_ratio_bs1"] == (6.5, "floor")  # past the floor 6, short of the goal 8
    assert v["wall_ratio_bs1"] == (3.6, "met")
    assert v["wall_ratio_bs16"] == (1.1, "floor")  # past the floor 1, short of 1.3
    assert v["batch_share"][0] == pytest.approx(5.0 / 6.5) and v["batch_share"][1] == "missed"  # 0.77 < 0.85
    assert v["geneval"][0] == pytest.approx(0.02) and v["geneval"][1] == "met"  # -0.01 + 0.03 >= 0, both tight
    assert v["peers:sjd"] == (2.0, "met") and v["peers:zipar"] == (0.75, "missed")  # zipar took fewer passes
    v = verdicts(metrics(**{"ssd/speed/nfe_ratio_bs1": 8.0, "ssd/speed/wall_ratio_bs1": 2.9}))
    assert v["pass_ratio_bs1"] == (8.0, "met") and v["wall_ratio_bs1"] == (2.9, "missed")


def test_geneval_is_missed_when_significantly_below_or_measured_too_loosely():
    below = verdicts(metrics(**{"ssd/geneval/overall_diff": -0.05, "ssd/geneval/overall_diff_ci95": 0.03}))
    assert below["geneval"][0] == pytest.approx(-0.02) and below["geneval"][1] == "missed"
    loose = verdicts(metrics(**{"ar/geneval/overall_ci95": 0.05}))  # not below, but the intervals are too wide
    assert loose["geneval"][1] == "missed"


def test_what_the_run_did_not_measure_says_so():
    v = verdicts(metrics(**{"ssd/geneval/overall_diff": None, "ssd/speed/nfe_ratio_bs16": None,
                            "ssd/speed/wall_ratio_bs16": None,
                            "sjd/speed/nfe_bs1": None}))
    assert v["geneval"] == (None, "not measured") and v["batch_share"] == (None, "not measured")
    assert v["wall_ratio_bs16"] == (None, "not measured")
    assert v["peers:sjd"] == (None, "not measured")
    text = format_targets(check_targets(metrics(), SPEC, "ar"), "ssd")
    assert text.startswith("targets of ssd:") and "floor 6.00" in text and "missed" in text
    assert len(text.splitlines()) == 1 + 5 + 2  # a line per target, one per peer


@pytest.mark.parametrize("spec, match", [(dict(SPEC, speedup=2), "unknown keys \\['speedup'\\]"),
                                         (dict(SPEC, pass_ratio_bs1=[6.0, 8.0]), "floor \\(8.0\\) is above"),
                                         (dict(SPEC, wall_ratio_bs1=3.0), "give \\[goal, floor\\]"),
                                         (dict(SPEC, batch_share=[16, 85]), "share in \\(0, 1\\]"),
                                         (dict(SPEC, strategy="sdd"), "targets.strategy='sdd': name one of"),
                                         (dict(SPEC, also="ssd_latent"), "targets.also='ssd_latent': give a list"),
                                         (dict(SPEC, ops_ratio_bs1=[1.5, 1.8]), "ops_ratio_bs1=\\[1.5, 1.8\\]: give"),
                                         ({k: v for k, v in SPEC.items() if k != "strategy"}, "targets.strategy=None")])
def test_a_malformed_spec_names_the_value_and_the_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        validate_targets(spec, ["ar", "ssd", "sjd"])
    validate_targets(SPEC, ["ar", "ssd"])  # the well-formed spec passes, its peers left out of the run included


def test_other_strategies_are_held_to_the_same_targets_in_their_own_blocks():
    """`also`: a block per listed strategy the run decoded, after the main one's; one the run left out is skipped."""
    m = metrics(**{"ssd_latent/speed/nfe_ratio_bs1": 8.2, "ssd_latent/speed/nfe_bs1": 31.0,
                   "ssd_latent/geneval/overall_diff": -0.06, "ssd_latent/geneval/overall_diff_ci95": 0.03,
                   "ssd_latent/geneval/overall_ci95": 0.024})
    spec = dict(SPEC, also=["ssd_latent", "ssd_typical"])
    text = targets_report(m, spec, "ar", ["ar", "ssd", "ssd_latent", "sjd"])
    blocks = text.split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == ["targets of ssd:", "targets of ssd_latent:"]
    latent = {line.split(":")[0].strip(): line for line in blocks[1].splitlines()[1:]}
    assert "8.20" in latent["pass_ratio_bs1"] and latent["pass_ratio_bs1"].split()[-1] == "met"
    assert "missed" in latent["geneval"]  # -0.06 + 0.03 < 0: significantly below AR's
    assert blocks[0] == format_targets(check_targets(m, SPEC, "ar"), "ssd")
    validate_targets(spec, ["ar", "ssd"])  # strategies in `also` may be left out of a run


def test_ops_per_pass_is_a_most_met_at_or_below_it():
    """`ops_ratio_bs1`: lower is better, met at or below the bound, missed above it, not measured without counts."""
    spec = dict(strategy="ssd", ops_ratio_bs1=1.5)
    row = lambda **m: check_targets(m, spec, "ar")[0]  # noqa: E731
    above = row(**{"ssd/speed/ops_ratio_bs1": 1.81, "ssd/speed/ops_per_pass_bs1": 672.0,
                   "ar/speed/ops_per_pass_bs1": 372.0})
    assert above["verdict"] == "missed" and above["detail"] == "672 against 372" and "at most" in above["target"]
    assert row(**{"ssd/speed/ops_ratio_bs1": 1.5, "ssd/speed/ops_per_pass_bs1": 558.0,
                  "ar/speed/ops_per_pass_bs1": 372.0})["verdict"] == "met"
    assert row()["verdict"] == "not measured"
    validate_targets(spec, ["ar", "ssd"])
