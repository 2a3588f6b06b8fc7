#!/usr/bin/env python3
"""Runs one command as N cooperating JAX processes on this machine (CPU, loopback).

    python launch/local.py -n 2 -- adaflash train tiny mesh.data=2

Each process gets ADAFLASH_COORDINATOR=127.0.0.1:PORT (a port free at start-up),
ADAFLASH_NUM_PROCESSES, ADAFLASH_PROCESS_ID, JAX_PLATFORMS=cpu and
--xla_force_host_platform_device_count, so the job sees N x devices-per-process
CPU devices joined by gloo: a multi-host run without the hosts. Output lines are
prefixed with the process id. The first process to fail stops the others and its
exit code is returned; Ctrl-C sends SIGTERM (the trainer saves a checkpoint and
exits), a second Ctrl-C or the grace period's end kills them.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(base: dict, *, num_processes: int, process_id: int, port: int,
              devices_per_process: int) -> dict:
    """The environment of process `process_id` (see the module docstring)."""
    env = dict(base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", ADAFLASH_COORDINATOR=f"127.0.0.1:{port}",
               ADAFLASH_NUM_PROCESSES=str(num_processes), ADAFLASH_PROCESS_ID=str(process_id))
    return env


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()
    stream.close()


def _signal_all(procs, sig) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)  # the child and anything it started
            except ProcessLookupError:
                pass


def _stop(procs, grace_s: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after `grace_s`."""
    _signal_all(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def launch(command: list[str], num_processes: int, *, devices_per_process: int = 1, port: int | None = None,
           grace_s: float = 30.0, timeout_s: float | None = None, env: dict | None = None,
           prefix: bool = True) -> int:
    """Runs `command` as `num_processes` processes; returns 0 or the first failure's exit code
    (124 when `timeout_s` passed, 130 after Ctrl-C)."""
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError("need at least one process and one device per process")
    port = port or free_port()
    base = dict(os.environ if env is None else env)
    procs, pumps = [], []
    for i in range(num_processes):
        e = child_env(base, num_processes=num_processes, process_id=i, port=port,
                      devices_per_process=devices_per_process)
        p = subprocess.Popen(command, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)  # own group: Ctrl-C reaches only us
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] " if prefix else "", sys.stdout),
                             daemon=True)
        t.start()
        pumps.append(t)
    start, code = time.monotonic(), None
    try:
        while code is None:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                code = failed[0]
                print(f"[launch] process {codes.index(code)} exited with {code}; stopping the others",
                      file=sys.stderr, flush=True)
                _stop(procs, min(grace_s, 5.0))  # the rest are likely stuck in a collective
            elif all(c == 0 for c in codes):
                code = 0
            elif timeout_s is not None and time.monotonic() - start > timeout_s:
                print(f"[launch] timed out after {timeout_s:.0f} s; stopping", file=sys.stderr, flush=True)
                _stop(procs, grace_s)
                code = 124
            else:
                time.sleep(0.1)
    except KeyboardInterrupt:
        print(f"[launch] interrupted: SIGTERM to all processes (they save and exit; Ctrl-C again to "
              f"kill, or they are killed after {grace_s:.0f} s)", file=sys.stderr, flush=True)
        try:
            _stop(procs, grace_s)
        except KeyboardInterrupt:
            _signal_all(procs, signal.SIGKILL)
        code = 130
    finally:
        _signal_all(procs, signal.SIGKILL)  # never leave a child behind
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run COMMAND as N JAX processes on loopback (CPU, gloo collectives).",
        epilog="example: python launch/local.py -n 2 -- adaflash train tiny mesh.data=2")
    parser.add_argument("-n", "--num-processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=1, help="CPU devices in each process")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output with [pN]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    return launch(command, args.num_processes, devices_per_process=args.devices_per_process, port=args.port,
                  grace_s=args.grace, timeout_s=args.timeout, prefix=not args.no_prefix)


if __name__ == "__main__":
    sys.exit(main())
