"""Where CSpD's acceptance goes: the trajectory log ratios of one drafted MAR step, step by step.

For a batch of test prompts the target pre-fills its first MAR steps and the draft drafts the next one, both
with the decoder's own code (`specgen.decoding.cspd`: prefill, draft_steps, target_view, own_chain), so the
target sees exactly the draft's context. For every drafted token it splits

* the exact ratio (target transitions on the draft's chain) into per-step terms
  c_i = log N(x^q_{i-1}; mu_p(x^q_i), var_p) - log N(x^q_{i-1}; mu_q(x^q_i), var_q),
* the earlier 'aligned' reading the same way, with mu_p at the target's own aligned state,
* the paper's ratio into its per-step normalisers sum_d log(sigma^q / sigma^p) (target chain aligned, or with
  independent noise) and its last-step term -|x^q_0 - x^p_0|^2 / (2 T^2 sigma_f^2), reported as the expected
  acceptance E min(1, r) at each inner temperature T asked for, with and without alignment, with the normalisers
  signed as the authors' code does (`paper`, minus the sum above) and as the densities do (`paper_derivation`);

per band of sampling steps, with the step's noise scale sigma and the standardised mean gaps |mu_p - mu_q| / sigma.

With `--costs B`, it also times the pieces a generation of B images is made of, on this machine: the
transformer (one condition set), the heads' chains run step by step (sampling) and evaluated in one batched
call (the exact ratio's verification), for target and draft; from these, target-only time and the floor of
CSpD's time with every draft accepted, for the paper's setting (joint verification, the target's own chains)
and the exact ratio's (stepwise verification, batched evaluation).

    python -m specgen.analysis.cspd_trace --backbone checkpoints/mar_p2_shapes \\
        --draft checkpoints/mar_p2_shapes_draft --out logs/cspd_trace --costs 1 16
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from specgen.decoding import cspd
from specgen.decoding.cspd_core import evaluate_on, gauss_logpdf, run_chain
from specgen.decoding.mar import conditioning, head_step_fn, step_conditions
from specgen.decoding.sampling import make_rngs
from specgen.utils.checkpoints import atomic_write_text, load_exported
from specgen.world.prompts import TAGS, prompts as task_prompts


@torch.no_grad()
def trace(target, draft, prompts: list[str], seeds: list[int], num_iter: int = 16, cfg_scale: float = 3.0,
          cfg_schedule: str = "linear", prefill_ratio: float = 0.05) -> dict:
    """Per-step terms (N tokens x K steps) of the first drafted step's ratios, and the chains' end gaps."""
    s = cspd.start(target, draft, prompts, make_rngs(seeds), num_iter, cfg_scale, cfg_schedule)
    sched = s.st.schedule
    si = min(cspd.prefill_steps(prefill_ratio, len(sched)), len(sched) - 1)  # at least one step is drafted
    cspd.prefill(s, sched[:si])
    drafted, d_tokens = cspd.draft_steps(s, [sched[si]])
    step_p = s.head(target, *cspd.target_view(s, drafted, d_tokens, stepwise=False))  # one step: joint = stepwise
    (rows, pos), chain = drafted[0].idx, drafted[0].chain
    own, ind = (cspd.own_chain(s, step_p, rows, pos, align) for align in (True, False))
    ex_means, ex_vars = evaluate_on(step_p, chain.states)
    out = {k: [] for k in ("aligned", "exact", "norm_aligned", "norm_indep", "sigma", "gap_aligned", "gap_exact")}
    for k in range(s.st.K):
        q = gauss_logpdf(chain.states[k + 1], chain.means[k], chain.vars[k])
        out["aligned"].append(gauss_logpdf(chain.states[k + 1], own.means[k], own.vars[k]) - q)
        out["exact"].append(gauss_logpdf(chain.states[k + 1], ex_means[k], ex_vars[k]) - q)
        for name, other in (("norm_aligned", own), ("norm_indep", ind)):
            live = (chain.vars[k] > 0) & (other.vars[k] > 0)
            log_ratio = 0.5 * (chain.vars[k].clamp_min(1e-30).log() - other.vars[k].clamp_min(1e-30).log())
            out[name].append(torch.where(live, log_ratio, torch.zeros_like(log_ratio)).sum(-1))
        sigma = chain.vars[k].clamp_min(1e-30).sqrt()
        out["sigma"].append(sigma.mean(-1))
        out["gap_aligned"].append(((own.means[k] - chain.means[k]).abs() / sigma).mean(-1))
        out["gap_exact"].append(((ex_means[k] - chain.means[k]).abs() / sigma).mean(-1))
    res = {k: torch.stack(v, 1) for k, v in out.items()}  # (N, K), column k = k-th sampling step (noisiest first)
    res["end_gap2_aligned"] = (own.sample - chain.sample).pow(2).sum(-1)  # |x^q_0 - x^p_0|^2
    res["end_gap2_indep"] = (ind.sample - chain.sample).pow(2).sum(-1)
    res.update(final_std=target.final_std(), drafted_step=si, known=s.st.known)
    return res


def bands(res: dict, num_bands: int = 10) -> list[dict]:
    """Mean per-token statistics over bands of sampling steps (noisiest band first)."""
    K = res["aligned"].shape[1]
    edges = [round(b * K / num_bands) for b in range(num_bands + 1)]
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        live = res["sigma"][:, lo:hi] > 1e-12
        mean_live = lambda key: float(res[key][:, lo:hi][live].mean()) if live.any() else 0.0
        rows.append({"steps": f"{lo + 1}-{hi}", "sigma": mean_live("sigma"), "gap_aligned": mean_live("gap_aligned"),
                     "gap_exact": mean_live("gap_exact"),
                     **{f"logr_{k}": float(res[k][:, lo:hi].sum(1).mean())
                        for k in ("aligned", "exact", "norm_aligned", "norm_indep")}})
    return rows


def summary(res: dict, inner_temperatures=(5.0, 42.0)) -> dict:
    """Median log ratios and expected acceptance E min(1, p/q) of each ratio (the paper's per inner temperature)."""
    alpha = lambda logr: float(torch.exp(logr.clamp_max(0)).mean())
    out = {"tokens": int(res["aligned"].shape[0]), "drafted_step": res["drafted_step"], "known": res["known"],
           "final_std": res["final_std"], "end_gap_median": float(res["end_gap2_aligned"].sqrt().median()),
           "end_gap_median_noalign": float(res["end_gap2_indep"].sqrt().median())}
    for r in ("aligned", "exact"):
        out[f"{r}/median_logr"] = float(res[r].sum(1).median())
        out[f"{r}/accept"] = alpha(res[r].sum(1))
    for T in inner_temperatures:  # the normalisers as the authors' code signs them (paper) and as the densities do
        width2 = (T * res["final_std"]) ** 2
        for name, norm, gap2 in (("paper", "norm_aligned", "end_gap2_aligned"),
                                 ("paper_noalign", "norm_indep", "end_gap2_indep")):
            out[f"{name}/T{T:g}/accept"] = alpha(-res[norm].sum(1) - 0.5 * res[gap2] / width2)
            out[f"{name}_derivation/T{T:g}/accept"] = alpha(res[norm].sum(1) - 0.5 * res[gap2] / width2)
    return out


def _clock(fn, repeats: int = 2) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


@torch.no_grad()
def costs(target, draft, batch: int, num_iter: int = 16, cfg_scale: float = 3.0, gamma: int = 4,
          prefill_ratio: float = 0.05) -> dict:
    """Seconds per generation of `batch` images for each piece of target-only sampling and of CSpD."""
    L, K, d = target.seq_len, target.num_steps, target.token_dim
    prompts = target.prompts(["a photo of a red circle"] * batch)
    tokens = torch.randn(batch, L, d, device=target.device)
    rank, sched = target.plan(make_rngs(range(batch), target.device), num_iter)
    num_iter = len(sched)
    out = {}
    for name, m in (("target", target), ("draft", draft)):
        conds = conditioning(m, prompts, cfg_scale)
        sets = [(rank >= known).float() for known in [0] + sched[:-1]]  # one condition set per step, as sampling
        run = lambda mk: step_conditions(m, tokens, mk, conds, cfg_scale != 1.0)
        out[f"{name}/transformer"] = sum(_clock(lambda mk=mk: run(mk), 1) for mk in sets)
        n = batch * L // num_iter  # tokens of an average step
        zc, zu = run(sets[0])
        z, zu = zc.flatten(0, 1)[:n], None if zu is None else zu.flatten(0, 1)[:n]  # real conditions, (n, D)
        step = head_step_fn(m, z, zu, cfg_scale)
        noise = [torch.randn(n, d, device=target.device) for _ in range(K)]
        chain = run_chain(step, torch.randn(n, d, device=target.device), noise)
        out[f"{name}/head_sampling"] = num_iter * _clock(lambda: run_chain(step, chain.states[0], noise), 1)
        out[f"{name}/head_batched_eval"] = num_iter * _clock(lambda: evaluate_on(step, chain.states), 1)
    out["target_only"] = out["target/transformer"] + out["target/head_sampling"]
    drafting = out["draft/transformer"] + out["draft/head_sampling"]
    # every draft accepted. Paper (joint): one target condition set per pre-filled step and per round, and the
    # target's own chain for every drafted token (its arithmetic is the target's sampling). Exact (stepwise): as
    # many condition sets as target-only sampling, and the target's head evaluated on the draft's chains, batched.
    pre = cspd.prefill_steps(prefill_ratio, num_iter)
    paper_sets = pre + math.ceil((num_iter - pre) / gamma)
    out["cspd_paper_floor"] = drafting + out["target/transformer"] * paper_sets / num_iter + out["target/head_sampling"]
    out["cspd_exact_floor"] = drafting + out["target/transformer"] + out["target/head_batched_eval"]
    out["paper_ceiling_speedup"] = out["target_only"] / out["cspd_paper_floor"]
    out["exact_ceiling_speedup"] = out["target_only"] / out["cspd_exact_floor"]
    return out


def _lines(rows: list[dict], summ: dict, cost_rows: dict) -> list[str]:
    heads = ("steps", "sigma", "gap al.", "gap ex.", "logr al.", "logr ex.", "norm al.", "norm ind.")
    lines = ["".join(f"{h:>11}" for h in heads)]
    lines += [f"{r['steps']:>11}{r['sigma']:11.4f}{r['gap_aligned']:11.3f}{r['gap_exact']:11.3f}"
              f"{r['logr_aligned']:11.2f}{r['logr_exact']:11.2f}{r['logr_norm_aligned']:11.2f}"
              f"{r['logr_norm_indep']:11.2f}" for r in rows]
    lines.append(json.dumps(summ))
    if cost_rows:
        keys = list(next(iter(cost_rows.values())))
        lines.append(f"{'seconds per generation':<26}" + "".join(f"{f'batch {b}':>12}" for b in cost_rows))
        lines += [f"{k:<26}" + "".join(f"{cost_rows[b][k]:12.3f}" for b in cost_rows) for k in keys]
    return lines


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", required=True, help="exported MAR target folder (e.g. checkpoints/mar_p2_shapes)")
    ap.add_argument("--draft", required=True, help="exported MAR draft folder (e.g. checkpoints/mar_p2_shapes_draft)")
    ap.add_argument("--out", required=True, help="folder for trace.json and trace.txt")
    ap.add_argument("--prompts", type=int, default=16, help="test prompts (GenEval tasks in turn)")
    ap.add_argument("--cfg-scale", type=float, default=3.0)
    ap.add_argument("--prefill-ratio", type=float, default=0.05)
    ap.add_argument("--gamma", type=int, default=4, help="drafted steps per round (for the cost floors)")
    ap.add_argument("--num-iter", type=int, default=16,
                    help="MAR steps (16: the tables measured so far; 64: one token per step, the decoders' default)")
    ap.add_argument("--inner-temperatures", type=float, nargs="+", default=[5.0, 42.0])
    ap.add_argument("--costs", type=int, nargs="*", default=[], metavar="B",
                    help="also time the pieces of a generation at these batch sizes")
    a = ap.parse_args(argv)
    target, draft = load_exported(a.backbone).eval(), load_exported(a.draft).eval()
    pool = [task_prompts(t, "test") for t in TAGS]
    texts = [pool[i % len(pool)][i // len(pool) % len(pool[i % len(pool)])]["prompt"] for i in range(a.prompts)]
    res = trace(target, draft, texts, list(range(a.prompts)), num_iter=a.num_iter, cfg_scale=a.cfg_scale,
                prefill_ratio=a.prefill_ratio)
    rows, summ = bands(res), summary(res, a.inner_temperatures)
    cost_rows = {b: costs(target, draft, b, num_iter=a.num_iter, cfg_scale=a.cfg_scale, gamma=a.gamma,
                          prefill_ratio=a.prefill_ratio) for b in a.costs}
    lines = _lines(rows, summ, cost_rows)
    print("\n".join(lines))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "trace.json", json.dumps({"num_iter": a.num_iter, "summary": summ, "bands": rows,
                                                          "costs": cost_rows}, indent=1))
    atomic_write_text(out / "trace.txt", "\n".join(lines) + "\n")
    return {"summary": summ, "bands": rows, "costs": cost_rows}


if __name__ == "__main__":
    main()
