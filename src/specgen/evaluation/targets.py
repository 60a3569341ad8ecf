"""The targets a side-by-side speed run checks after its table (`targets:` in an experiment config, e.g.
`experiment=eval/discrete_speed`): one strategy against the run's reference (its first strategy), each target with the
measured value, its goal, its floor and a verdict:

- `met`: at or past the goal; `floor`: short of the goal, at or past the floor; `missed`: short of the floor;
- `not measured`: the run lacks the metric (a speed-only run has no GenEval; a batch size the run did not time).

The checks read the run's metrics only, so they say what this run measured, on this machine, with its sample sizes.

    targets:
      strategy: ssd                       # the strategy the targets are for
      pass_ratio_bs1: [8.0, 6.0]          # goal, floor: times fewer target passes than the reference at batch 1
      wall_ratio_bs1: [3.5, 3.0]          # goal, floor: times the reference's wall clock at batch 1
      wall_ratio_bs16: [1.3, 1.0]         # the same at batch 16 (a run that times batch 16)
      batch_share: [16, 0.85]             # batch size, least share of the batch-1 pass ratio kept there
      ops_ratio_bs1: 1.5                  # at most this many times the reference's aten ops per pass, batch 1
                                          # (a run with speed.count_ops)
      geneval_max_ci95: 0.03              # GenEval not significantly below the reference's, at intervals this tight
      peers: [sjd, zipar]                 # strategies it must beat in passes at batch 1 (at equal quality)
      also: [ssd_latent]                  # other strategies held to the same targets, each in its own block
                                          # (those the run leaves out are skipped)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

def _verdict(value: float | None, goal: float, floor: float | None = None) -> str:
    if value is None:
        return "not measured"
    if value >= goal:
        return "met"
    return "floor" if floor is not None and value >= floor else "missed"


def _pair(spec: Mapping, key: str) -> tuple[float, float]:
    value = spec[key]
    if not isinstance(value, Sequence) or len(value) != 2 or not all(isinstance(v, (int, float)) for v in value):
        raise ValueError(f"targets.{key}={value!r}: give [goal, floor] as two numbers, e.g. [8.0, 6.0]")
    goal, floor = float(value[0]), float(value[1])
    if floor > goal:
        raise ValueError(f"targets.{key}={value!r}: the floor ({floor}) is above the goal ({goal}); give [goal, floor]")
    return goal, floor


def validate_targets(spec: Mapping, strategies: Sequence[str]) -> None:
    """Refuse a malformed `targets:` node before a run spends its time: unknown keys, a target strategy the run does
    not decode (`strategies`), a [goal, floor] that is not two numbers or has its floor above its goal, a batch share
    that is not [batch size, share in (0, 1]]. Peers the run leaves out are allowed: they read `not measured`."""
    known = {"strategy", "pass_ratio_bs1", "wall_ratio_bs1", "wall_ratio_bs16", "batch_share", "ops_ratio_bs1",
             "geneval_max_ci95", "peers", "also"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"targets: unknown keys {unknown}: expected some of {sorted(known)}")
    if spec.get("strategy") not in strategies:
        raise ValueError(f"targets.strategy={spec.get('strategy')!r}: name one of the run's strategies "
                         f"{list(strategies)} (targets.strategy=ssd)")
    also = spec.get("also") or []
    if not (isinstance(also, Sequence) and not isinstance(also, str) and all(isinstance(a, str) for a in also)):
        raise ValueError(f"targets.also={also!r}: give a list of strategy names, e.g. [ssd_latent]")
    for key in ("pass_ratio_bs1", "wall_ratio_bs1", "wall_ratio_bs16"):
        if key in spec:
            _pair(spec, key)
    if "ops_ratio_bs1" in spec and not (isinstance(spec["ops_ratio_bs1"], (int, float)) and spec["ops_ratio_bs1"] > 0):
        raise ValueError(f"targets.ops_ratio_bs1={spec['ops_ratio_bs1']!r}: give the most ops per pass as a multiple of "
                         f"the reference's, a positive number, e.g. 1.5")
    if "batch_share" in spec:
        value = spec["batch_share"]
        if not (isinstance(value, Sequence) and len(value) == 2 and isinstance(value[0], int) and value[0] > 1
                and isinstance(value[1], (int, float)) and 0 < value[1] <= 1):
            raise ValueError(f"targets.batch_share={value!r}: give [batch size above 1, share in (0, 1]], e.g. "
                             f"[16, 0.85]")


def check_targets(metrics: Mapping[str, float], spec: Mapping, reference: str) -> list[dict]:
    """The verdict of each target in `spec` (the experiment's `targets:` node, checked by `validate_targets`) from a
    speed run's `metrics`, whose reference strategy is `reference`. Each row: target, value, goal, floor, verdict,
    detail."""
    s = spec["strategy"]
    get = lambda key: metrics.get(f"{s}/{key}")  # noqa: E731
    rows = []
    for key, metric, what in (("pass_ratio_bs1", "speed/nfe_ratio_bs1", "target passes"),
                              ("wall_ratio_bs1", "speed/wall_ratio_bs1", "wall clock"),
                              ("wall_ratio_bs16", "speed/wall_ratio_bs16", "wall clock")):
        if key in spec:
            goal, floor = _pair(spec, key)
            value = get(metric)
            ci = get(metric.replace("_ratio", "_ratio_ci95")) if "nfe" in metric else None
            batch = key.rsplit("_bs", 1)[1]
            rows.append(dict(target=f"{key}: {reference}'s {what} over {s}'s, batch {batch}", value=value, goal=goal,
                             floor=floor,
                             verdict=_verdict(value, goal, floor),
                             detail="" if ci is None else f"+-{ci:.2f} (95%)"))
    if "batch_share" in spec:
        batch, share = spec["batch_share"]
        one, many = get("speed/nfe_ratio_bs1"), get(f"speed/nfe_ratio_bs{int(batch)}")
        value = None if one is None or many is None else many / one
        rows.append(dict(target=f"batch_share: pass ratio at batch {int(batch)} over batch 1's", value=value,
                         goal=float(share), floor=None, verdict=_verdict(value, float(share)),
                         detail="" if value is None else f"{many:.2f}x against {one:.2f}x"))
    if "ops_ratio_bs1" in spec:  # a most: lower is better
        most, value = float(spec["ops_ratio_bs1"]), get("speed/ops_ratio_bs1")
        per, ref_per = get("speed/ops_per_pass_bs1"), metrics.get(f"{reference}/speed/ops_per_pass_bs1")
        rows.append(dict(target=f"ops_ratio_bs1: {s}'s aten ops per pass over {reference}'s, batch 1 (at most)",
                         value=value, goal=most, floor=None,
                         verdict="not measured" if value is None else "met" if value <= most else "missed",
                         detail="" if value is None else f"{per:.0f} against {ref_per:.0f}"))
    if "geneval_max_ci95" in spec:
        diff, ci = get("geneval/overall_diff"), get("geneval/overall_diff_ci95")
        own, ref = get("geneval/overall_ci95"), metrics.get(f"{reference}/geneval/overall_ci95")
        limit = float(spec["geneval_max_ci95"])
        if diff is None or ci is None or own is None or ref is None:
            verdict, value, detail = "not measured", None, "no GenEval in this run"
        else:
            value = diff + ci  # the paired difference's upper 95% end: below 0 means significantly worse
            tight = max(own, ref) <= limit
            verdict = "met" if value >= 0 and tight else "missed"
            detail = (f"paired {diff:+.3f} +-{ci:.3f}; intervals +-{own:.3f} / +-{ref:.3f} "
                      f"({'within' if tight else 'wider than'} +-{limit:.2f})")
        rows.append(dict(target=f"geneval: upper 95% end of {s}'s minus {reference}'s",
                         value=value, goal=0.0, floor=None, verdict=verdict, detail=detail))
    for peer in spec.get("peers") or []:
        own, other = get("speed/nfe_bs1"), metrics.get(f"{peer}/speed/nfe_bs1")
        value = None if own is None or other is None else other / own
        quality = metrics.get(f"{peer}/geneval/overall_diff")
        rows.append(dict(target=f"peers: {peer}'s target passes over {s}'s, batch 1", value=value, goal=1.0,
                         floor=None, verdict="not measured" if value is None else "met" if value > 1.0 else "missed",
                         detail="" if quality is None else f"{peer}'s GenEval minus {reference}'s: {quality:+.3f}"))
    return rows


def format_targets(rows: list[dict], strategy: str) -> str:
    """The verdicts as the lines a run prints under its table."""
    if not rows:
        return ""
    w = max(len(r["target"]) for r in rows) + 2
    lines = [f"targets of {strategy}:"]
    for r in rows:
        value = "-" if r["value"] is None else f"{r['value']:.2f}"
        goal = f"{r['goal']:.2f}" + ("" if r["floor"] is None else f" (floor {r['floor']:.2f})")
        lines.append(f"  {r['target']:<{w}}{value:>8}  goal {goal:<20}{r['verdict']:<14}{r['detail']}".rstrip())
    return "\n".join(lines)


def targets_report(metrics: Mapping[str, float], spec: Mapping, reference: str, strategies: Sequence[str]) -> str:
    """The blocks a run prints under its table: `spec["strategy"]`'s, then one for each of `spec["also"]` that the run
    decoded (`strategies`), each held to the same targets."""
    names = [spec["strategy"]] + [a for a in spec.get("also") or [] if a in strategies and a != spec["strategy"]]
    return "\n\n".join(format_targets(check_targets(metrics, dict(spec, strategy=name), reference), name)
                       for name in names)
