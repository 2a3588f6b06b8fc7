"""Test-suite set-up: 8 forced host devices (mesh tests), no persistent compile cache."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compile cache: CI starts empty anyway, and an entry left half-written by a
# killed local run crashes the process that reads it. CLI processes the tests start inherit this.
os.environ["ADAFLASH_COMPILE_CACHE"] = "0"

import jax  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops every compiled program after each test module. Each XLA:CPU executable holds
    memory mappings, and a worker that keeps them all across hundreds of tests passes the
    kernel's per-process limit (vm.max_map_count, 65530 by default): the next mmap fails and
    the worker segfaults inside XLA. Module fixtures (models, drafters) stay; their programs
    recompile where a later module needs them."""
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
