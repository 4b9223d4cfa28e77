"""Where a result came from: git commit and dirty flag, command line, library versions, config and
data hashes. Recorded in every run's ``result.json`` and in a grid's ``results.json``; a table built
from records of different commits says so (or ``ablate`` refuses, see :func:`commit_check`)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from ascender_dist.machine import machine_record
from ascender_dist.versions import REPO, git_state, package_versions  # noqa: F401 (REPO, git_state: re-exported)

# what a run's numbers or a table's statistics depend on: training (torch, megatron-core, deepspeed,
# the tokenizer's sentencepiece), statistics and clustering (numpy, scipy, scikit-learn)
PACKAGES = ("torch", "megatron-core", "deepspeed", "ascender-dist", "sentencepiece", "numpy", "scipy", "scikit-learn")
# per-run fields of a run config: differ between the seeds of one variant, not part of its hash
PER_RUN_FIELDS = ("name", "output_dir")
PER_RUN_TRAIN_FIELDS = ("seed",)


def report_provenance() -> dict:
    """What a generated table or figure records of where it came from: git commit and dirty flag,
    library versions, the machine and the command line."""
    return {**git_state(), "versions": versions(), "machine": machine_record(), "command": [sys.executable, *sys.argv]}


def versions() -> dict:
    return package_versions(PACKAGES)


def file_sha256(path) -> Optional[str]:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def config_hash(config: dict) -> str:
    """sha256 of a run config (a nested dict) without its per-run fields (name, output dir, seed):
    equal for every seed of one variant, different when any setting differs."""
    cfg = {k: v for k, v in config.items() if k not in PER_RUN_FIELDS}
    if isinstance(cfg.get("train"), dict):
        cfg["train"] = {k: v for k, v in cfg["train"].items() if k not in PER_RUN_TRAIN_FIELDS}
    text = json.dumps(cfg, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def run_provenance(config: dict, manifest: Optional[str]) -> dict:
    """What one run records: git state, versions, the machine, its config hash and its data
    manifest's hash."""
    return {**git_state(), "versions": versions(), "machine": machine_record(), "config_sha256": config_hash(config),
            "data_manifest_sha256": file_sha256(manifest) if manifest else None,
            "command": [sys.executable, *sys.argv]}


def commits_of(records: Sequence[dict]) -> dict:
    """``{commit (or "unrecorded"): ["variant seed N", ...]}`` over the records."""
    out: dict = {}
    for r in records:
        prov = r.get("provenance") or {}
        commit = prov.get("git_commit") or "unrecorded"
        if prov.get("git_dirty"):  # one group per set of uncommitted changes (when recorded)
            changes = prov.get("git_changes_sha256")
            commit += f"+dirty:{changes[:12]}" if changes else "+dirty"
        out.setdefault(commit, []).append(f"{r['config']} seed {r['seed']}")
    return out


def commit_label(key: str) -> str:
    """A key of :func:`commits_of` for people: the commit's first 12 characters, and the uncommitted
    changes' hash (first 12) when there were some."""
    commit, marker, changes = key.partition("+dirty")
    if not marker:
        return commit[:12]
    changes = changes.lstrip(":")
    return f"{commit[:12]} + uncommitted changes" + (f" {changes}" if changes else "")


def versions_of(records: Sequence[dict]) -> dict:
    """``{package: {version: number of runs}}`` over the records that recorded their versions."""
    out: dict = {}
    for r in records:
        for package, version in ((r.get("provenance") or {}).get("versions") or {}).items():
            counts = out.setdefault(package, {})
            counts[version] = counts.get(version, 0) + 1
    return out


def mixed_version_line(records: Sequence[dict]) -> Optional[str]:
    """A line naming the packages whose version differs between the records' runs, or None."""
    mixed = {p: v for p, v in versions_of(records).items() if len(v) > 1}
    if not mixed:
        return None
    parts = ["; ".join(f"{p} " + ", ".join(f"{ver} ({n} runs)" for ver, n in v.items()) for p, v in mixed.items())]
    return "**Mixed versions: this table combines runs made with " + parts[0] + "; re-run the grid with one set.**"


def mixed_inputs_line(records: Sequence[dict]) -> Optional[str]:
    """A line naming what the records' runs were trained on that differs where a table pairs them:
    more than one recorded data manifest (two corpora, e.g. built by two Python versions), or more
    than one config within a variant (its seeds are not replicates); None when neither. Records
    without a recorded hash do not count."""
    data: dict = {}
    configs: dict = {}
    for r in records:
        prov = r.get("provenance") or {}
        if prov.get("data_manifest_sha256"):
            data.setdefault(prov["data_manifest_sha256"], []).append(r)
        if prov.get("config_sha256"):
            configs.setdefault(r.get("config"), set()).add(prov["config_sha256"])
    parts = []
    if len(data) > 1:
        parts.append("data manifests " + ", ".join(f"{h[:12]} ({len(rs)} runs)" for h, rs in data.items()))
    parts += [f"variant {name} with {len(hashes)} configs ({', '.join(sorted(h[:12] for h in hashes))})"
              for name, hashes in configs.items() if len(hashes) > 1]
    if not parts:
        return None
    return "**Mixed inputs: this table combines runs trained on " + "; ".join(parts) + "; re-run them on one.**"


def mixed_commit_line(records: Sequence[dict]) -> Optional[str]:
    """The first line of a table built from records of more than one commit (or of records that
    predate provenance recording, "unrecorded"), or of one commit with uncommitted changes; None when
    every record names the same clean commit."""
    commits = commits_of(records)
    if len(commits) == 1 and "unrecorded" not in commits:
        (only,) = commits
        if "+dirty" in only:
            return (f"**Uncommitted changes: every run was made from commit {only[:12]} with uncommitted changes "
                    "(git status not clean); the commit alone may not reproduce them.**")
        return None
    parts = [f"{commit_label(c) if c != 'unrecorded' else 'no recorded commit'} ({len(runs)} runs)"
             for c, runs in commits.items()]
    if list(commits) == ["unrecorded"]:
        return ("**Provenance: these records name no git commit (made before commits were recorded): "
                "they may not reproduce on the current code; re-run the grid.**")
    return "**Mixed commits: this table combines records of " + ", ".join(parts) + "; re-run the grid on one commit.**"
