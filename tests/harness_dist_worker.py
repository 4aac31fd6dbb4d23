"""Worker for tests/test_harness.py's data-parallel test, launched with `torchrun --nproc_per_node=2` (gloo, CPU).

argv: the model_args string of the unifusion harness model, and the JSON file rank 0 writes: the world size, each
task's metrics and its (doc_id, filtered responses), sorted by doc_id. The model joins the process group itself
(torchrun sets WORLD_SIZE); lm-eval's evaluator splits the documents over the ranks and gathers on rank 0.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix=f"unifusion-datasets-{os.environ.get('RANK', '0')}-")

import lm_eval  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import unifusion.eval.harness  # noqa: E402, F401  (registers "unifusion")

TASKS = ["unifusion_tiny_mc", "unifusion_tiny_rolling", "unifusion_tiny_gen"]


def main() -> None:
    model_args, out_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    manager = TaskManager(include_path=os.path.join(os.path.dirname(__file__), "data", "harness"),
                          include_defaults=False)
    try:
        out = lm_eval.simple_evaluate(model="unifusion", model_args=model_args, tasks=TASKS, task_manager=manager,
                                      log_samples=True, verbosity="WARNING", limit=5)
        if dist.get_rank() == 0:
            assert out is not None
            payload = {
                "world_size": dist.get_world_size(),
                "results": {t: out["results"][t] for t in TASKS},
                "samples": {t: [[s["doc_id"], s["filtered_resps"]] for s in
                                sorted(out["samples"][t], key=lambda s: s["doc_id"])] for t in TASKS},
            }
            with open(out_path, "w") as f:
                json.dump(payload, f)
    finally:
        shutil.rmtree(os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
