"""scripts/finetune_lora.py --pp 2 (hfcp.pipeline, issue 43): the main job's LoRA fine-tune over 2 pipeline stages x
cp 2 on 4 gloo processes against the same loop in one process: the same losses, gradient norms, key accuracy and
trained adapter."""
import json

import torch
from safetensors.torch import load_file

from test_finetune import _losses

PP = ["--pp", "2", "--seq-len", "256", "--max-steps", "3", "--lora-r", "4", "--eval-docs", "1", "--batch-size", "4",
      "--microbatches", "2", "--grad-accum", "2"]


def test_pp2_cp2_job_equals_one_process(pool1, pool4, tmp_path):
    import workers_finetune

    for pool, name in ((pool1, "single"), (pool4, "pp2_cp2")):
        pool.run(workers_finetune.finetune_main, [*PP, "--output-dir", str(tmp_path / name)])
    single, pp = tmp_path / "single", tmp_path / "pp2_cp2"
    a, b = _losses(single), _losses(pp)
    assert len(a) == len(b) == 3 and a[-1] < a[0], (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)
    norms = [[json.loads(line)["grad_norm"] for line in (r / "metrics.jsonl").read_text().splitlines()]
             for r in (single, pp)]
    for x, y in zip(*norms):  # clipped by the whole model's norm, summed over the stages
        assert abs(x - y) <= 1e-4 * x, norms
    summaries = [json.loads((r / "summary.json").read_text()) for r in (single, pp)]
    for key in ("key_accuracy_before", "key_accuracy_after"):
        assert summaries[0][key] == summaries[1][key], summaries
    want, got = (load_file(r / "adapter" / "adapter_model.safetensors") for r in (single, pp))
    assert want.keys() == got.keys() and any("layers.1." in k for k in got), sorted(got)[:4]  # both stages' layers
    for name in want:
        assert torch.allclose(want[name], got[name], rtol=1e-4, atol=1e-6), name
