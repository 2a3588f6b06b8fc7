"""Multi-process JAX from the environment: TPU pods, SLURM/GPU clusters, local CPU processes.

`initialize_from_env()` must run before anything touches a JAX device. It picks,
in this order:

1. explicit variables (any launcher, local CPU tests):
   ADAFLASH_COORDINATOR=host:port, ADAFLASH_NUM_PROCESSES, ADAFLASH_PROCESS_ID
   (optional ADAFLASH_LOCAL_DEVICE_IDS=0,1,...);
2. SLURM (SLURM_NTASKS > 1): process count / id from SLURM_NTASKS / SLURM_PROCID,
   the coordinator from ADAFLASH_COORDINATOR or else the job's first node;
3. a Cloud TPU VM: `jax.distributed.initialize()` with no arguments (the pod's
   workers are found from the TPU metadata);
4. otherwise a single process: nothing to do.

ADAFLASH_DISTRIBUTED=0 forces (4). A program started on only some workers would
wait forever for the rest (the classic pod deadlock); instead, after
ADAFLASH_INIT_TIMEOUT seconds (default 300) `DistributedInitError` says how many
processes were expected and what to check. CPU processes exchange data over
gloo (TCP), so the same code runs as N local processes on loopback.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

import jax
import numpy as np

ENV_COORDINATOR = "ADAFLASH_COORDINATOR"
ENV_NUM_PROCESSES = "ADAFLASH_NUM_PROCESSES"
ENV_PROCESS_ID = "ADAFLASH_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "ADAFLASH_LOCAL_DEVICE_IDS"
ENV_TIMEOUT = "ADAFLASH_INIT_TIMEOUT"
ENV_DISABLE = "ADAFLASH_DISTRIBUTED"
DEFAULT_TIMEOUT_S = 300
# jax aborts the whole process (a C++ fatal error, no Python exception) when its own
# timeout expires, so it gets a longer one and ours fires first with a readable message.
_JAX_TIMEOUT_MARGIN_S = 120


class DistributedInitError(RuntimeError):
    """The processes of a multi-process job could not find each other."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    mode: str  # "single" | "explicit" | "slurm" | "tpu"
    num_processes: int | None = None  # None: detected by jax (TPU metadata)
    process_id: int | None = None
    coordinator: str | None = None  # None: detected by jax
    local_device_ids: tuple[int, ...] | None = None
    hint: str = ""  # what to check when the processes do not all arrive


def _int_env(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def _on_cloud_tpu_vm() -> bool:
    try:
        from jax._src import cloud_tpu_init

        return bool(cloud_tpu_init.running_in_cloud_tpu_vm)
    except (ImportError, AttributeError):  # private module moved: fall back to the device files
        return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")


def _tpu_process_count(env) -> int | None:
    """Workers in the TPU job (all slices), or None when unknown (then jax detects it)."""
    workers = env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES")
    if workers:
        return len(workers.split(",")) * int(env.get("MEGASCALE_NUM_SLICES") or 1)
    try:  # GCE TPU VMs: the worker list is in the VM metadata
        from jax._src.clusters import cloud_tpu_cluster

        gce = cloud_tpu_cluster.GceTpuCluster
        return int(gce.get_process_count()) if gce.is_env_present() else None
    except Exception:  # noqa: BLE001 - private API or metadata server unavailable: let jax decide
        return None


def detect(env=None) -> ClusterSpec:
    """What the environment asks for (pure: reads variables only, starts nothing)."""
    env = os.environ if env is None else env
    if env.get(ENV_DISABLE, "").strip().lower() in ("0", "false", "no", "off"):
        return ClusterSpec("single")
    local_ids = None
    if env.get(ENV_LOCAL_DEVICE_IDS, "").strip():
        local_ids = tuple(int(s) for s in env[ENV_LOCAL_DEVICE_IDS].split(",") if s.strip())
    explicit = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if env.get(k)]
    if ENV_NUM_PROCESSES in explicit or ENV_PROCESS_ID in explicit:
        missing = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if k not in explicit]
        if missing:
            raise ValueError(f"multi-process run: {', '.join(explicit)} set but {', '.join(missing)} "
                             "missing; set all three (see launch/README.md)")
        n, pid = _int_env(env, ENV_NUM_PROCESSES), _int_env(env, ENV_PROCESS_ID)
        if n < 1 or not 0 <= pid < n:
            raise ValueError(f"{ENV_PROCESS_ID}={pid} must lie in [0, {ENV_NUM_PROCESSES}={n})")
        if n == 1:
            return ClusterSpec("single")
        return ClusterSpec("explicit", n, pid, env[ENV_COORDINATOR], local_ids,
                           hint=f"every process must be started with {ENV_NUM_PROCESSES}={n}, its own "
                                f"{ENV_PROCESS_ID} in 0..{n - 1} and the same {ENV_COORDINATOR}="
                                f"{env[ENV_COORDINATOR]} (reachable from all hosts; process 0 listens "
                                "there)")
    if env.get("SLURM_NTASKS") and env.get("SLURM_PROCID"):
        n, pid = _int_env(env, "SLURM_NTASKS"), _int_env(env, "SLURM_PROCID")
        if n > 1:
            coordinator = env.get(ENV_COORDINATOR) or None
            if coordinator is None and not env.get("SLURM_STEP_NODELIST"):
                raise ValueError(f"SLURM job with {n} tasks but no coordinator: run under srun (which "
                                 f"sets SLURM_STEP_NODELIST) or set {ENV_COORDINATOR}=host:port")
            return ClusterSpec("slurm", n, pid, coordinator, local_ids,
                               hint=f"SLURM_NTASKS={n}: all tasks must start (srun, not a bare python); "
                                    f"check SLURM_NTASKS / SLURM_PROCID and that {ENV_COORDINATOR} (or the "
                                    "first node of SLURM_STEP_NODELIST) is reachable")
    if _on_cloud_tpu_vm():
        n = _tpu_process_count(env)
        if n == 1:
            return ClusterSpec("single")  # one-host slice (e.g. v6e-8): nothing to join
        return ClusterSpec("tpu", n, None, None, None,
                           hint="every worker of the TPU slice must run the same command: use "
                                "`gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...` "
                                "(launch/tpu_pod.sh), not ssh to one worker")
    return ClusterSpec("single")


