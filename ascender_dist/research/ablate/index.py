"""The index of a folder of ablation reports: one ``results.md`` generated from every report's
``results.json`` below it (``ascender-dist tables --index DIR``).

It says, for each report, which commit its runs came from and whether the model, trainer or data
code has changed since (``git log`` over :data:`MODEL_CODE`, and edits to the grid files of
:data:`GRID_CONFIGS`; runs of a commit outside HEAD's history
are stale; a later commit that touches that code but was reviewed not to change what a run computes is
named, with its reason and optionally the layer kinds it is limited to, in the folder's
``neutral-commits.yaml``), lists the grids of ``configs/ablations/`` that have no report yet, and
gives each report's comparisons in one table with a generated reading: each comparison once, its p
Holm-adjusted over the report's distinct comparisons (per test, the family size in the header), and
the runs that diverged. Every sentence comes from the JSON, so the index cannot drift from the reports
it summarises."""

from __future__ import annotations

import json
import re
import math
import subprocess
from pathlib import Path
from typing import Optional

import yaml

from .collect import holm_family, interval_label, report_families
from .grid import AblationError, load_grid
from .provenance import REPO

# code whose change can change what a run computes: the model, trainer and data code, and what runs
# one grid run and measures it (the run driver, its config and dataset builder, the launch entries, and
# main.py, whose _child_main is the run's entry point: run_entry.py only calls it), and pyproject.toml,
# whose pins choose the torch, megatron-core and deepspeed a run trains with
MODEL_CODE = ("pyproject.toml", "ascender_dist/models", "ascender_dist/training", "ascender_dist/parallel", "ascender_dist/config",
              "ascender_dist/compat", "data_pipeline", "ascender_dist/research/ablate/launch.py",
              "ascender_dist/research/ablate/grid.py", "ascender_dist/research/ablate/run_entry.py",
              "ascender_dist/research/ablate/main.py", "ascender_dist/launcher.py", "ascender_dist/launch_entry.py")
# the grid files: editing, renaming or deleting one changes what its runs (and the grids based on it)
# compute; adding a new grid changes no earlier run, so an added file alone does not count
GRID_CONFIGS = "configs/ablations"
NEUTRAL_FILE = "neutral-commits.yaml"
INDEX_FILE = "results.md"
SHORT_SHA = 7  # commits are shown this long, not as git's %h, whose length grows with the object count


def read_reports(folder: Path) -> list[tuple[str, dict]]:
    """(sub-folder name, results.json object) of every report directly under ``folder``, by name."""
    out = []
    for path in sorted(folder.glob("*/results.json")):
        try:
            full = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise AblationError(f"{path}: not readable as JSON ({exc})") from exc
        if not isinstance(full, dict) or "grid" not in full or "records" not in full:
            raise AblationError(f"{path}: not a results.json written by ablate (no 'grid' / 'records')")
        out.append((path.parent.name, full))
    return out


def read_neutral(folder: Path) -> dict:
    """``{commit prefix: reason}`` from ``folder/neutral-commits.yaml`` (empty when absent). A reason
    is a string (the commit changes no run), or ``{reason: ..., layers: "S"}``: the commit changes only
    runs with a layer of those kinds (layer-pattern letters), and no run without one."""
    path = folder / NEUTRAL_FILE
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text()) or {}

    def valid(v) -> bool:
        if isinstance(v, dict):
            return set(v) == {"reason", "layers"} and valid(v["reason"]) and isinstance(v["layers"], str) \
                and bool(v["layers"].strip())
        return isinstance(v, str) and bool(v.strip())

    if not isinstance(data, dict) or not all(valid(v) for v in data.values()):
        raise AblationError(f"{path}: expected a mapping 'commit: reason' (or 'commit: {{reason: ..., layers: "
                            "LETTERS}}') with a non-empty reason for each")
    unquoted = [k for k in data if not isinstance(k, str)]
    if unquoted:  # YAML reads 7979459 as a number (and 0123456 as octal): the commit would be garbled
        raise AblationError(f"{path}: commit {unquoted[0]!r} must be quoted (\"abc1234\": ...), "
                            "YAML read it as a number")
    short = [k for k in data if not re.fullmatch(rf"[0-9a-f]{{{SHORT_SHA},40}}", k)]
    if short:  # "c" named every commit starting with c as reviewed
        raise AblationError(f"{path}: commit {short[0]!r} must be {SHORT_SHA} to 40 lowercase hex digits of one commit")
    return {k: ({"reason": v["reason"].strip(), "layers": v["layers"].strip()} if isinstance(v, dict) else v.strip())
            for k, v in data.items()}


