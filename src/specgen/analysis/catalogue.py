"""Every table and figure of the two papers on the embedded world, as one command.

    python -m specgen.analysis.catalogue --out logs/figures            # the catalogue's sizes (hours on 2 cores)
    python -m specgen.analysis.catalogue --quick --out logs/figures_quick   # every entry on a few images
    python -m specgen.analysis.catalogue --list                         # entries, paper items, commands

Each entry runs its command (`python -m specgen.eval ...`, a Hydra sweep, or an analysis script) into
`<out>/<entry>/` and logs to `<out>/logs/<entry>.log`. A finished entry leaves `catalogue_done.json` (its command
and time) and is skipped when the catalogue is run again with the same command; an interrupted entry reruns and
takes the images it had already made from the image cache (`data/image_cache/`). Sweeps are collected into
`table.csv` and `pareto.png`. At the end `<out>/README.md` lists every entry: the paper item, the command, its
time and the files it wrote. `--quick` shrinks every entry to a few images and prompts: the same tables and
figures with wide intervals, to check the pipeline end to end (40 minutes from a fresh clone on 2 cores; the
catalogue sizes: about 9 hours, experiments/README.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specgen.evaluation.collect import collect, format_rows, pareto_plot
from specgen.utils.checkpoints import atomic_write_csv, atomic_write_text
from specgen.utils.locations import repo_root

EVAL = ["-m", "specgen.eval"]
CK = "{ck}"  # the shipped checkpoints, wherever the catalogue is run from


@dataclasses.dataclass(frozen=True)
class Entry:
    """One catalogue entry: `args` after `python`, `quick` overrides appended with --quick; `sweep`: a Hydra
    multirun (collected into table.csv + pareto.png, plotting `pareto` = (x, y) metrics)."""
    name: str
    paper: str
    args: tuple[str, ...]
    quick: tuple[str, ...] = ()
    sweep: bool = False
    pareto: tuple[str, str] | None = None

    def command(self, out: Path, quick: bool) -> list[str]:
        """argv of the entry's run into `out`: an analysis script names it with '{out}' in its args, an
        evaluation gets Hydra's run (or sweep) folder. --quick settings replace the entry's own."""
        args = merge(self.args, self.quick) if quick else list(self.args)
        args = [a.replace("{out}", str(out)).replace("{ck}", str(repo_root() / "checkpoints")) for a in args]
        if any("{out}" in a for a in self.args):
            return [sys.executable, *args]
        key = "hydra.sweep.dir" if self.sweep else "hydra.run.dir"
        return [sys.executable, *args, f"{key}={out}"]


def merge(args: tuple[str, ...], changes: tuple[str, ...]) -> list[str]:
    """`args` with `changes` applied: a Hydra override `key=value` replaces the same key's, a flag `--f v ...`
    replaces that flag's values; anything new is appended."""
    out = list(args)
    i = 0
    while i < len(changes):
        item = changes[i]
        if item.startswith("--"):
            j = i + 1
            while j < len(changes) and not changes[j].startswith("--"):
                j += 1
            values = list(changes[i + 1:j])
            if item in out:
                k = out.index(item) + 1
                end = k
                while end < len(out) and not out[end].startswith("--") and "=" not in out[end]:
                    end += 1
                out[k:end] = values
            else:
                out += [item, *values]
            i = j
            continue
        key = item.split("=", 1)[0] + "="
        at = [k for k, a in enumerate(out) if a.startswith(key)]
        if at:
            out[at[0]] = item
        else:
            out.append(item)
        i += 1
    return out


GENEVAL_QUICK = ("benchmark.geneval.prompts_per_task=1", "benchmark.geneval.images_per_task=4")
SPEED_QUICK = ("speed.num_prompts=2", "speed.batch_sizes=[1]")
CSPD_QUICK_GENEVAL = ("benchmark.geneval.prompts_per_task=1", "benchmark.geneval.images_per_task=null",
                      "benchmark.geneval.samples_per_prompt=2", *SPEED_QUICK)