def _enable_cpu_collectives() -> None:
    """CPU devices of different processes talk over gloo (TCP); harmless on GPU/TPU."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError, KeyError):  # option renamed/removed in a later jax
        pass


def initialize_from_env(timeout_s: float | None = None) -> ClusterSpec:
    """Joins the multi-process job the environment describes (see the module docstring).

    Idempotent. Raises DistributedInitError when the other processes do not arrive
    within `timeout_s` (default: $ADAFLASH_INIT_TIMEOUT or 300 s), ValueError on
    inconsistent variables, RuntimeError when JAX already started its devices.
    """
    spec = detect()
    if spec.mode == "single" or jax.distributed.is_initialized():
        return spec
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(f"{spec.mode} multi-process run requested, but JAX devices were already "
                           "used in this process; call initialize_from_env() first")
    if timeout_s is None:
        timeout_s = float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
    _enable_cpu_collectives()
    kwargs = dict(initialization_timeout=int(timeout_s) + _JAX_TIMEOUT_MARGIN_S)
    if spec.mode != "tpu":
        kwargs.update(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                      process_id=spec.process_id, local_device_ids=spec.local_device_ids)
    # jax blocks in C++ until all processes have registered; waiting in a helper thread
    # lets this one give up with a clear error instead of hanging or aborting.
    errors: list[BaseException] = []

    def connect():
        try:
            jax.distributed.initialize(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)

    worker = threading.Thread(target=connect, name="jax-distributed-init", daemon=True)
    worker.start()
    worker.join(timeout_s)
    expected = (f"{spec.num_processes} processes" if spec.num_processes
                else "all workers of the TPU slice")
    where = f"process {spec.process_id}" if spec.process_id is not None else "this worker"
    if worker.is_alive():
        raise DistributedInitError(
            f"{where} waited {timeout_s:.0f} s for {expected} to join the {spec.mode} job (coordinator "
            f"{spec.coordinator or 'auto-detected'}) and they did not all arrive: only part of the job is "
            f"running. {_sentence(spec.hint)}. Raise {ENV_TIMEOUT} if workers start slowly.")
    if errors:
        raise DistributedInitError(f"{where} could not join the {spec.mode} job of {expected}: "
                                   f"{errors[0]}. {_sentence(spec.hint)}.") from errors[0]
    if is_main_process():
        print(f"[distributed] {jax.process_count()} processes ({spec.mode}), "
              f"{jax.device_count()} devices in total", file=sys.stderr, flush=True)
    return dataclasses.replace(spec, num_processes=jax.process_count(), process_id=jax.process_index())


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def is_main_process() -> bool:
    """True on process 0, the one that logs and writes single-copy files."""
    return jax.process_index() == 0


def to_host(tree):
    """numpy copy of a pytree of (possibly multi-process) arrays; every process must call it."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x)

    return jax.tree.map(one, tree)


def barrier(name: str) -> None:
    """Waits until every process reaches `name` (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