def _neutral_reason(entry, layers_run: Optional[set]) -> Optional[str]:
    """The reason a neutral entry gives for runs with layer kinds ``layers_run`` (None: unknown), or
    None when the commit may change them."""
    if isinstance(entry, str):
        return entry
    if layers_run is None or layers_run & set(entry["layers"]):
        return None
    return f"{entry['reason']} (no {entry['layers']} layer in these runs)"


def is_ancestor(commit: str, root: Path = REPO) -> Optional[bool]:
    """Whether ``commit`` is in HEAD's history (runs made on a side branch or before a rebase are not:
    their model code may differ from HEAD's without any later commit touching it); None when git
    cannot answer."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", commit, "HEAD"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(proc.returncode)


def _changes_a_run(status_lines: list[str]) -> bool:
    """Whether a commit's ``--name-status`` lines (over MODEL_CODE and GRID_CONFIGS) can change a run:
    any change to MODEL_CODE, or a grid file edited, renamed or deleted (not only added). A commit
    without lines (a merge) counts, as ``git log -- paths`` listed it."""
    for line in status_lines:
        status, *paths = line.split("\t")
        if not (status == "A" and all(x == GRID_CONFIGS or x.startswith(GRID_CONFIGS + "/") for x in paths)):
            return True
    return not status_lines


def later_model_commits(commit: str, root: Path = REPO) -> Optional[list[tuple[str, str]]]:
    """(full sha, subject) of the commits after ``commit`` up to HEAD that touch
    MODEL_CODE or edit a grid file of GRID_CONFIGS (:func:`_changes_a_run`), oldest first; None when git
    cannot answer (not a checkout, unknown commit)."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "log", "--reverse", "--name-status", "--format=%x1e%H%x09%s",
                               f"{commit}..HEAD", "--", *MODEL_CODE, GRID_CONFIGS],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    out = []
    for block in proc.stdout.split("\x1e")[1:]:
        head, *status = [line for line in block.splitlines() if line.strip()]
        if _changes_a_run(status):
            sha, subject = head.split("\t", 1)
            out.append((sha, subject))
    return out


def code_state(commits: list, neutral: dict, root: Path = REPO, layers_run: Optional[set] = None) -> tuple[str, str]:
    """("current" / "stale" / "unknown", why) for runs made at ``commits`` whose models have the layer
    kinds ``layers_run`` (letters of their layer patterns; None: not recorded)."""
    if not commits or None in commits:
        return "stale", "no git commit recorded in its runs: re-run"
    changed, judged = [], []
    for commit in commits:
        later = later_model_commits(commit, root)
        if later is None:
            return "unknown", f"git cannot compare {commit[:SHORT_SHA]} with HEAD here"
        if is_ancestor(commit, root) is False:
            return "stale", f"its runs' commit {commit[:SHORT_SHA]} is not in HEAD's history (another branch, or " \
                            "before a rebase): re-run"
        for sha, subject in later:
            entry = next((r for prefix, r in neutral.items() if sha.startswith(prefix)), None)  # the full sha
            reason = None if entry is None else _neutral_reason(entry, layers_run)
            (judged if reason else changed).append((sha[:SHORT_SHA], reason or subject))
    if changed:
        shas = sorted({sha for sha, _ in changed})
        return "stale", f"model/trainer/data code changed since, in {', '.join(shas)}: re-run"
    if judged:
        shas = sorted({sha for sha, _ in judged})
        which = f"commits {', '.join(shas)} were" if len(shas) > 1 else f"commit {shas[0]} was"
        return "current", f"the later model/trainer/data {which} reviewed as not changing a run (`{NEUTRAL_FILE}`)"
    return "current", "no model/trainer/data code changed since"


def run_commits(full: dict) -> list:
    """The distinct git commits of a report's runs (None for a run without one), sorted."""
    found = {(r.get("provenance") or {}).get("git_commit") for r in full["records"]}
    return sorted(found, key=lambda c: (c is None, c or ""))


def _short(commits: list) -> str:
    return ", ".join(c[:SHORT_SHA] if c else "none recorded" for c in commits)


def holm_families(full: dict) -> tuple[dict, dict]:
    """(over-seed, per-sequence) ``{frozenset((config, reference)): Holm p}`` of a report: Holm over its
    distinct comparisons per test (:func:`~.collect.holm_family`), recomputed from the raw p-values of
    results.json, so the index adjusts over the family it shows even for a report written when each table
    was adjusted on its own."""
    seeds, sequences = report_families(full["tables"])
    return holm_family(seeds), holm_family(sequences)


