"""A local lm-eval multiple-choice task for the evaluate tests (no network: datasets' json builder
reads the file written next to the task YAML)."""

from __future__ import annotations

import json
from pathlib import Path

TASK = "tiny_code_mc"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(directory: Path, questions: list) -> Path:
    """``directory`` holding TASK: its YAML and ``questions`` as (context, choices, index of the answer)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in questions))
    (directory / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return directory
