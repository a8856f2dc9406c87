"""Several processes from the same config: DDP, FSDP2 or DeepSpeed, all through Accelerate.

Launch with ``torchrun --nproc-per-node N -m onegpu train ...`` or
``accelerate launch --num-processes N -m onegpu train ...``; a plain ``onegpu train`` is one
process. The rules that keep a run's meaning independent of the process count:

* Global batch: ``training.grad_accum`` is the accumulation of the *single-process* run. With N
  processes each accumulates grad_accum / N micro-batches, so micro_batch x grad_accum sequences
  still make one optimizer step (``distributed.keep_global_batch``; must divide, else a
  ConfigError).
* Data: the single-process order of micro-batches is cut round-robin: process r takes micro-batches
  r, r+N, r+2N, ... so every global batch holds exactly the examples of the one-process run.
* Gradients: each process's loss is divided by the target-token count of the *global* batch, and
  ranks average gradients, so the loss is scaled by N to make that average the global sum.
* Only rank 0 writes logs, progress and files (the loop checks ``is_main_process``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

from onegpu.config import Config
from onegpu.errors import ConfigError

log = logging.getLogger(__name__)


def world_size() -> int:
    """Processes in this job, as the launcher (torchrun / accelerate launch) announced them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def strategy(cfg: Config, world: int | None = None) -> str:
    """The engine for this run: "single", "ddp", "fsdp2" or "deepspeed".

    DeepSpeed is used even in one process when offload is asked for (it is what moves the state);
    DDP and FSDP2 only mean something with several processes.
    """
    world = world_size() if world is None else world
    chosen = cfg.distributed.strategy
    if cfg.techniques.offload != "none":
        if chosen not in ("auto", "deepspeed"):
            raise ConfigError(
                f"techniques.offload={cfg.techniques.offload} runs on DeepSpeed, but "
                f"distributed.strategy={chosen}.",
                hint="set distributed.strategy=deepspeed (or auto), or techniques.offload=none",
            )
        return "deepspeed"
    if chosen == "deepspeed":
        return "deepspeed"
    if world == 1:
        if chosen == "fsdp2":
            log.info(
                "distributed.strategy=fsdp2 with one process: nothing to shard, training without it"
            )
        return "single"
    return "ddp" if chosen == "auto" else chosen


def shards_weights(cfg: Config, world: int | None = None) -> bool:
    """The weights themselves are split across processes (FSDP2, ZeRO-3): code outside the
    model's forward cannot use them as plain tensors."""
    from onegpu.distributed.zero import zero_stage

    chosen = strategy(cfg, world)
    return chosen == "fsdp2" or (chosen == "deepspeed" and zero_stage(cfg) == 3)


def global_accum(cfg: Config, world: int | None = None) -> int:
    """Micro-batches per optimizer step summed over all processes."""
    world = world_size() if world is None else world
    t = cfg.training
    return t.grad_accum if cfg.distributed.keep_global_batch else t.grad_accum * world


def local_accum(total_accum: int, world: int | None = None) -> int:
    """Micro-batches one process accumulates per step; the global batch must split evenly."""
    world = world_size() if world is None else world
    if total_accum % world:
        raise ConfigError(
            f"training.grad_accum={total_accum} cannot be split over {world} processes: the "
            f"effective batch is kept by giving each process grad_accum / {world} micro-batches.",
            hint=f"set training.grad_accum to a multiple of {world}, or "
            "--distributed.keep_global_batch false (grad_accum per process; the batch grows)",
        )
    return total_accum // world


