"""The exported engine under the scheduler: per-prompt `generate` outputs with staggered
arrivals, live-prefix steps, the "head" rule, and no model code in the serving process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import adaflash_jax as af
from adaflash_jax.decoding.export import export_decoder
from adaflash_jax.serving.exported_engine import ExportedEngine, build_scheduler
from adaflash_jax.serving.scheduler import Request
from nonfinite_helpers import poisoned
from spec_helpers import TEST_PROMPTS, distilled_drafter, random_prompts, tiny_target

CAP = 32


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("engine") / "artifact")
    export_decoder(tiny_target(), out, drafter=distilled_drafter(), max_prompt_len=16, max_new_tokens=CAP)
    return out


@pytest.fixture(scope="module")
def decoder(artifact):
    return af.load_exported(artifact)


def reference(request: Request, drafter=None, **kw):
    if drafter is not None:  # the exported engine's chain verification, unless kw says tree
        kw.setdefault("verify", "chain")
    return af.generate(tiny_target(), [list(request.prompt)], max_new_tokens=request.max_new_tokens,
                       drafter=drafter, temperature=request.temperature, top_p=request.top_p,
                       seed=request.seed, **kw).token_ids[0]


def test_manifest_lists_the_engine_state(artifact):
    with open(os.path.join(artifact, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["format_version"] == 3
    names = {leaf["name"]: leaf for leaf in manifest["engine"]["leaves"]}
    assert {"num_out", "done", "out", "tcache.k", "params.seed_key"} <= set(names)
    assert names["tcache.k"]["slot_axis"] == 1 and names["steps"]["slot_axis"] == -1
    assert names["params.seed_key"]["key"] and names["params.seed_key"]["dtype"] == "uint32"
    assert {"engine_init", "engine_evict", "engine_insert_greedy", "engine_step_sample"} <= set(
        manifest["functions"])


def test_staggered_arrivals_match_per_prompt_generate(decoder):
    """Greedy and sampled requests, more than the slots, arriving over time: each gets what
    `generate` gives it alone (later ones land in slots that earlier ones freed)."""
    prompts = TEST_PROMPTS + random_prompts(5, seed=11)
    max_new = [CAP, 1, 7, 30, CAP, 3, 19, 11, 25]
    requests = [Request(p, m, temperature=0.8 if i % 3 == 2 else 0.0, top_p=0.95 if i % 3 == 2 else 1.0,
                        seed=i) for i, (p, m) in enumerate(zip(prompts, max_new))]
    sched = build_scheduler(decoder, slots=4)
    got = sched.run(requests, arrivals=[0, 0, 0, 1, 2, 2, 5, 9, 9])
    for request, out in zip(requests, got):
        assert out == reference(request, distilled_drafter())
    assert sched.idle() and sched.running == 0


def test_live_prefix_steps_and_verify_len(decoder):
    """One request in 8 slots steps a 1-slot prefix; a shorter fixed verify length changes the
    steps, not the tokens."""
    request = Request(TEST_PROMPTS[3], 20)
    engine = ExportedEngine(decoder, 8, "greedy", verify_len=4)
    assert engine.verify_len == 4
    from adaflash_jax.serving.scheduler import Scheduler

    assert Scheduler({"greedy": engine}).run([request])[0] == reference(request, distilled_drafter())
    assert set(engine._steps) == {1}


def test_bad_engine_settings_are_named(decoder):
    with pytest.raises(ValueError, match=r"verify_len must lie in \[1, 16\]"):
        ExportedEngine(decoder, 2, "greedy", verify_len=17)
    with pytest.raises(ValueError, match="length_policy 'head'"):
        ExportedEngine(decoder, 2, "greedy", rho=1.0)
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        ExportedEngine(decoder, 0, "greedy")
    with pytest.raises(ValueError, match="without 'beam'"):
        ExportedEngine(decoder, 2, "beam")


def test_a_version_2_artifact_asks_for_a_re_export(artifact, tmp_path):
    old = str(tmp_path / "v2")
    shutil.copytree(artifact, old)
    with open(os.path.join(old, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["format_version"] = 2
    for name in [n for n in manifest["functions"] if n.startswith("engine_")]:
        del manifest["functions"][name]
    del manifest["engine"]
    with open(os.path.join(old, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    v2 = af.load_exported(old)  # the whole-batch loops still run
    assert v2.generate(TEST_PROMPTS[:1], max_new_tokens=5).token_ids == af.generate(
        tiny_target(), TEST_PROMPTS[:1], max_new_tokens=5, drafter=distilled_drafter()).token_ids
    with pytest.raises(ValueError, match="re-export it"):
        ExportedEngine(v2, 2, "greedy")


def test_autoregressive_artifact(tmp_path):
    out = str(tmp_path / "ar")
    export_decoder(tiny_target(), out, max_prompt_len=16, max_new_tokens=CAP, modes=("greedy",))
    sched = build_scheduler(out, slots=2)
    requests = [Request(p, m) for p, m in zip(TEST_PROMPTS, [12, 3, 20, 8])]
    assert not sched.pools["greedy"].engine.speculative
    assert sched.run(requests, arrivals=[0, 1, 1, 4]) == [reference(r) for r in requests]


def test_head_policy_engine(tmp_path):
    """The AdaFlash rule, set per engine, with slots stepping as packed buckets of the prefix."""
    from flax import nnx

    from adaflash_jax.models.length_head import LengthHead

    drafter = distilled_drafter().with_length_head(LengthHead(tiny_target().cfg.hidden_size, 8, rngs=nnx.Rngs(0)))
    out = str(tmp_path / "head")
    export_decoder(tiny_target(), out, drafter=drafter, max_prompt_len=16, max_new_tokens=CAP,
                   modes=("greedy",))
    sched = build_scheduler(out, slots=4, rho=0.4)
    assert sched.pools["greedy"].engine.rule == (pytest.approx(0.4), 1)
    requests = [Request(p, m) for p, m in zip(TEST_PROMPTS + random_prompts(2, seed=5), [CAP, 9, 20, 30, 14, 5])]
    got = sched.run(requests, arrivals=[0, 0, 1, 3, 3, 6])
    for request, tokens in zip(requests, got):
        assert tokens == reference(request, drafter, length_policy="head", rho=0.4)


def test_a_poisoned_request_ends_as_non_finite(tmp_path):
    """Token 26 has a NaN embedding and is TEST_PROMPTS[2]'s first token (greedy, and sampled
    at a temperature that leaves no choice): through the artifact's functions its requests end
    with an error after that token, greedy and sampled verification alike, and the others get
    `generate`'s tokens."""
    out = str(tmp_path / "nan")
    export_decoder(poisoned(tiny_target(), 26), out, drafter=distilled_drafter(), max_prompt_len=16,
                   max_new_tokens=CAP)
    requests = [Request(p, 20, tag=i) for i, p in enumerate(TEST_PROMPTS)]
    requests += [Request(TEST_PROMPTS[i], 20, temperature=1e-3, seed=i, tag=f"sampled {i}") for i in (1, 2)]
    errors = {}
    got = build_scheduler(out, slots=4).run(requests, on_update=lambda u: errors.update({u.tag: u.error}))
    failing = {2, "sampled 2"}
    assert {tag for tag, error in errors.items() if error} == failing
    assert all("non-finite" in errors[tag] for tag in failing)
    for request, tokens in zip(requests, got):
        assert tokens == ([26] if request.tag in failing else reference(request, distilled_drafter()))


