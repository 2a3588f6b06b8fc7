"""benchmarks/kernels.py in-process on the CPU at --small shapes.

One context keeps it to a dozen small compiles: every kernel gets its cases,
the XLA forms are timed, and the record says plainly that Pallas was not run
(interpret mode measures nothing about speed).
"""

import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fused_verify import verify_head_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_kernels", os.path.join(ROOT, "benchmarks", "kernels.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_help_and_bad_arguments(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for word in ("--preset", "--contexts", "--kernels", "--small", "qwen3-8b", "smollm2-135m", "interpret mode"):
        assert word in text
    for argv in (["--kernels", "block_attention,nope"], ["--contexts", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2


def test_small_cpu_run(bench, tmp_path, capsys):
    out = tmp_path / "kernels.json"
    bench.main(["--small", "--repeats", "1", "--contexts", "64", "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    assert printed["device"]["platform"] == "cpu"
    assert printed["pallas"] == bench.PALLAS_NOT_RUN
    assert "interpret mode" in printed["pallas"]

    cases = printed["cases"]
    assert {c["kernel"] for c in cases} == set(bench.KERNELS)
    for case in cases:
        assert case["xla_ms"] > 0 and len(case["xla_runs_ms"]) == 1, case["kernel"]
        assert case["pallas"] == bench.PALLAS_NOT_RUN
        assert "pallas_ms" not in case and "speedup" not in case
        assert case["hbm_bytes_estimated"]["basis"]

    by_kernel = {}
    for case in cases:
        by_kernel.setdefault(case["kernel"], []).append(case)
    assert [c["case"] for c in by_kernel["block_attention_train"]] == ["forward", "forward+backward"]
    verify = {c["case"]: c for c in by_kernel["verify_attention"]}
    assert verify.keys() == {"drafted bucket", "ar step"}
    block = printed["shapes"]["block_size"]
    batch = printed["shapes"]["batch"]
    drafted, ar = verify["drafted bucket"], verify["ar step"]
    assert drafted["width"] == block and drafted["shapes"]["q"][0] == batch * block // 2
    assert ar["width"] == 1 and ar["shapes"]["q"][0] == batch and ar["verified_lengths"] == [1] * batch
    assert all(c["xla_model_ms"] > 0 for c in verify.values())
    # ragged rows: every live context between half and all of it
    lengths = by_kernel["block_attention"][0]["ctx_lengths"]
    assert all(32 <= n <= 64 for n in lengths)
    (fused,) = by_kernel["fused_verify"]
    assert fused["tokens"] == batch * block
    _check_estimates_by_counting(printed, by_kernel)


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def _check_estimates_by_counting(printed, by_kernel):
    """Recount the bytes from the recorded shapes and the reference's own output shapes.

    The benchmark derives its estimates from the preset; this count starts from what the
    record says was run (array shapes, live lengths), and, for the fused verify head, from
    `jax.eval_shape` of the reference, so a wrong factor or a wrong shape shows up.
    """
    dt = printed["dtype"]
    (block,) = by_kernel["block_attention"]
    sh = block["shapes"]
    hkv, d = sh["ctx_kv"][1], sh["ctx_kv"][3]
    live = sum(block["ctx_lengths"]) * hkv * d
    moved = 2 * _nbytes(sh["q"], dt) + 2 * _nbytes(sh["blk_kv"], dt) + 2 * _nbytes((live,), dt)
    assert block["hbm_bytes_estimated"]["pallas"] == moved

    for case in by_kernel["verify_attention"]:
        sh = case["shapes"]
        hkv, d = sh["cache_kv"][1], sh["cache_kv"][3]
        live = sum(n for n, v in zip(case["cache_lengths"], case["verified_lengths"]) if v > 0) * hkv * d
        moved = 2 * _nbytes(sh["q"], dt) + 2 * _nbytes(sh["kv_new"], dt) + 2 * _nbytes((live,), dt)
        assert case["hbm_bytes_estimated"]["pallas"] == moved, case["case"]

    (fused,) = by_kernel["fused_verify"]
    sh = fused["shapes"]
    hidden = jax.ShapeDtypeStruct(tuple(sh["hidden"]), dt)
    lm_head = jax.ShapeDtypeStruct(tuple(sh["lm_head"]), dt)
    draft = jax.ShapeDtypeStruct(tuple(sh["draft_ids"]), jnp.int32)
    outs = jax.eval_shape(lambda h, w, t: verify_head_reference(h, w, t), hidden, lm_head, draft)
    out_bytes = sum(_nbytes(o.shape, o.dtype) for o in jax.tree.leaves(outs))
    inputs = _nbytes(hidden.shape, dt) + _nbytes(lm_head.shape, dt) + _nbytes(draft.shape, jnp.int32)
    logits = _nbytes((sh["hidden"][0], sh["lm_head"][1]), jnp.float32)
    est = fused["hbm_bytes_estimated"]
    assert est["pallas"] == inputs + out_bytes
    assert est["xla"] == inputs + out_bytes + 2 * logits