CSPD_QUICK = (*CSPD_QUICK_GENEVAL, "benchmark.fidelity.num_prompts=8")
ENTRIES = (
    Entry("ssd_strategies",
          "SSD: speed-up table (passes, latency per strategy), quality table (GenEval), 1D-MTP vs SJD vs SSD, "
          "per-position acceptance maps",
          (*EVAL, "experiment=eval/discrete_speed"),
          # lockstep speculative decoders (SJD, 1D-MTP, draft model) run faster per image in small batches on a CPU
          (*GENEVAL_QUICK, *SPEED_QUICK, "speed.entropy_prompts=2", "batch_size=8")),
    Entry("ssd_rounds", "SSD: verification rounds (passes at batch 1 and 16), the paper's rule, point-wise drafter",
          (*EVAL, "experiment=ablation/ssd_rounds"), SPEED_QUICK),
    Entry("ssd_rounds_geneval", "SSD: verification rounds with carry, GenEval (+-0.03) and passes",
          (*EVAL, "experiment=ablation/ssd_rounds_geneval"),
          (*GENEVAL_QUICK, *SPEED_QUICK)),
    Entry("ssd_second_row", "SSD: the second row's wait for the first row to settle (the default) against no wait "
          "and AR, GenEval and passes", (*EVAL, "experiment=ablation/ssd_second_row"), (*GENEVAL_QUICK, *SPEED_QUICK)),
    Entry("ssd_row_passes", "SSD: grid-size scaling along one grid (passes per row, carry vs the paper's rule)",
          ("-m", "specgen.analysis.row_passes", "--backbone", f"{CK}/ar_shapes", "--tokenizer", f"{CK}/vq_shapes",
           "--drafter", f"{CK}/fphi_accept", "--prompts", "32", "--out", "{out}"),
          ("--prompts", "2")),
    Entry("ssd_costs", "SSD: where the wall clock goes at batch 1 (target passes: fixed cost and positions fed; "
          "drafting; verification) against AR, with the fitted per-pass cost",
          ("-m", "specgen.analysis.ssd_costs", "--backbone", f"{CK}/ar_shapes", "--tokenizer", f"{CK}/vq_shapes",
           "--drafter", f"{CK}/fphi_accept", "--prompts", "16", "--threads", "2", "--out", "{out}"),
          ("--prompts", "2")),
    Entry("ssd_grid_scaling", "SSD: grid-size scaling across world sizes (16, 24 and 32 tokens a side, pass ratio "
          "against the side, the row bound n / (passes a row may take))",
          ("-m", "specgen.analysis.grid_scaling",
           "--world", f"16={CK}/ar_shapes,{CK}/vq_shapes,{CK}/fphi_accept",
           "--world", f"24={CK}/ar_shapes24,{CK}/vq_shapes96,{CK}/fphi_shapes24",
           "--world", f"32={CK}/ar_shapes32,{CK}/vq_shapes128,{CK}/fphi_shapes32",
           "--strategy", "ssd", "--strategy", "ssd_paper",
           "--prompts", "32", "--out", "{out}"),
          ("--prompts", "2")),
    Entry("ssd_grid24_quality", "SSD: quality parity on the 24x24 world (GenEval of AR, SSD, the paper's rule)",
          (*EVAL, "experiment=eval/grid_scaling24"), (*GENEVAL_QUICK, *SPEED_QUICK)),
    Entry("ssd_grid32_quality", "SSD: quality parity on the 32x32 world (GenEval of AR, SSD, the paper's rule)",
          (*EVAL, "experiment=eval/grid_scaling32"), (*GENEVAL_QUICK, *SPEED_QUICK)),
    Entry("ssd_2d", "SSD: 2D drafting vs horizontal-only",
          (*EVAL, "-m", "experiment=ablation/ssd_ablation", "strategies.ssd.fn.vertical=true,false"),
          (*GENEVAL_QUICK, *SPEED_QUICK), sweep=True,
          pareto=("ssd/speed/nfe_ratio_bs1", "ssd/geneval/overall")),
    Entry("ssd_drafter_input", "SSD: hidden-state (f_phi) vs token-id drafting",
          (*EVAL, "-m", "experiment=ablation/ssd_ablation",
           f"strategies.ssd.fn.drafter.dirpath={CK}/fphi_shapes,{CK}/fphi_tokens_shapes",
           "strategies.ssd.fn.tails=[]"),  # the tails read hidden states: none for either drafter
          (*GENEVAL_QUICK, *SPEED_QUICK), sweep=True,
          pareto=("ssd/speed/nfe_ratio_bs1", "ssd/geneval/overall")),
    Entry("drafter_report", "SSD: drafter agreement and expected acceptance per direction, size and FLOPs",
          ("-m", "specgen.analysis.drafter_report", "--drafters", f"{CK}/fphi_shapes", f"{CK}/fphi_accept",
           f"{CK}/fphi_tokens_shapes", "--backbone", f"{CK}/ar_shapes", "--tokenizer", f"{CK}/vq_shapes",
           "--val-sequences", "512", "--out", "{out}/report.json"),
          ("--val-sequences", "32")),
    Entry("cspd_main", "CSpD at one token per MAR step: FID / IS / GenEval per strategy and against the target, "
          "Table 3 (alignment on / off at inner temperatures 5, 10, 42), alpha along the steps, work ratios",
          (*EVAL, "experiment=eval/continuous_speed", "num_threads=1"),
          CSPD_QUICK_GENEVAL),
    Entry("cspd_table1", "CSpD Table 1: speed-up vs batch size for draft lengths 4, 8, 16, 32",
          (*EVAL, "-m", "experiment=ablation/cspd_ablation", "benchmark=geneval_fid_shapes",
           "benchmark.geneval.prompts_per_task=12", "benchmark.fidelity.num_prompts=256", "ablation.gamma=4,8,16,32",
           "speed.batch_sizes=[1,8,16,32]", "speed.num_prompts=32", "num_threads=1"),
          (*CSPD_QUICK, "speed.batch_sizes=[1,8]", "speed.num_prompts=8"), sweep=True, pareto=("cspd/speed/target_work_ratio", "cspd/geneval/overall")),
    Entry("cspd_table4", "CSpD Table 4: pre-fill ratio 0, 5, 15%",
          (*EVAL, "-m", "experiment=ablation/cspd_ablation", "benchmark=geneval_fid_shapes",
           "benchmark.geneval.prompts_per_task=12", "benchmark.fidelity.num_prompts=256",
           "ablation.prefill_ratio=0.0,0.05,0.15", "speed.batch_sizes=[1,16]", "speed.num_prompts=16", "num_threads=1"),
          CSPD_QUICK, sweep=True, pareto=("cspd/speed/target_work_ratio", "cspd/geneval/overall")),
    Entry("cspd_tail_sweep", "CSpD's exact ratio at 16 MAR steps, lossless, and with a deterministic tail of m = 1, "
          "3, 10 DDIM steps: alpha, quality and speed against the target with the same sampler",
          (*EVAL, "experiment=ablation/cspd_tail_sweep", "num_threads=1"),
          CSPD_QUICK),
    Entry("cspd_trace", "CSpD Table 3 per step: the paper's ratio aligned vs independent at inner temperatures "
          "1-42, the exact ratio, cost split",
          ("-m", "specgen.analysis.cspd_trace", "--backbone", f"{CK}/mar_p2_shapes", "--draft",
           f"{CK}/mar_p2_shapes_draft", "--prompts", "64", "--inner-temperatures", "1", "5", "10", "20", "42",
           "--costs", "1", "16", "--out", "{out}"),
          ("--prompts", "8", "--costs", "1")),
)


