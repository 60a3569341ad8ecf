"""The reproduction catalogue: every entry composes, a finished entry is skipped, a failed one names its log."""
import json
from pathlib import Path

import pytest

from helpers import compose_cfg
from specgen.analysis import catalogue
from specgen.analysis.catalogue import ENTRIES, Entry, index, merge, run_entry

ROOT = Path(__file__).resolve().parents[1]


def test_merge_replaces_settings_and_flag_values():
    args = ("-m", "specgen.eval", "experiment=x", "speed.num_prompts=32", "--prompts", "64", "--costs", "1", "16")
    assert merge(args, ("speed.num_prompts=4", "benchmark.a=1", "--costs", "1", "--new", "v")) == [
        "-m", "specgen.eval", "experiment=x", "speed.num_prompts=4", "--prompts", "64", "--costs", "1",
        "benchmark.a=1", "--new", "v"]


def _eval_overrides(entry: Entry, quick: bool) -> list[str]:
    """The Hydra overrides of an evaluation entry, a sweep's first value standing for the others."""
    argv = entry.command(Path("/tmp/x"), quick)[1:]
    overrides = [a for a in argv[2:] if a != "-m" and not a.startswith("hydra.")]
    return [a if "[" in a or "," not in a else a.split(",")[0] for a in overrides]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if "specgen.eval" in e.args], ids=lambda e: e.name)
def test_every_evaluation_entry_composes_in_both_sizes(entry, tmp_path):
    for quick in (False, True):
        cfg = compose_cfg("eval", _eval_overrides(entry, quick), tmp_path)
        assert cfg.get("speed") and cfg.strategies, entry.name
        if quick and cfg.benchmark.get("geneval"):
            assert cfg.benchmark.geneval.prompts_per_task == 1  # the quick size replaced the entry's own


def test_every_entry_is_in_the_experiments_readme_and_names_shipped_models():
    readme = (ROOT / "experiments" / "README.md").read_text()
    for e in ENTRIES:
        assert f"`{e.name}`" in readme, e.name
        for arg in e.command(Path("/tmp/x"), False):
            for part in arg.split("=")[-1].split(","):
                if "/checkpoints/" in part:
                    assert (Path(part) / "model.safetensors").is_file(), part


def _fake(name: str, code: str) -> Entry:
    return Entry(name, f"a fake {name}", ("-c", code, "{out}"))


WRITE = ("import pathlib, sys; d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True); "
         "n = d / 'runs.txt'; n.write_text(n.read_text() + 'x' if n.exists() else 'x'); (d / 'plot.png').write_bytes(b'')")


def test_a_finished_entry_is_skipped_and_a_changed_one_runs_again(tmp_path):
    entry = _fake("fake", WRITE)
    first = run_entry(entry, tmp_path, quick=False, env={})
    assert (tmp_path / "fake" / "runs.txt").read_text() == "x" and not first.get("skipped")
    again = run_entry(entry, tmp_path, quick=False, env={})
    assert again["skipped"] and (tmp_path / "fake" / "runs.txt").read_text() == "x"
    changed = Entry("fake", "a fake", entry.args, quick=("--flag",))
    run_entry(changed, tmp_path, quick=True, env={})  # another command: runs again
    assert (tmp_path / "fake" / "runs.txt").read_text() == "xx"
    record = json.loads((tmp_path / "fake" / "catalogue_done.json").read_text())
    assert record["quick"] and record["command"].endswith("--flag")


def test_a_failed_entry_names_its_log_and_leaves_no_done_mark(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)'broken' failed \(exit 3\).*broken.log.*boom"):
        run_entry(_fake("broken", "import sys; print('boom'); sys.exit(3)"), tmp_path, quick=False, env={})
    assert not (tmp_path / "broken" / "catalogue_done.json").exists()


def test_index_lists_entries_with_their_files(tmp_path, monkeypatch):
    entry = _fake("ssd_strategies", WRITE)
    monkeypatch.setattr(catalogue, "ENTRIES", (entry,))
    rec = run_entry(entry, tmp_path, quick=True, env={})
    text = index(tmp_path, [rec], quick=True)
    assert "| `ssd_strategies` | a fake ssd_strategies |" in text and "[plot.png](ssd_strategies/plot.png)" in text
    assert (tmp_path / "README.md").read_text() == text


def test_unknown_entries_are_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        catalogue.main(["--only", "table9", "--list"])
    assert "no such entry" in capsys.readouterr().err
