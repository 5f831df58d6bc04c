"""The torch_graph decode step (graph-replayed) and encoder under each choice of attention kernels.

    python3 bench/gpu/attention.py MODEL_DIR OUT.json [tiny base ...]

MODEL_DIR gives the tokenizer (config.json, tokenizer.json; model.bin is not read): the weights
are random ones of each named shape, so no model travels. Each choice is set as every call's
attention kernels (`model.ATTENTION_BACKENDS` and `STEP_ATTENTION_BACKENDS`) before the engine
is built, so the warm-up captures the step's graph with it. The JSON is rewritten after every
measurement, for a run that is cut off. CAPTIOND_ATTENTION_SMOKE=1 runs it on the CPU (B=1, two
steps, no graphs) to check the script itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from torch.nn.attention import SDPBackend

from captiond.engines.torch_graph import bench, model

_SMOKE = os.environ.get("CAPTIOND_ATTENTION_SMOKE") == "1"
DEVICE = "cpu" if _SMOKE else "cuda"
BATCHES = [1] if _SMOKE else [1, 8, 32, 128]
STEPS = 2 if _SMOKE else 64

CHOICES = {
    # The rule from 5293b6e to 72de974: no cuDNN in any call, the step's included.
    "flash_efficient_math": (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ),
    # torch's own order (cuDNN first on Hopper with CUDA 13), as before the rule.
    "torch_default": (
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ),
    "math": (SDPBackend.MATH,),
}


def _per_batch(summary: dict[str, Any], key: str, digits: int) -> dict[str, float]:
    return {b: round(v.get(key, float("nan")), digits) for b, v in summary["batches"].items()}


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    shapes = sys.argv[3:] or ["tiny", "base"]
    audio = (0.05 * np.random.default_rng(0).standard_normal(30 * bench.SAMPLE_RATE_HZ)).astype(
        np.float32
    )
    runs: dict[str, Any] = {}
    for shape in shapes:
        for name, backends in CHOICES.items():
            model.ATTENTION_BACKENDS = model.STEP_ATTENTION_BACKENDS = backends
            started_s = time.perf_counter()
            summary = bench.measure(model_dir, DEVICE, BATCHES, STEPS, audio, shape)
            runs[f"{shape}/{name}"] = {
                "wall_s": time.perf_counter() - started_s,
                "attention_kernel": summary["attention_kernel"],
                # Absent on the CPU, where nothing is captured.
                "graphed_us_per_step": _per_batch(summary, "decode_graphed_us_per_step", 1),
                "eager_us_per_step": _per_batch(summary, "decode_eager_us_per_step", 1),
                "encoder_ms_per_window": _per_batch(summary, "encoder_ms_per_window", 3),
            }
            out.write_text(json.dumps({"device": bench.device_summary(), "runs": runs}, indent=1))
            print(shape, name, runs[f"{shape}/{name}"], flush=True)


if __name__ == "__main__":
    main()