def family_size(family: dict) -> int:
    """The comparisons of a Holm family that have a p (an undefined p, sd = 0, is not a test)."""
    return sum(p is not None for p in family.values())


def comparison_rows(full: dict) -> list[dict]:
    """One row per (reference, config) comparison of a report's over-seed tables, with the seeds where
    the config's metric was lower and, where stored, the per-sequence (document-resampled) result; p Holm
    over the report's distinct comparisons (:func:`holm_families`)."""
    tables = full["tables"]
    per_example = tables.get("per_example") or {}
    seed_family, doc_family = holm_families(full)
    rows, seen = [], set()
    for table in [tables["main"], *tables.get("vs", {}).values()]:
        ref = table["baseline"]
        docs = {c["config"]: c for c in (per_example.get(ref) or {}).get("configs", [])}
        for c in table["configs"]:
            cmp_ = c.get("comparison")
            if not cmp_ or (ref, c["config"]) in seen:  # b − a after a − b: the same comparison again
                continue
            seen.add((c["config"], ref))
            diffs = [d for d in (c.get("per_seed_difference") or {}).values() if d is not None]
            doc = (docs.get(c["config"]) or {}).get("comparison")
            pair = frozenset((ref, c["config"]))
            rows.append({"reference": ref, "config": c["config"], "n": cmp_["n"], "diff": cmp_["mean_diff"],
                         "low": cmp_["ci_low"], "high": cmp_["ci_high"], "p": cmp_.get("p_value"),
                         "p_holm": seed_family[pair],
                         "undefined": cmp_.get("p_value") is None,  # every seed's difference equal: sd 0
                         "lower": sum(d < 0 for d in diffs), "equal": sum(d == 0 for d in diffs),
                         "seeds": len(diffs), "doc": doc and {**doc, "p_holm": doc_family.get(pair)}})
    return rows


def _seed_count(r: dict) -> str:
    equal = f", equal in {r['equal']}" if r["equal"] else ""
    return f"lower in {r['lower']}{equal} of {r['seeds']} seeds"