def _done_file(folder: Path) -> Path:
    return folder / "catalogue_done.json"


def run_entry(entry: Entry, out: Path, quick: bool, env: dict) -> dict:
    """Run one entry unless it already finished with the same command; returns its record."""
    folder = out / entry.name
    cmd = entry.command(folder, quick)
    shown = " ".join(["python", *cmd[1:]])
    done = _done_file(folder)
    if done.is_file():
        record = json.loads(done.read_text())
        if record.get("command") == shown:
            return dict(record, skipped=True)
    folder.mkdir(parents=True, exist_ok=True)
    log_file = out / "logs" / f"{entry.name}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_file, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - t0
    if rc != 0:
        tail = "".join(log_file.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"catalogue entry {entry.name!r} failed (exit {rc}); its log {log_file} ends with:\n{tail}"
                           f"\nfix the cause and run the catalogue again: finished entries are skipped")
    if entry.sweep:
        rows = collect(folder)
        atomic_write_csv(folder / "table.csv", rows)
        atomic_write_text(folder / "table.txt", format_rows(rows) + "\n")
        if entry.pareto:
            pareto_plot(rows, *entry.pareto, folder / "pareto.png")
    record = {"entry": entry.name, "command": shown, "seconds": round(seconds, 1), "quick": quick,
              "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    atomic_write_text(done, json.dumps(record, indent=2) + "\n")
    return record


def outputs(folder: Path) -> list[str]:
    """The files a reader looks at, relative to the folder: tables, plots, captioned samples (a sweep: its own and its
    jobs'); not the plain grids, nor single acceptance maps where a run drew them all in one figure."""
    keep = ("summary.txt", "table.txt", "trace.txt", "report.json")
    found = [p for p in sorted(folder.rglob("*")) if p.is_file() and (p.suffix == ".png" or p.name in keep)
             and "geneval_samples" not in p.parts and "wandb" not in p.parts and not p.name.startswith("grid_")
             and not (p.name.startswith("accept_map_") and (p.parent / "accept_maps.png").is_file())]
    return [str(p.relative_to(folder)) for p in found]


def index(out: Path, records: list[dict], quick: bool) -> str:
    """`<out>/README.md`: each entry's paper item, command, time and files."""
    total = sum(r.get("seconds", 0.0) for r in records)
    lines = [f"# Reproduction catalogue ({'quick sizes' if quick else 'catalogue sizes'})", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M')} by `python -m specgen.analysis.catalogue"
             f"{' --quick' if quick else ''} --out {out}`; entries' own time {total / 60:.1f} minutes in all.", "",
             "| entry | paper item | minutes | files |", "|---|---|---|---|"]
    by_name = {r["entry"]: r for r in records}
    for e in ENTRIES:
        r = by_name.get(e.name)
        if r is None:
            continue
        files = ", ".join(f"[{f}]({e.name}/{f})" for f in outputs(out / e.name))
        lines.append(f"| `{e.name}` | {e.paper} | {r['seconds'] / 60:.1f} | {files} |")
    lines += ["", "Commands:", ""] + [f"- `{e.name}`: `{by_name[e.name]['command']}`" for e in ENTRIES if e.name in by_name]
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / "README.md", text)
    return text


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="logs/figures", help="folder of the entries' runs and the index README.md")
    ap.add_argument("--quick", action="store_true", help="every entry on a few images (a pipeline check)")
    ap.add_argument("--only", nargs="+", default=None, metavar="ENTRY", help="run these entries only")
    ap.add_argument("--list", action="store_true", help="print the entries and their commands, run nothing")
    args = ap.parse_args(argv)
    known = [e.name for e in ENTRIES]
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        ap.error(f"--only {unknown}: no such entry; the catalogue has {known}")
    entries = [e for e in ENTRIES if args.only is None or e.name in args.only]
    out = Path(args.out).resolve()
    if args.list:
        for e in entries:
            print(f"{e.name}: {e.paper}\n  {' '.join(['python', *e.command(out / e.name, args.quick)[1:]])}")
        return []
    env = dict(os.environ, WANDB_SILENT="true", HYDRA_FULL_ERROR="1")
    records = []
    for k, e in enumerate(entries, 1):
        print(f"[{k}/{len(entries)}] {e.name}: {e.paper}", flush=True)
        rec = run_entry(e, out, args.quick, env)
        print(f"    {'already done' if rec.get('skipped') else 'done'} in {rec['seconds'] / 60:.1f} min "
              f"-> {out / e.name}", flush=True)
        records.append(rec)
    index(out, records, args.quick)
    print(f"index: {out / 'README.md'}")
    return records


if __name__ == "__main__":
    main()
