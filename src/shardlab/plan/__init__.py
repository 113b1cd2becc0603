"""`shardlab plan`: predict the peak memory per rank of every engine before launch, say whether it
fits a GPU, and predict step time and tokens/s at K nodes (docs/plan.md; the model: docs/memory.md, "How shardlab plan predicts the peak").

  shardlab plan CONFIG.yaml [key=value ...] --gpu T4|L4|A100-40|A100-80|H100|H200|cpu --nproc N [--nodes K]
                [--interconnect NAME] [--engines a,b] [--json]

How the peak is predicted (per engine, per rank):

1. Model state, exactly (plan/model.py). The model is built on the meta device (no memory) and
   each engine says what a rank holds (`Plannable.planned_state`): by its rule where it has one
   (replicated engines hold every tensor whole; FSDP2, which cannot be built on meta, splits
   every parameter on dim 0 into S chunks of ceil(d0/S) rows, each rank's storage padded to
   one chunk), else built for real on the meta device on a fake process group of N ranks
   (`torch.testing._internal.distributed.fake_pg`), so its padding and ownership are its own.
   Parameters + buffers, gradients and optimizer state (AdamW: two moments + a 4-byte step per
   tensor; SGD with momentum: one buffer) are exact; the maximum over ranks is taken.
2. Everything transient (gathered parameters, unsharded gradients in flight, communication
   buffers, activations) from a probe (plan/probe.py): the engine itself runs a real training
   step on CPU, in a child process, on a fake process group of N ranks (collectives return at
   once; the memory they use is allocated as in a real run), on the model cut to
   `PROBE_LAYERS` blocks (`ModelSpec.cut_depth`), at a micro batch of at most `PROBE_TOKENS`
   tokens, measured by the live-memory tracker (shardlab.memory). The engine's real code runs,
   so its bounds (how many units are gathered, how many gradients are in flight) are measured,
   not assumed. Two figures per probe: the step's peak and the forward peak, each with its
   breakdown by part.
3. Scaled to the real model (plan/scaling.py): the sharded engines' step peak is the deeper
   probe's peak plus what each added block keeps between steps (their transients are bounded
   per unit, so they do not grow with depth); the replicated engines' parts and the forward
   peak are linear in depth; activations scale linearly in tokens per micro batch (the CPU
   attention kernel, as FlashAttention on a GPU, keeps no T x T score matrix; where a model
   materializes scores the quadratic term is NOT modelled: see docs/memory.md), and
   params/optimizer are replaced by their exact values. The predicted peak is the larger of
   the step candidate and the forward candidate (a larger batch moves the peak to where
   activations are largest). Every built-in engine, torch-ddp included, is probed on fake tensors
   (torch-ddp: PyTorch's own reducer, with the three values it reads answered by
   plan/fake_ddp.py); with `--probe real`, an engine that cannot run on real tensors on a fake
   group (`fake_group_probe`: torch-ddp) is probed on a real one-rank gloo group. Hybrid sharding
   and offload: `engine_config`, docs/memory.md.

Time (plan/clock.py, plan/traffic.py): the probed step's operations (plan/ops.py) each at what the
device does for its kind: matmuls by the roofline at the dtype's ceiling, attention by its kernel's
share of the peak, the rest at memory bandwidth, every operator's dispatch on the host (`--gpu cpu`:
each measured on this machine, plan/cpu.py); communication from an alpha-beta model per collective
(plan/catalogue.py's `INTERCONNECTS`) over the collectives each engine says a step issues
(`Plannable.step_traffic`), overlapped as the device allows ([Note: plan's clock]).

The package, one concern a module: catalogue (GPUs, links), model (the meta model and exact
state), probe, ops (the probed step's operations), scaling, predict (the prediction per engine), clock
(each operation's time), cpu (this machine's figures, `--gpu cpu`), traffic (step time), fit (the
loopback link's constants, `python -m shardlab.plan fit-loopback`), report (verdict and command),
fake_ddp (PyTorch DDP under the fake-tensor probes).
"""

from shardlab.plan.catalogue import GPU, GPUS, INTERCONNECTS, Link, usable_bytes
from shardlab.plan.fit import fit_alpha_beta, fit_per_kind, measure_collectives
from shardlab.plan.model import engine_config, model_state
from shardlab.plan.predict import Prediction, predict, predict_all
from shardlab.plan.report import add_arguments, print_report, run, verdict
from shardlab.plan.traffic import collective_time, comm_plan, comm_seconds, hiding_limit, step_time

__all__ = ["GPU", "GPUS", "INTERCONNECTS", "Link", "usable_bytes", "fit_alpha_beta", "fit_per_kind",
           "measure_collectives", "engine_config", "model_state", "Prediction", "predict", "predict_all",
           "add_arguments", "print_report", "run", "verdict", "collective_time", "comm_plan", "comm_seconds",
           "hiding_limit", "step_time"]
