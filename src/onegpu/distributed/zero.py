"""DeepSpeed ZeRO's configuration, generated: for several processes (distributed.strategy=deepspeed)
and for CPU/NVMe offload, for models whose weights, gradients and Adam state do not fit on one GPU.

The DeepSpeed config is *generated* from our own settings (micro-batch, accumulation, precision,
clipping), never written by hand with "auto" placeholders, so the two can never disagree
(transformers#27830). The optimizer and the learning-rate schedule stay ours: DeepSpeed wraps the
torch optimizer we build, and our LambdaLR keeps driving its learning rate.

    offload     ZeRO stage  optimizer state   parameters
    zero2-cpu   2           CPU               GPU (gradients partitioned)
    zero3-cpu   3           CPU               CPU, fetched layer by layer
    zero3-nvme  3           NVMe (nvme_path)  NVMe (nvme_path)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from onegpu.config import Config
from onegpu.errors import ConfigError, UnavailableError

log = logging.getLogger(__name__)

STAGE = {"zero2-cpu": 2, "zero3-cpu": 3, "zero3-nvme": 3}
# Optimizers whose state DeepSpeed can partition and move: plain tensors per parameter. 8/4-bit
# optimizers keep quantized state DeepSpeed cannot flatten; Adafactor's factored state neither.
COMPATIBLE_OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused", "sgd")
# DeepSpeed's name for its CPU shared-memory all-reduce op (op_builder.cpu.ShareMemCommBuilder.NAME)
SHM_ALLREDUCE_OP = "deepspeed_shm_comm"


def require_deepspeed():
    try:
        import deepspeed
    except ImportError:
        raise UnavailableError(
            "DeepSpeed is not installed (needed for techniques.offload / "
            "distributed.strategy=deepspeed).",
            hint="pip install 'onegpu[deepspeed]'",
        ) from None
    return deepspeed


def skip_cpu_shm_allreduce() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce (C++, JIT) when its process group
    starts: 70-90 s on 2 cores on a fresh machine, and an error where there is no compiler. Only
    its inference path calls it (TorchBackend.inference_all_reduce); training reduces through
    torch.distributed. Marking the op incompatible skips the build, as DeepSpeed itself does on a
    platform without it (deepspeed.comm.torch.build_shm_op)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_ALLREDUCE_OP] = False


def zero_stage(cfg: Config) -> int:
    """The ZeRO stage: fixed by the offload mode, else distributed.zero_stage."""
    return STAGE.get(cfg.techniques.offload, cfg.distributed.zero_stage)


def check(cfg: Config) -> None:
    """Settings that cannot work under DeepSpeed: one clear error before anything is built."""
    tech = cfg.techniques
    if tech.optimizer not in COMPATIBLE_OPTIMIZERS:
        raise ConfigError(
            f"techniques.optimizer={tech.optimizer} cannot run under DeepSpeed ZeRO "
            f"(techniques.offload={tech.offload}, "
            f"distributed.strategy={cfg.distributed.strategy}): its optimizer state is not plain "
            "per-parameter tensors that ZeRO can partition.",
            hint=f"use techniques.optimizer one of {', '.join(COMPATIBLE_OPTIMIZERS)}",
        )
    if tech.lora.quantize_base != "none":
        raise ConfigError(
            "techniques.lora.quantize_base cannot be combined with DeepSpeed offload: "
            "ZeRO cannot partition bitsandbytes-quantized weights.",
            hint="use QLoRA without offload (the 4-bit base already fits), or quantize_base=none",
        )
    if tech.offload == "zero3-nvme":
        _check_nvme(Path(tech.nvme_path).expanduser())


def _check_nvme(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".onegpu-write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"techniques.nvme_path={path} is not a writable folder ({exc.strerror}).",
            hint="point techniques.nvme_path at a folder on a fast local NVMe drive",
        ) from None


def ds_config(cfg: Config, precision: str, world_size: int, local_accum: int, on_gpu: bool) -> dict:
    """The complete DeepSpeed config for this run, derived from our settings (no "auto" values)."""
    t, tech = cfg.training, cfg.techniques
    stage = zero_stage(cfg)
    zero: dict = {"stage": stage, "overlap_comm": on_gpu, "contiguous_gradients": True}
    if tech.offload != "none":
        zero.update(_offload_targets(tech.offload, Path(tech.nvme_path).expanduser(), on_gpu))
    if stage == 3:
        # Full 16-bit weights are gathered on save so checkpoints and the final model are ordinary
        # save_pretrained folders, not per-rank shards.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": local_accum,
        "train_batch_size": t.micro_batch_size * local_accum * world_size,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": precision in ("bf16", "bf16-pure")},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # Our torch optimizer runs on the offloaded state when DeepSpeed's CPU Adam is not used.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # the loop logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }
    return ds


def _offload_targets(mode: str, nvme_path: Path, on_gpu: bool) -> dict:
    pin = on_gpu  # page-locked host buffers only help GPU<->CPU copies
    if mode == "zero2-cpu":
        return {"offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    if mode == "zero3-cpu":
        return {
            "offload_optimizer": {"device": "cpu", "pin_memory": pin},
            "offload_param": {"device": "cpu", "pin_memory": pin},
        }
    path = str(nvme_path)
    return {
        "offload_optimizer": {"device": "nvme", "nvme_path": path, "pin_memory": pin},
        "offload_param": {"device": "nvme", "nvme_path": path, "pin_memory": pin},
    }


def accelerate_plugin(cfg: Config, precision: str, world_size: int, local_accum: int, on_gpu: bool):
    """Accelerate's DeepSpeedPlugin carrying our generated config.

    ZeRO-3 turns on ``zero3_init_flag`` so that ``from_pretrained`` creates the model already
    partitioned (deepspeed.zero.Init): a model larger than one device never exists whole.
    """
    require_deepspeed()
    if not on_gpu:
        # DeepSpeed picks its accelerator at import; without CUDA it must be its CPU backend.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if os.environ.get("DS_ACCELERATOR") == "cpu":  # also the simulated card's
        skip_cpu_shm_allreduce()
    from accelerate.utils import DeepSpeedPlugin

    config = ds_config(cfg, precision, world_size, local_accum, on_gpu)
    stage = config["zero_optimization"]["stage"]
    log.info(
        "DeepSpeed ZeRO-%d%s, %d process(es), %d x %d micro-batches per process",
        stage,
        f" with {cfg.techniques.offload} offload" if cfg.techniques.offload != "none" else "",
        world_size,
        local_accum,
        cfg.training.micro_batch_size,
    )
    return DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=stage == 3)
