"""Where CSpD's acceptance goes: the trajectory log density ratio, step by step.

For a batch of test prompts the target pre-fills its first MAR steps; the draft then drafts the next
step in the same context (so draft and target see identical known tokens), and for every drafted token
the log ratio log p(tau)/q(tau) is split into its per-step terms

    c_i = log N(x^q_{i-1}; mu_p, var_p) - log N(x^q_{i-1}; mu_q(x^q_i), var_q)

with mu_p at the target's own aligned state ('aligned', the paper's estimate) or at the draft's state
('exact'). Terms are summed over the token's dimensions and reported per band of sampling steps, with
the step's noise scale sigma and the standardised mean gap |mu_p - mu_q| / sigma, so one sees which part
of the chain decides acceptance. The last (deterministic) step carries no density.

With `--costs B`, it also times the pieces a full generation of B images is made of, on this machine:
the transformer passes (one condition set per MAR step), the heads' chains run step by step (sampling)
and evaluated in one batched call (CSpD's exact verification), for target and draft; from these, the
time of target-only sampling and the floor of CSpD's time when every draft is accepted.

    python -m specgen.evaluation.cspd_trace --out logs/cspd_trace [--backbone checkpoints/mar_p2_shapes ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specgen.decoding.cspd_core import evaluate_on, gauss_logpdf as _terms, run_chain
from specgen.decoding.mar import MARState, cfg_at, conditioning, head_step_fn, mar_step, model_conditions, schedule
from specgen.decoding.sampling import make_generators
from specgen.utils.checkpoints import atomic_write_text


@torch.no_grad()
def trace(target, draft, prompts: list[str], seeds: list[int], num_iter: int = 16, cfg_scale: float = 3.0,
          cfg_schedule: str = "linear", prefill_ratio: float = 0.05) -> dict:
    """Per-step log-ratio terms (N tokens x K steps) of one drafted MAR step, aligned and exact."""
    st = MARState(target, prompts, make_generators(seeds), cfg_scale)
    cond_t, null_t = conditioning(target, prompts, cfg_scale)
    cond_d, null_d = conditioning(draft, prompts, cfg_scale)
    sched, si = schedule(st.L, num_iter), 0
    while si < len(sched) - 1 and st.known < prefill_ratio * st.L:
        mar_step(target, st, cond_t, null_t, sched[si], cfg_scale, cfg_schedule, 1.0)
        st.known, si = sched[si], si + 1
    idx, chain, _ = mar_step(draft, st, cond_d, null_d, sched[si], cfg_scale, cfg_schedule, 1.0,
                             tokens=st.tokens.clone())
    zc, zu = model_conditions(target, st.tokens, (st.rank >= st.known).float(), cond_t, null_t, cfg_scale)
    step_p = head_step_fn(target, zc[idx], None if zu is None else zu[idx], cfg_at(cfg_scale, cfg_schedule,
                                                                                   st.known, st.L))
    nz = st.noise[idx]
    own = run_chain(step_p, nz[:, 0], [nz[:, k + 1] for k in range(st.K)])  # aligned: same noise
    ex_means, ex_vars = evaluate_on(step_p, chain.states)
    K = st.K
    out = {"aligned": [], "exact": [], "sigma": [], "gap_aligned": [], "gap_exact": []}
    for k in range(K):
        q = _terms(chain.states[k + 1], chain.means[k], chain.vars[k])
        out["aligned"].append(_terms(chain.states[k + 1], own.means[k], own.vars[k]) - q)
        out["exact"].append(_terms(chain.states[k + 1], ex_means[k], ex_vars[k]) - q)
        sigma = chain.vars[k].clamp_min(1e-30).sqrt()
        out["sigma"].append(sigma.mean(-1))
        out["gap_aligned"].append(((own.means[k] - chain.means[k]).abs() / sigma).mean(-1))
        out["gap_exact"].append(((ex_means[k] - chain.means[k]).abs() / sigma).mean(-1))
    res = {k: torch.stack(v, 1) for k, v in out.items()}  # (N, K), column k = k-th sampling step (noisiest first)
    res["final_gap"] = (own.sample - chain.sample).norm(dim=-1)  # aligned chains' end points
    res["drafted_step"] = si
    res["known"] = st.known
    return res


def bands(res: dict, num_bands: int = 10) -> list[dict]:
    """Mean per-token statistics over bands of sampling steps (noisiest band first)."""
    K = res["aligned"].shape[1]
    edges = [round(b * K / num_bands) for b in range(num_bands + 1)]
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        live = res["sigma"][:, lo:hi] > 1e-12
        rows.append({"steps": f"{lo + 1}-{hi}", "sigma": float(res["sigma"][:, lo:hi][live].mean()) if live.any() else 0.0,
                     "gap_aligned": float(res["gap_aligned"][:, lo:hi][live].mean()) if live.any() else 0.0,
                     "gap_exact": float(res["gap_exact"][:, lo:hi][live].mean()) if live.any() else 0.0,
                     "logr_aligned": float(res["aligned"][:, lo:hi].sum(1).mean()),
                     "logr_exact": float(res["exact"][:, lo:hi].sum(1).mean())})
    return rows


def summary(res: dict) -> dict:
    tot = {r: res[r].sum(1) for r in ("aligned", "exact")}
    out = {"tokens": int(res["aligned"].shape[0]), "drafted_step": res["drafted_step"], "known": res["known"],
           "final_gap_median": float(res["final_gap"].median())}
    for r, v in tot.items():
        out[f"{r}/median_logr"] = float(v.median())
        out[f"{r}/accept"] = float(torch.exp(v.clamp_max(0)).mean())  # expected acceptance min(1, p/q)
    return out


def _clock(fn, repeats: int = 2) -> float:
    import time

    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


@torch.no_grad()
def costs(target, draft, batch: int, num_iter: int = 16, cfg_scale: float = 3.0) -> dict:
    """Seconds per generation of `batch` images for each piece of target-only sampling and of CSpD."""
    from specgen.decoding.cspd_core import evaluate_on, run_chain

    L, K, d = target.seq_len, target.diffusion.sample_steps, target.token_dim
    prompts = ["a photo of a red circle"] * batch
    tokens = torch.randn(batch, L, d)
    out = {}
    for name, m in (("target", target), ("draft", draft)):
        cond, null = m.condition(prompts), m.null_condition(batch)
        sets = []
        for known in [0] + schedule(L, num_iter)[:-1]:  # one condition set per MAR step, as sampling does
            mask = torch.ones(batch, L)
            mask[:, :known] = 0
            sets.append(mask)
        out[f"{name}/transformer"] = sum(_clock(lambda mk=mk: model_conditions(m, tokens, mk, cond, null, cfg_scale),
                                                1) for mk in sets)
        n = batch * L // num_iter  # tokens of an average step
        z = torch.randn(n, m.decoder_norm.normalized_shape[0])
        step = head_step_fn(m, z, z, cfg_scale)
        noise = [torch.randn(n, d) for _ in range(K)]
        chain = run_chain(step, torch.randn(n, d), noise)
        out[f"{name}/head_sampling"] = num_iter * _clock(lambda: run_chain(step, chain.states[0], noise), 1)
        out[f"{name}/head_batched_eval"] = num_iter * _clock(lambda: evaluate_on(step, chain.states), 1)
    out["target_only"] = out["target/transformer"] + out["target/head_sampling"]
    # every draft accepted, exact ratio: the draft samples everything, the target verifies every token in
    # batched calls; stepwise verification computes as many condition sets as target-only sampling does
    out["cspd_floor"] = (out["draft/transformer"] + out["draft/head_sampling"] + out["target/transformer"]
                         + out["target/head_batched_eval"])
    out["cspd_ceiling_speedup"] = out["target_only"] / out["cspd_floor"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", default="checkpoints/mar_p2_shapes")
    ap.add_argument("--draft", default="checkpoints/mar_p2_shapes_draft")
    ap.add_argument("--prompts", type=int, default=16, help="test prompts (GenEval tasks in turn)")
    ap.add_argument("--cfg-scale", type=float, default=3.0)
    ap.add_argument("--prefill-ratio", type=float, default=0.05)
    ap.add_argument("--costs", type=int, nargs="*", default=[], metavar="B",
                    help="also time the pieces of a generation at these batch sizes")
    ap.add_argument("--out", default="logs/cspd_trace")
    a = ap.parse_args(argv)
    from specgen.utils.checkpoints import load_exported
    from specgen.world.prompts import TAGS, prompts as task_prompts

    target, draft = load_exported(a.backbone).eval(), load_exported(a.draft).eval()
    pool = [task_prompts(t, "test") for t in TAGS]
    texts = [pool[i % len(pool)][i // len(pool) % len(pool[i % len(pool)])]["prompt"] for i in range(a.prompts)]
    res = trace(target, draft, texts, list(range(a.prompts)), cfg_scale=a.cfg_scale, prefill_ratio=a.prefill_ratio)
    rows, summ = bands(res), summary(res)
    lines = [f"{'steps':>8} {'sigma':>10} {'gap al.':>9} {'gap ex.':>9} {'logr al.':>10} {'logr ex.':>10}"]
    lines += [f"{r['steps']:>8} {r['sigma']:10.4f} {r['gap_aligned']:9.3f} {r['gap_exact']:9.3f} "
              f"{r['logr_aligned']:10.2f} {r['logr_exact']:10.2f}" for r in rows]
    lines.append(json.dumps(summ))
    cost_rows = {b: costs(target, draft, b, cfg_scale=a.cfg_scale) for b in a.costs}
    if cost_rows:
        keys = list(next(iter(cost_rows.values())))
        lines.append(f"{'seconds per generation':<26}" + "".join(f"{f'batch {b}':>12}" for b in cost_rows))
        lines += [f"{k:<26}" + "".join(f"{cost_rows[b][k]:12.3f}" for b in cost_rows) for k in keys]
    print("\n".join(lines))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "trace.json", json.dumps({"summary": summ, "bands": rows,
                                                                  "costs": cost_rows}, indent=1))
    atomic_write_text(out / "trace.txt", "\n".join(lines) + "\n")
    return {"summary": summ, "bands": rows, "costs": cost_rows}


if __name__ == "__main__":
    main()
