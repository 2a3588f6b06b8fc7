"""Test-suite set-up: 8 forced host devices (mesh tests) and a persistent compile cache."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402


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