def _num(x, fmt: str = "+.4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _excludes_zero(low, high) -> bool:
    return low is not None and high is not None and (low > 0 or high < 0)  # NaN: neither


UNDEFINED_P = "undefined (sd = 0)"  # as in the reports' tables


def comparison_table(rows: list[dict], metric: str, m_seeds: int, m_docs: int) -> list[str]:
    """The comparisons of a report, each once; the p Holm headers say over how many comparisons
    (``m_seeds`` over seeds, ``m_docs`` per sequence) each test was adjusted."""
    label = interval_label([r["doc"].get("interval") or "" for r in rows if r["doc"]])
    lines = [f"| {metric}: config − reference | Δ over seeds [95% paired t] | p Holm ({m_seeds}) | seeds | "
             f"Δ per sequence, these trained models [{label}, documents resampled] | p Holm ({m_docs}), these "
             "models |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        doc = r["doc"]
        per_seq = (f"{_num(doc['mean_diff'])} [{_num(doc['ci_low'])}, {_num(doc['ci_high'])}]" if doc else "—")
        if r.get("undefined"):
            over_seeds, p_holm = f"{_num(r['diff'])} [undefined]", UNDEFINED_P
        else:
            over_seeds, p_holm = f"{_num(r['diff'])} [{_num(r['low'])}, {_num(r['high'])}]", _num(r["p_holm"], ".2g")
        lines.append(f"| {r['config']} − {r['reference']} | {over_seeds} | {p_holm} | {_seed_count(r)} | {per_seq} | "
                     f"{_num(doc.get('p_holm'), '.2g') if doc else '—'} |")
    return lines


def _undefined_sentence(rows: list[dict]) -> str:
    """The comparisons whose seeds all gave the same difference (sd 0): no interval, p or significance."""
    flat = [f"{r['config']} − {r['reference']} ({_num(r['diff'])})" for r in rows if r.get("undefined")]
    if not flat:
        return ""
    return (" The same difference on every seed (sd = 0), so no interval or test (p undefined), not counted as "
            "significant: " + ", ".join(flat) + ".")


def reading(rows: list[dict]) -> str:
    """What the over-seed intervals say, as generated sentences. A comparison whose p is undefined (every
    seed gave the same difference) is never called significant, however far from 0 its difference."""
    clear = [r for r in rows if not r.get("undefined") and _excludes_zero(r["low"], r["high"])]
    m = sum(r["p_holm"] is not None for r in rows)
    if not clear:
        return ("Reading: no paired t interval over seeds excludes 0: at this scale no variant differs from its "
                "reference by more than the seed-to-seed spread." + _undefined_sentence(rows))
    parts = [f"{r['config']} {'lower' if r['diff'] < 0 else 'higher'} than {r['reference']} "
             f"({_num(r['diff'])}, {_seed_count(r)}, Holm p {_num(r['p_holm'], '.2g')})" for r in clear]
    held = [r for r in clear if r["p_holm"] is not None and r["p_holm"] < 0.05]
    return ("Reading: paired t intervals over seeds (each at 95%, not adjusted) that exclude 0: " + "; ".join(parts)
            + f". Of these, {len(held)} keep Holm p < 0.05 over the report's {m} distinct comparisons"
            + (": " + ", ".join(f"{r['config']} − {r['reference']}" for r in held) if held else "") + "."
            + _undefined_sentence(rows))


def diverged_line(full: dict) -> str:
    """The runs whose metric was not finite (diverged), per variant, as the main table counted them; ""
    when none (or a report written before runs could diverge without failing it)."""
    main = full["tables"]["main"]
    counts = [f"{e['config']} {len(e['diverged'])} of {len(e['diverged']) + e['n']} (seed(s) "
              f"{', '.join(map(str, e['diverged']))})" for e in main["configs"] if e.get("diverged")]
    if not counts:
        return ""
    return (f"Diverged runs ({main['metric']} not finite; left out of every statistic above, and training is "
            "deterministic, so a re-run diverges again): " + "; ".join(counts) + ".")


def connection_reading(summary: dict) -> str:
    """Whether the adaptive stop ended any reasoning early, per config, from the validation pass."""
    early = [f"{cfg} ({c['mean_steps']:.2f} of {c['max_steps']})" for cfg, c in summary.items()
             if c["mean_steps"] < c["max_steps"] - 1e-9]
    if not early:
        return ("Adaptive stop: every Connection config ran its maximum number of reasoning steps on every "
                "validation state (the stop never ended reasoning early).")
    return "Adaptive stop: mean reasoning steps below the maximum in " + ", ".join(early) + "."


def _display(path: Path, root: Path) -> str:
    """``path`` relative to the repository root when inside it (the index reads the same from anywhere)."""
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def configured_grids(grids_dir: Path, root: Path = REPO) -> list[tuple[str, str, int]]:
    """(grid name, path, number of runs) of every grid YAML in ``grids_dir``."""
    out = []
    for path in sorted(grids_dir.glob("*.yaml")):
        grid = load_grid(path)
        out.append((grid.name, _display(path, root), len(grid.variants) * len(grid.seeds)))
    return out


def status_table(reports: list, neutral: dict, configured: list, root: Path) -> list[str]:
    lines = ["| report | grid | runs | seeds | run commit(s) | state |", "|---|---|---:|---|---|---|"]
    names = set()
    for folder, full in reports:
        g = full["grid"]
        names.add(g["name"])
        seeds = sorted({r["seed"] for r in full["records"]})
        commits = run_commits(full)
        patterns = [r.get("layer_pattern") for r in full["records"]]
        layers_run = set("".join(patterns)) if all(patterns) else None
        state, why = code_state(commits, neutral, root, layers_run)
        dirty = sum(bool((r.get("provenance") or {}).get("git_dirty")) for r in full["records"])
        if dirty and state == "current":
            state, why = "unknown", f"{dirty} run(s) made from a checkout with uncommitted changes to tracked files"
        mark = f"**{state}**" if state != "current" else state
        lines.append(f"| [`{folder}/`]({folder}/results.md) | `{g['path']}` | {len(full['records'])} | "
                     f"{', '.join(map(str, seeds))} | {_short(commits)} | {mark}: {why} |")
    for name, path, runs in configured:
        if name not in names:
            lines.append(f"| — | `{path}` | {runs} planned | — | — | **not run** |")
    return lines


def section(folder: str, full: dict) -> list[str]:
    g, recs = full["grid"], full["records"]
    steps = sorted({r["steps"] for r in recs})
    devices = sorted({str(r.get("device", "cpu")).split(":")[0] for r in recs})
    env = full.get("environment") or {}
    lines = [f"## `{g['name']}` — [`{folder}/results.md`]({folder}/results.md)", ""]
    if g.get("description"):
        lines += [g["description"], ""]
    lines += [f"Compared at {g.get('budget') or 'equal training tokens'}; {len(recs)} runs, "
              f"{'/'.join(map(str, steps))} steps each, on {'/'.join(devices)}"
              + (f" ({env.get('cpu_count')} cores, Python {env.get('python')})" if env else "") + ".", ""]
    rows = comparison_rows(full)
    if rows:
        m_seeds, m_docs = (family_size(f) for f in holm_families(full))
        lines += comparison_table(rows, full["tables"]["metric"], m_seeds, m_docs) + ["", reading(rows), ""]
    if diverged_line(full):
        lines += [diverged_line(full), ""]
    if full.get("connection"):
        lines += [connection_reading(full["connection"]), ""]
    if full.get("mixed_commits"):
        lines += [full["mixed_commits"], ""]
    return lines


# outputs below the folder that are not ablate reports: (JSON with a ``provenance``, what it holds, whether it
# reports timings or memory, which a neutral-commit review does not cover: those were checked "identical but
# the timings")
OTHER_OUTPUTS = (("figures/figures.json", "Figures 1 and 4, Table 4", False),
                 ("efficiency/table2.json", "Table 2 (efficiency: FLOPs, memory, tokens/s)", True),
                 ("coverage/coverage.json", "Coverage of the reports' intervals (simulation from their per-sequence data)",
                  False))


def other_outputs_table(folder: Path, neutral: dict, root: Path = REPO) -> list[str]:
    """State lines of the generated outputs in OTHER_OUTPUTS that exist below ``folder``."""
    rows = []
    for rel, what, timed in OTHER_OUTPUTS:
        path = folder / rel
        if not path.is_file():
            continue
        commit = (json.loads(path.read_text()).get("provenance") or {}).get("git_commit")
        state, why = code_state([commit], {} if timed else neutral, root)
        shown = f"**{state}**" if state != "current" else state
        made = commit[:SHORT_SHA] if commit else "none recorded"
        rows.append(f"| [`{rel}`]({rel}) | {what} | {made} | {shown}: {why} |")
    if not rows:
        return []
    return ["## Other generated outputs", "", "| file | what | made at | state |", "|---|---|---|---|", *rows, "",
            "A table of timings or memory is current only if no model/trainer/data commit followed it: the "
            f"reviews in `{NEUTRAL_FILE}` compare every recorded field but the timings.", ""]


# what each comparison column estimates: the only sentences of the index not drawn from a report
HOW_TO_READ = (
    "How to read the comparison tables. *Δ over seeds* is a paired t over the seeds, the replicates of the "
    "training randomness: it speaks for the variants, with the validation documents held fixed (its estimand "
    "is the loss on this validation set). *Δ per sequence* resamples the documents under the seeds' mean of "
    "each variant: it compares these particular trained models and leaves the seed-to-seed variance out, so "
    "its interval and p say nothing about the variants beyond these runs (a difference there can change sign "
    "from one seed to the next); read it as a description of these models, never as a variant effect.")


def index_markdown(folder: Path, grids_dir: Path, root: Path = REPO) -> str:
    """The index of ``folder`` (see the module docstring)."""
    reports = read_reports(folder)
    if not reports:
        raise AblationError(f"{folder}: no */results.json below it (a folder of ablate report directories)")
    neutral = read_neutral(folder)
    configured = configured_grids(grids_dir, root) if grids_dir.is_dir() else []
    lines = ["# Research results: index of the ablation reports", "",
             f"Generated by `ascender-dist tables --index {_display(folder, root)}` from the `results.json` of each "
             "report below "
             "(every number and sentence of this file comes from them, but the fixed note on how to read the tables); each report's own `results.md` has the "
             "per-seed values, the cost and the figures. State: whether the model, trainer or data code "
             f"({', '.join(f'`{p}`' for p in MODEL_CODE)}) or a grid file (`{GRID_CONFIGS}`, edits) changed after "
             "the commit the runs were made at"
             + (f"; commits reviewed as not changing a run are listed in `{NEUTRAL_FILE}`" if neutral else "") + ".",
             "", *status_table(reports, neutral, configured, root), "", *other_outputs_table(folder, neutral, root),
             HOW_TO_READ, ""]
    for name, full in reports:
        lines += section(name, full)
    return "\n".join(lines).rstrip() + "\n"


def write_index(folder: Path, grids_dir: Path, root: Path = REPO) -> Path:
    out = folder / INDEX_FILE
    out.write_text(index_markdown(folder, grids_dir, root))
    return out
