"""Step-cost calibration: keyed by and measured with the kernel implementation; the shared
JSON table keeps every row under concurrent writers."""

import json
import threading

import pytest

import adaflash_jax as af
import spec_helpers as H
from adaflash_jax.decoding import calibration


@pytest.fixture(scope="module")
def pair():
    target = H.tiny_target()
    return target, af.init_drafter(target, num_layers=2, block_size=8)


@pytest.fixture
def cost_file(tmp_path, monkeypatch):
    path = tmp_path / "step_costs.json"
    monkeypatch.setenv("ADAFLASH_COST_CACHE", str(path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    return path


def test_each_attn_impl_is_measured_and_stored_separately(pair, cost_file, monkeypatch):
    seen = []

    def fake_measure(target, drafter, *, attn_impl, **kwargs):
        seen.append(attn_impl)
        return {"verify_s": [2.0, 3.0], "draft_s": 1.0, "ar_s": 1.5 if attn_impl == "xla" else 0.5}

    monkeypatch.setattr(calibration, "measure", fake_measure)
    target, drafter = pair
    kw = dict(batch=1, cache_len=64, buckets=(4, 8))
    xla = calibration.calibrate(target, drafter, attn_impl="xla", **kw)
    pallas = calibration.calibrate(target, drafter, attn_impl="pallas", **kw)
    calibration.calibrate(target, drafter, attn_impl="pallas", **kw)  # reused, not re-measured
    assert seen == ["xla", "pallas"]
    assert float(xla.ar_s) == 1.5 and float(pallas.ar_s) == 0.5
    keys = [json.loads(k) for k in json.loads(cost_file.read_text())]
    assert sorted(k[3] for k in keys) == ["pallas", "xla"]


def test_measure_runs_the_requested_kernels(pair, monkeypatch):
    impls = []
    real_verify, real_draft = calibration.verify_packed, calibration.measure_draft

    def spy_verify(*args, attn_impl, **kwargs):
        impls.append(("verify", attn_impl))
        return real_verify(*args, attn_impl="xla", **kwargs)  # keep the CPU run cheap

    def spy_draft(*args, attn_impl, **kwargs):
        impls.append(("draft", attn_impl))
        return real_draft(*args, attn_impl="xla", **kwargs)

    monkeypatch.setattr(calibration, "verify_packed", spy_verify)
    monkeypatch.setattr(calibration, "measure_draft", spy_draft)
    target, drafter = pair
    row = calibration.measure(target, drafter, batch=1, cache_len=64, buckets=(4, 8), repeats=1,
                              attn_impl="pallas")
    assert len(row["verify_s"]) == 2 and row["draft_s"] > 0
    assert {impl for _, impl in impls} == {"pallas"} and {kind for kind, _ in impls} == {"verify", "draft"}


def test_concurrent_stores_keep_every_row(cost_file):
    def store(worker):
        for i in range(20):
            calibration._store_disk(f"{worker}-{i}", {"ar_s": i})

    threads = [threading.Thread(target=store, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(json.loads(cost_file.read_text())) == 80
