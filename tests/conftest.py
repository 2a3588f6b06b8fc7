"""Test-suite set-up: 8 forced host devices (mesh tests), XLA's LLVM optimisation off, and one
persistent compile cache per run, shared by its workers."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's programs are compiled far more often than run, and XLA:CPU's LLVM
# optimisation is a large part of a compile: without it two test files ran 1.35x faster,
# the suite 33.5 min instead of about 50. The HLO passes are unchanged; only the machine
# code is less optimised (rounding may differ, as between two CPUs; every tolerance holds).
# Speed is measured by the benchmarks, never here. JAX_DISABLE_MOST_OPTIMIZATIONS=0
# restores full optimisation (CLI and notebook processes the tests start inherit it).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# CLI processes the tests start use no persistent compile cache (they inherit this).
os.environ["ADAFLASH_COMPILE_CACHE"] = "0"

import jax  # noqa: E402

import pytest  # noqa: E402

_CACHE_KEY = "adaflash_compile_cache"  # the workers' input
_CACHE_DIR = pytest.StashKey[str]()  # the controller's


def pytest_configure(config):
    """One persistent compile cache for the whole run, in a fresh directory that the run
    removes at its end. Test modules drop their compiled programs (`_free_compiled_programs`)
    and many compile the same ones (SmolLM2's engine steps, the adaptive decoder's
    programs), so a later module, or the other worker, reads them back instead of compiling
    again. Fresh per run: an entry left half-written by a killed run is never read; the
    cache's size bound turns on its file lock, so one worker never reads an entry the other
    is writing. ADAFLASH_TEST_COMPILE_CACHE=0 turns it off."""
    if os.environ.get("ADAFLASH_TEST_COMPILE_CACHE", "1") == "0":
        return
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller made the directory
        path = config.workerinput.get(_CACHE_KEY)
    else:
        path = tempfile.mkdtemp(prefix="adaflash-test-compile-cache-")
        config.stash[_CACHE_DIR] = path
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_compilation_cache_max_size", 8 << 30)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist, in the controller: each worker gets the run's cache directory."""
    node.workerinput[_CACHE_KEY] = node.config.stash.get(_CACHE_DIR, None)


def pytest_unconfigure(config):
    path = config.stash.get(_CACHE_DIR, None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops every compiled program after each test module. Each XLA:CPU executable holds
    memory mappings, and a worker that keeps them all across hundreds of tests passes the
    kernel's per-process limit (vm.max_map_count, 65530 by default): the next mmap fails and
    the worker segfaults inside XLA. Module fixtures (models, drafters) stay; where a later
    module needs their programs it reads them back from the run's compile cache."""
    yield
    import gc

    from adaflash_jax.decoding import compile_cache

    compile_cache.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2():
    """The shipped SmolLM2-135M-Instruct GGUF as an fp32 target (loaded once per session)."""
    import adaflash_jax as af

    return af.load_target("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' LlamaForCausalLM for the same GGUF (fp32, torch CPU)."""
    pytest.importorskip("torch")
    from fixtures import smollm2_hf_reference

    return smollm2_hf_reference()
