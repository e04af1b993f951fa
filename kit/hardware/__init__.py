"""What this machine can do for the run, and how it should train: ``detect()`` then ``plan()``.

Holds :func:`detect` (platform, GPUs, CPU cores, RAM, free disk; every probe fault-tolerant and
injectable for tests), :class:`TrainingNeeds` (what one run asks of a peer), :func:`plan` (device,
precision, micro-batch and accumulation, 8-bit optimizer, offload, checkpointing, or auxiliary),
the analytic memory model :func:`estimate_memory`, and :func:`make_torch_probe`, which measures
the real peak memory of one forward/backward. It does not build the model, the optimizer or the
training loop: the volunteer flow reads the :class:`TrainingPlan` and does that.

How a plan is made, in order:

1. Device. The first CUDA GPU the installed torch can run (its arch list is checked, so a Kaggle
   P100, sm_60, is refused by current builds with a reason), and every other GPU of the same
   model (one peer trains on all of them: a replica per GPU, ``kit.training.replicas``; the plan
   says e.g. "2 × Tesla T4" and counts their samples once), else Apple MPS, else the CPU.
2. Precision. bf16 on compute capability >= 8.0 (Ampere and newer); fp16 autocast with a
   GradScaler below that (T4, V100, P100). ``torch.cuda.is_bf16_supported()`` is not used: it
   says True on a T4, where bf16 only runs by slow emulation. fp32 on CPU and on MPS (see
   :data:`MPS_PRECISION`).
3. Micro-batch. On a GPU, the largest micro-batch whose peak memory fits under
   ``max_memory_fraction`` of the device, found by doubling then bisecting (powers of two are
   tried first) with a memory probe if one is given, else with :func:`estimate_memory`.
   If fewer than :data:`MIN_USEFUL_MICRO_BATCH` samples fit, memory savers are tried in this
   order and each is kept only if it helps: 8-bit optimizer states (only for LAMB runs where
   bitsandbytes imports, CUDA only: what ``kit.training.lamb8bit`` can build), optimizer offload
   to CPU RAM (cheap in collaborative training: the optimizer steps once per global step), then
   gradient checkpointing (~1/3 more compute per step; kit checkpoints ALBERT itself,
   ``kit.training.checkpointing``, since transformers 5 refuses to). ``kit.training.assembly``
   builds every choice; a "lamb8bit" run plans with 8-bit statistics from the start.
4. Accumulation. ``accumulation = ceil(target / max_micro)``, then the micro-batch is lowered to
   ``ceil(target / accumulation)``: the fewest micro-steps, and at most ``accumulation - 1``
   samples above the target (never fewer samples than asked).
5. Auxiliary. A CPU-only machine whose estimated speed is under ``min_samples_per_second``, or a
   GPU where not even one sample fits, joins as an auxiliary peer: it helps average and
   brings no gradients (DeDLOC's auxiliary peers; hivemind ``auxiliary=True``).

Symptoms, for volunteers:

* "CUDA out of memory" after joining: lower ``max_memory_fraction`` (e.g. 0.8); other programs
  on the GPU, or memory fragmentation, took more than the plan left free.
* GPU memory mostly idle while the plan accumulates several micro-batches: raise
  ``max_memory_fraction`` (at most 0.95), or give ``plan`` a probe from :func:`make_torch_probe`
  (measured peaks are tighter than the analytic estimate, which errs on the safe side).
* "joining as an auxiliary peer" on a laptop that should train: lower
  ``min_samples_per_second``; your gradients then arrive slowly but do count.
"""

from kit.hardware.detect import (
    GPU,
    Hardware,
    Platform,
    detect,
    detect_platform,
)
from kit.hardware.memory import (
    MemoryEstimate,
    TorchMemoryProbe,
    TrainingNeeds,
    estimate_memory,
    largest_fitting_batch,
    make_torch_probe,
    needs_from_model,
    supports_gradient_checkpointing,
)
from kit.hardware.plan import TrainingPlan, plan

__all__ = [
    "GPU",
    "Hardware",
    "MemoryEstimate",
    "Platform",
    "TorchMemoryProbe",
    "TrainingNeeds",
    "TrainingPlan",
    "detect",
    "detect_platform",
    "estimate_memory",
    "largest_fitting_batch",
    "make_torch_probe",
    "needs_from_model",
    "plan",
    "supports_gradient_checkpointing",
]