FRESH = """
import json, sys
from adaflash_jax.serving.exported_engine import build_scheduler
from adaflash_jax.serving.scheduler import Request
sched = build_scheduler(sys.argv[1], slots=2)
prompts = json.loads(sys.argv[2])
tokens = sched.run([Request(p, 12) for p in prompts], arrivals=list(range(len(prompts))))
loaded = sorted(m for m in sys.modules if m.startswith("adaflash_jax.models") or m == "flax"
                or m.startswith("adaflash_jax.decoding.engine") or m.startswith("adaflash_jax.decoding.spec"))
print(json.dumps({"tokens": tokens, "model_modules": loaded}))
"""


def test_serving_process_imports_no_model_code(artifact):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", FRESH, artifact, json.dumps(TEST_PROMPTS)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["model_modules"] == []
    assert report["tokens"] == [reference(Request(p, 12), distilled_drafter()) for p in TEST_PROMPTS]


def test_tree_artifact_matches_tree_generate(tmp_path):
    """A fixed-budget tree: the whole-batch loop and the engine under the scheduler both give
    `generate(verify="tree")`'s output, which is AR's."""
    out = str(tmp_path / "tree")
    manifest = export_decoder(tiny_target(), out, drafter=distilled_drafter(), max_prompt_len=16,
                              max_new_tokens=CAP, modes=("greedy",), tree_budget=6)
    assert manifest["drafter"]["verify"] == "tree" and manifest["drafter"]["tree_budget"] == 6
    assert manifest["cache_len"] >= 16 + CAP + 6
    decoder = af.load_exported(out)
    whole = decoder.generate(TEST_PROMPTS, max_new_tokens=20)
    want = af.generate(tiny_target(), TEST_PROMPTS, max_new_tokens=20, drafter=distilled_drafter(),
                       verify="tree", tree_budget=6)
    assert whole.token_ids == want.token_ids == af.generate(tiny_target(), TEST_PROMPTS, max_new_tokens=20).token_ids
    assert whole.stats["verify"] == "tree" and max(whole.stats["tau"]) > 1.0
    sched = build_scheduler(decoder, slots=2)
    requests = [Request(p, m) for p, m in zip(TEST_PROMPTS, [CAP, 7, 20, 11])]
    assert sched.run(requests, arrivals=[0, 0, 2, 3]) == [reference(r) for r in requests]
    with pytest.raises(ValueError, match="verify_len applies to chain"):
        ExportedEngine(decoder, 2, "greedy", verify_len=4)
    with pytest.raises(ValueError, match="not exported"):
        export_decoder(tiny_target(), str(tmp_path / "auto"), drafter=distilled_drafter(), tree_budget="auto")
    with pytest.raises(ValueError, match="does not apply"):
        export_decoder(tiny_target(), str(tmp_path / "head"), drafter=distilled_drafter(), tree_budget=4,
                       length_policy="head")
