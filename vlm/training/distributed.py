"""Process group and DeepSpeed config: the same code path for 1 CPU process, torchrun, and the
deepspeed launcher on one or many GPU nodes (gloo on CPU, nccl on CUDA)."""
from __future__ import annotations

import copy
import json
import os
from datetime import timedelta

import torch
from torch.distributed.elastic.utils.distributed import get_free_port

from vlm.config.threads import apply_cpu_threads


def set_env_defaults() -> bool:
    """Fill the torch.distributed env for a single process without a launcher. True if it did."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", "0")
        return False
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(get_free_port()))
    return True


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but torch sees no CUDA device")
    return requested


def disable_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory comm op.

    When DeepSpeed creates its torch comm backend (``deepspeed.comm.torch.TorchBackend.__init__``)
    it calls ``build_shm_op()``, which on the CPU accelerator JIT-compiles ``deepspeed_shm_comm``
    with ninja: about 60 s on 2 cores, once per process and cache dir, for an op only
    ``inference_all_reduce`` uses (not training). ``build_shm_op`` returns None when the op is
    marked incompatible in ``deepspeed.ops.__compatible_ops__``, a module-level dict DeepSpeed builds
    on first access and keeps ("edits to it persist", deepspeed/ops/__init__.py); DeepSpeed 0.19 has
    no public switch for it (``DS_BUILD_SHM_COMM`` only affects pip pre-builds, ``DS_ACCELERATOR=cpu``
    does not stop the build). Set ``VLM_KEEP_DS_SHM_OP=1`` to keep the op."""
    if os.environ.get("VLM_KEEP_DS_SHM_OP") == "1":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def set_default_collective_timeout(timeout_s: int) -> None:
    """Make ``timeout_s`` the timeout of every process group, not only the default one.

    DeepSpeed creates its own groups (data parallel, ...) with ``torch.distributed.new_group`` and
    no timeout, and torch then uses its module default (30 min for gloo, 10 min for NCCL), read at
    call time from ``distributed_c10d.default_pg_timeout`` / ``default_pg_nccl_timeout``: so a
    stalled rank would block ZeRO's gradient reductions for that long whatever we passed to
    ``init_distributed``. Setting both module defaults before the groups exist fixes that."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if isinstance(getattr(c10d, name, None), timedelta):
            setattr(c10d, name, timeout)


def init_distributed(device: str, timeout_s: int = 1800, cpu_threads: int | None = None) -> dict:
    """Initialise torch.distributed through DeepSpeed; returns rank / world / local_rank info.
    Without a launcher (plain ``python -m vlm.train``) the env of a 1-process group is filled in
    (``set_env_defaults``); torchrun and the deepspeed launcher set it themselves."""
    set_env_defaults()
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
    local_world = local_world_size(os.environ)
    if device == "cpu":
        apply_cpu_threads(cpu_threads, local_world)
    import deepspeed

    if device == "cpu":
        disable_shm_comm_op()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    set_default_collective_timeout(timeout_s)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", auto_mpi_discovery=False,
                                   timeout=timedelta(seconds=timeout_s), verbose=False)
    return {"rank": torch.distributed.get_rank(), "world_size": torch.distributed.get_world_size(),
            "local_rank": local_rank, "device": device, "warning": oversubscribed(device, local_world, cpu_cores())}


def local_world_size(env) -> int:
    """The ranks on this machine: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, else
    WORLD_SIZE (one machine)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        if env.get(key):
            return int(env[key])
    return 1


def cpu_cores() -> int:
    return os.cpu_count() or 1


def oversubscribed(device: str, local_world: int, cores: int) -> str | None:
    """One warning line when a CPU run starts more ranks on this machine than it has cores (e.g.
    ``deepspeed --num_gpus 8`` where there is no GPU: the launcher starts 8 CPU ranks); None otherwise."""
    if device != "cpu" or local_world <= cores:
        return None
    return (f"[train] warning: {local_world} CPU ranks on this machine, which has {cores} cores: they share "
            "them (slower than fewer ranks); --num_gpus / --nproc_per_node start that many ranks also where "
            "there is no GPU")


COLLECTIVE_FAILURE_MARKS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "timed out",
                            "broken pipe", "watchdog")


def collective_failure(err: BaseException) -> str | None:
    """One line saying why, if ``err`` is a failed or timed-out collective (a peer rank died or
    stalled past ``dist_timeout_s``); None for any other error."""
    text = str(err).strip()
    dist_error = getattr(torch.distributed, "DistError", ())
    if not (isinstance(err, dist_error) or (isinstance(err, RuntimeError) and any(
            m in text.lower() for m in COLLECTIVE_FAILURE_MARKS))):
        return None
    first = text.splitlines()[0] if text else type(err).__name__
    return f"{type(err).__name__}: {first[:300]}"


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a (CPU) tensor over ranks; NCCL only reduces CUDA tensors, so it travels via the GPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        if torch.distributed.get_backend() == "nccl":
            dev = t.to(f"cuda:{torch.cuda.current_device()}")
            torch.distributed.all_reduce(dev)
            return dev.cpu()
        torch.distributed.all_reduce(t)
    return t


# --- DeepSpeed config ---------------------------------------------------------------------------
def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def build_ds_config(cfg, world_size: int, bf16: bool) -> dict:
    """configs/deepspeed/<preset>.json + deepspeed_overrides, with the batch, clipping and precision
    fields filled from the training YAML (the single source of truth for them); on one rank ``overlap_comm``
    (nothing to overlap; DeepSpeed would synchronize the device after every backward) and ZeRO-1/2's
    ``contiguous_gradients`` (a copy per parameter into buckets that are never reduced) are off."""
    with open(cfg.deepspeed_json(), encoding="utf-8") as f:
        ds = json.load(f)
    ds = _merge(ds, cfg.deepspeed_overrides or {})
    t = cfg.train
    ds["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    ds["gradient_accumulation_steps"] = t.grad_accum
    ds["train_batch_size"] = t.micro_batch_size * t.grad_accum * world_size
    ds["gradient_clipping"] = float(t.grad_clip)
    bf = ds.get("bf16") if isinstance(ds.get("bf16"), dict) else {}
    bf = {**bf, "enabled": bool(bf16)}
    if bf16:
        bf.setdefault("check_grad_overflow", True)  # a non-finite gradient skips the step in bf16 too
    ds["bf16"] = bf
    ds["fp16"] = {"enabled": False}
    for key in ("optimizer", "scheduler"):  # we pass a torch AdamW and a LambdaLR ourselves
        ds.pop(key, None)
    zo = ds.get("zero_optimization")
    user_zo = (cfg.deepspeed_overrides or {}).get("zero_optimization") or {}
    if world_size == 1 and isinstance(zo, dict) and zo.get("overlap_comm") and "overlap_comm" not in user_zo:
        # one rank: no gradient reduction to overlap, and with it on ZeRO-2 synchronizes the device at the
        # end of every backward (an explicit deepspeed_overrides value is kept)
        zo["overlap_comm"] = False
    if world_size == 1 and isinstance(zo, dict) and zo.get("stage") in (1, 2) and "contiguous_gradients" not in user_zo:
        # one rank: the gradients stay in .grad (DeepSpeed would copy each into a bucket, then into the
        # partition buffer: two copies per parameter per step); one_rank.py skips the reduction itself
        zo["contiguous_gradients"] = False
    ds.setdefault("steps_per_print", 10 ** 9)
    ds.setdefault("wall_clock_breakdown", False)
    return ds
