"""Test-suite set-up: 8 forced host devices (mesh tests), no persistent compile cache."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compile cache: serializing an executable (jaxlib 0.10, CPU, in a worker that
# has compiled many programs) can abort the process, and a dead xdist worker stalls the run.
# CLI processes the tests start inherit this.
os.environ["ADAFLASH_COMPILE_CACHE"] = "0"

import jax  # noqa: E402

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