def ensure_process_env() -> None:
    """DeepSpeed always runs inside a torch.distributed process group, even for one process.
    Without a launcher, describe a one-process group on this machine (a free local port)."""
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        return
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }
    for key, value in env.items():
        os.environ.setdefault(key, value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerator_kwargs(cfg: Config, precision: str, on_gpu: bool) -> dict:
    """Extra Accelerator(...) arguments: DeepSpeed's plugin and precision when the run uses it.
    (FSDP2 needs none: apply_fsdp2 shards the model with torch directly.)"""
    engine = strategy(cfg)
    local_accum(
        global_accum(cfg)
    )  # a batch that cannot split fails now, not after loading the model
    if engine == "deepspeed":
        from onegpu.distributed import zero

        zero.check(cfg)
        ensure_process_env()
        world = world_size()
        plugin = zero.accelerate_plugin(
            cfg, precision, world, local_accum(global_accum(cfg, world), world), on_gpu
        )
        # DeepSpeed keeps fp32 master weights itself: pure bf16 is its plain bf16 mode.
        mixed = {"fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16"}.get(precision, "no")
        return {"deepspeed_plugin": plugin, "mixed_precision": mixed}
    return {}


def apply_fsdp2(model, cfg: Config, precision: str, accelerator):
    """Shard the model with torch's FSDP2 (``fully_shard``, per-parameter DTensor sharding): each
    decoder layer is its own shard group (gathered just before it runs, freed after), then the root.

    We call torch's engine directly rather than Accelerate's FSDP plugin, which only switches on
    for GPU-type devices: one code path then runs on GPUs and on CPU processes (gloo) alike.
    Mixed precision is FSDP's own policy: layers compute in bf16/fp16 while the sharded master
    weights stay fp32 and gradients are reduced in fp32. Call before the optimizer is built.
    """
    if strategy(cfg) != "fsdp2":
        return model
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    policy = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype
        else MixedPrecisionPolicy()
    )
    world, device = world_size(), accelerator.device
    if cfg.distributed.fsdp_sharding == "hybrid":
        mesh = init_device_mesh(
            device.type,
            hybrid_mesh(world, local_world_size()),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    model.to(device)
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    log.info(
        "FSDP2 (%s sharding) over %d processes, %d decoder layers",
        cfg.distributed.fsdp_sharding,
        world,
        len(layers),
    )
    return model


def _decoder_layers(model) -> list:
    """The repeated blocks named by the model itself (transformers' _no_split_modules)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"cannot find the decoder layers of {type(model).__name__} to shard.",
            hint="use distributed.strategy=ddp or deepspeed for this model",
        )
    return layers


def is_fsdp2(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def prepare(accelerator, model, optimizer):
    """accelerator.prepare, except that an FSDP2 model is already distributed (no DDP around it)."""
    if is_fsdp2(model):
        return model, accelerator.prepare_optimizer(optimizer)
    return accelerator.prepare(model, optimizer)


def hybrid_mesh(world: int, local_world: int) -> tuple[int, int]:
    """(replicas, shard size) for hybrid sharding: shard inside a node, replicate across nodes."""
    if local_world < 2 or world % local_world:
        raise ConfigError(
            f"distributed.fsdp_sharding=hybrid needs at least 2 processes per node and the same "
            f"number on every node (got {world} processes, {local_world} per node).",
            hint="use distributed.fsdp_sharding=full",
        )
    if world == local_world:
        log.info(
            "hybrid sharding on a single node shards over all %d processes (same as full)", world
        )
    return world // local_world, local_world


def fix_cpu_deepspeed_state(accelerator) -> None:
    """Accelerate counts processes only for GPU-type backends, so DeepSpeed on CPU processes (gloo,
    our multi-process tests) would see itself as process 0 of 1 while DeepSpeed's own process group
    spans them all. Align Accelerate's bookkeeping with that group; nothing else changes."""
    import torch.distributed as dist

    if (
        not (is_deepspeed(accelerator) and dist.is_initialized())
        or accelerator.num_processes == dist.get_world_size()
    ):
        return
    from accelerate.state import AcceleratorState, PartialState

    fix = {
        "num_processes": dist.get_world_size(),
        "process_index": dist.get_rank(),
        "local_process_index": int(os.environ.get("LOCAL_RANK", "0")),
    }
    PartialState._shared_state.update(fix)
    AcceleratorState._shared_state.update(fix)


# ------------------------------------------------------------------------------- inside the step
def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def is_sharded(accelerator, model) -> bool:
    """Model or optimizer state is split across processes (FSDP2, DeepSpeed): saving and loading
    must involve every process."""
    return is_deepspeed(accelerator) or is_fsdp2(model)


def full_state_dict(accelerator, model) -> dict:
    """Full (unsharded) weights on the main process; a collective, so every process calls it."""
    if is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return accelerator.get_state_dict(model)


def accumulating(accelerator, model, last: bool):
    """Context for one micro-batch's backward: gradients are synchronised (and, under DeepSpeed, the
    optimizer steps) only on the last micro-batch of the step."""
    if is_deepspeed(accelerator):
        # DeepSpeed decides the boundary from Accelerate's sync flag inside accelerator.backward.
        accelerator.gradient_state._set_sync_gradients(last)
        return contextlib.nullcontext()
    if is_fsdp2(model):
        model.set_requires_gradient_sync(last)  # reduce-scatter only once per step
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else accelerator.no_sync(model)


def backward(accelerator, loss) -> None:
    """Backward of a loss already normalised by the global target-token count.

    Every engine *averages* gradients over processes; scaling by the process count turns that
    average into the sum the one-process run computes. DeepSpeed would also divide by its
    accumulation steps, which our token normalisation already accounts for.
    """
    n = accelerator.num_processes
    loss = loss * n if n > 1 else loss
    if is_deepspeed(accelerator):
        accelerator.backward(loss, scale_wrt_gas=False)
    else:
        accelerator.backward(loss)


def clip_grad_norm(accelerator, model, max_norm: float):
    """Clip and return the global gradient norm as a tensor. DeepSpeed clips inside its own step
    (gradient_clipping in the generated config) and reports the norm as a float."""
    import torch

    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor; the value is the same on every process
        return norm.full_tensor()
    if norm is None or isinstance(norm, torch.Tensor):
        return norm
    return torch.tensor(float(norm))


def global_loss(accelerator, total):
    """Each process holds its share of the step's mean loss; their sum is the global mean."""
    if accelerator.num_processes == 1 or total is None:
        return total
    return accelerator.reduce(total, reduction="sum")
