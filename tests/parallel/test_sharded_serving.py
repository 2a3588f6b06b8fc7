"""Continuous batching on a data 2 x tensor 4 mesh of the 8 forced host devices (conftest).

The scheduler drives a sharded `LocalEngine` (slots over "data", kv heads and MLP
over "tensor") with staggered arrivals; every request's greedy tokens equal those
of the same engine on one device, with a drafter and without. The tiny config has
8 query / 4 KV heads, so the tensor axis really splits the heads and caches.
"""

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import adaflash_jax as af
import spec_helpers as H
from adaflash_jax.parallel.mesh import make_mesh, mesh_from_spec
from adaflash_jax.parallel.rules import shard_state
from adaflash_jax.serving.scheduler import Request, Scheduler
from adaflash_jax.serving.slot_engine import LocalEngine, physical_rows, step_prefix
from fixtures import tiny_config, tiny_target

SLOTS, PROMPT, CAP = 4, 16, 32
BATCH = ("data", "fsdp")
COLLECTIVE = re.compile(r"(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(-start)?\(")


@functools.lru_cache(maxsize=None)
def models(sharded: bool):
    """The tiny target (2 layers, 8/4 heads) and a drafter distilled on its greedy paths."""
    cfg = tiny_config(max_position_embeddings=512)
    single = tiny_target(cfg, seed=5)
    rows = H.greedy_rows(single, [[3 + i, 40 + 7 * i, 9] for i in range(8)], max_new=48)
    seqs = np.asarray([r[:48] for r in rows], np.int32)
    drafter = H.distill(single, af.init_drafter(single, num_layers=1, block_size=8), seqs, steps=150)[0]
    if not sharded:
        return single, drafter
    return tiny_target(cfg, seed=5, mesh=make_mesh(data=2, tensor=4)), drafter  # the engine shards it


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(4)
    return [rng.integers(3, 256, n).tolist() for n in (5, 13, 2, 9, 16, 7, 11)]


def engine(sharded: bool, speculative: bool, slots: int = SLOTS) -> LocalEngine:
    target, drafter = models(sharded)
    return LocalEngine(target, drafter if speculative else None, num_slots=slots, max_prompt_len=PROMPT,
                       max_new_tokens=CAP, eos_ids=(), verify="chain" if speculative else None)


def serve(eng, prompts, max_new, arrivals):
    return Scheduler({"greedy": eng}).run([Request(p, m) for p, m in zip(prompts, max_new)], arrivals=arrivals)


def spec(x):
    """A sharding's spec, one entry per dim, without size-1 mesh axes (jax may drop them)."""
    sizes = x.sharding.mesh.shape
    parts = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))

    def keep(part):
        axes = tuple(a for a in (part if isinstance(part, tuple) else (part,)) if a and sizes[a] > 1)
        return axes[0] if len(axes) == 1 else (axes or None)

    return P(*[keep(p) for p in parts])


@pytest.mark.parametrize("speculative", [False, True])
def test_staggered_arrivals_match_one_device(prompts, speculative):
    max_new = [CAP, 1, 9, 20, CAP, 4, 15]
    arrivals = [0, 0, 0, 1, 2, 4, 7]  # more requests than slots: later ones reuse freed slots
    sharded = engine(True, speculative)
    got = serve(sharded, prompts, max_new, arrivals)
    want = serve(engine(False, speculative), prompts, max_new, arrivals)
    assert got == want
    assert [len(g) for g in got] == max_new
    if speculative:  # the drafter is good enough that blocks are accepted, so rollback ran too
        assert int(sharded.state.steps) < sum(max_new)


def test_state_is_laid_out_by_the_rules():
    eng = engine(True, True)
    before = jax.tree.map(lambda x: x.sharding, eng.state)
    serve(eng, [[5, 6, 7], [8, 9]], [6, 3], [0, 1])
    s = eng.state
    assert spec(s.tcache.k) == P(None, "data", "tensor", None, None)  # slots / kv heads
    assert spec(s.ctx.v) == P(None, "data", "tensor", None, None)
    assert spec(s.out) == P("data", None) and spec(s.tcache.lengths) == P("data")
    assert spec(s.params.seed_key) == P("data")
    assert s.eos_ids.sharding.is_fully_replicated and s.steps.sharding.is_fully_replicated
    assert s.tcache.k.addressable_shards[0].data.shape[1:3] == (SLOTS // 2, 1)
    same = jax.tree.map(lambda a, x: a.is_equivalent_to(x.sharding, x.ndim), before, s)
    assert jax.tree.all(same)  # inserts, steps and evictions kept the layout


def test_steps_never_move_the_caches():
    """No collective of a compiled step (whole engine or a live prefix) is as large as one
    device's share of a KV cache: the caches stay where the layout put them."""
    eng = engine(True, True, slots=8)
    shard = eng.state.ctx.k.addressable_shards[0].data.size
    for k in (2, 4, 8):
        text = step_prefix.lower(eng.cfg, k, eng.weights, eng.state, layout=eng.layout).compile().as_text()
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                 for line in text.splitlines() if COLLECTIVE.search(line)
                 for dims in re.findall(r"\[([\d,]*)\]", line.split(COLLECTIVE.search(line).group(0))[0])]
        assert sizes and max(sizes) < shard, (k, max(sizes), shard)


def test_live_prefix_smaller_than_the_data_axis():
    """One request in an 8-slot engine: its prefix (1) rounds up to the 2 data shards."""
    eng = engine(True, False, slots=8)
    assert [eng.step_rows(k) for k in (1, 2, 3, 8)] == [2, 2, 4, 8]
    assert physical_rows(8, 2).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    prompt = [11, 12, 13, 14]
    assert serve(eng, [prompt], [20], [0]) == serve(engine(False, False, slots=8), [prompt], [20], [0])


def test_slots_must_split_evenly():
    with pytest.raises(ValueError, match="multiple of the mesh's data"):
        engine(True, False, slots=3)


def test_mesh_spec_parsing_and_the_serve_flag(capsys):
    from adaflash_jax import cli

    assert dict(mesh_from_spec("data=2, tensor=4").shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert dict(mesh_from_spec("tensor=4").shape) == {"data": 1, "fsdp": 1, "tensor": 4}  # 4 of 8 devices
    for bad, why in [("data=2,data=2", "each axis once"), ("pipe=2", "AXIS=SIZE"), ("tensor=x", "not an integer"),
                     ("", "at least one axis"), ("tensor=16", "needs 16 devices")]:
        with pytest.raises(ValueError, match=why):
            mesh_from_spec(bad)
    # refused before any model loads
    assert cli.main(["serve", "--mesh", "pipe=2"]) == 2
    assert cli.main(["serve", "--mesh", "data=2,tensor=4", "--slots", "3"]) == 2
    assert "multiple of the mesh's data*fsdp" in capsys.readouterr().err


def test_speculative_generate_matches_one_device(prompts):
    """`af.generate` (one `decode_batch` program) with a drafter on the mesh, too."""
    single, drafter = models(False)
    target = models(True)[0]
    on_mesh = dataclasses.replace(drafter, state=shard_state(drafter.state, target.mesh))
    kwargs = dict(max_new_tokens=20, stop_token_ids=[])
    got = af.generate(target, prompts[:4], drafter=on_mesh, **kwargs).token_ids
    assert got == af.generate(single, prompts[:4], drafter=drafter, **kwargs).token_ids
