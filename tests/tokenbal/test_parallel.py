"""The data-parallel dimension on real gloo ranks: a 2x2 (dp x sp) DeviceMesh over 4 processes.
SP peers get identical batches, DP ranks disjoint ones covering the epoch, and the loss's token
count is the total over the DP ranks (not twice it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.dist_utils import run_ranks
from tokenbal import TokenBalancedBatchSampler
from tokenbal.parallel import ParallelLayout, resolve_dp

N = 40


def _lengths() -> np.ndarray:
    return np.random.default_rng(7).integers(20, 900, N)


def _mesh_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from collate.loss import GlobalTokenCount, global_token_mean
    from tokenbal.data.stream import balanced_batches

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    lengths = _lengths()
    out: dict = {"dp_rank": mesh.get_local_rank("dp"), "sp_rank": mesh.get_local_rank("sp")}
    by_mesh = TokenBalancedBatchSampler(lengths, global_batch_size=8, device_mesh=mesh, seed=1)
    by_group = TokenBalancedBatchSampler(lengths, global_batch_size=8, dp_group=mesh.get_group("dp"), seed=1)
    default = TokenBalancedBatchSampler(lengths, global_batch_size=8, seed=1)   # global rank: wrong for SP
    out["sizes"] = (by_mesh.num_replicas, by_mesh.rank, by_group.num_replicas, by_group.rank)
    out["mesh"], out["group"], out["default"] = list(by_mesh), list(by_group), list(default)
    # the loss's token count: this rank's loss tokens (its whole batch; SP peers hold the same one)
    mine = int(sum(lengths[i] for b in out["mesh"][:1] for i in b))
    out["mine"] = mine
    out["count_mesh"] = float(GlobalTokenCount.start(mine, device_mesh=mesh).wait())
    count = GlobalTokenCount.start(mine, group=mesh.get_group("dp"))
    out["count_group"], out["count_world_factor"] = float(count.wait()), count.world
    out["count_default"] = float(GlobalTokenCount.start(mine).wait())
    out["mean"] = float(global_token_mean(torch.tensor(float(mine)), mine, device_mesh=mesh,
                                          grad_world_size=4))
    # streaming: the SP peers seed their buffer identically (same DP rank)
    stage = balanced_batches(300, lambda s: s["n"], steps=3, seed=2, device_mesh=mesh)
    out["wds_rank"] = stage.rank
    src = [{"n": int(x), "__key__": str(i)} for i, x in enumerate(lengths % 250 + 1)]
    out["wds"] = [[s["__key__"] for s in b] for b in stage(iter(src))]
    # HSDP names: dp_replicate x dp_shard is one 4-way data-parallel dimension
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    out["hsdp"] = resolve_dp(device_mesh=hsdp)
    errors = []
    for kwargs in ({"num_replicas": 4, "device_mesh": mesh}, {"rank": 3, "device_mesh": mesh},
                   {"device_mesh": mesh, "dp_group": mesh.get_group("dp")},
                   {"device_mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))}):
        try:
            TokenBalancedBatchSampler(lengths, global_batch_size=8, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    # the layout, built once: from the mesh, from the default group, from numbers; the same split
    layout = ParallelLayout.from_mesh(mesh)
    built = ParallelLayout.init(2, "cpu")
    plain = ParallelLayout.from_world(world, 2, rank)
    out["layouts"] = [(x.dp_size, x.dp_rank, x.sp_size, x.sp_rank) for x in (layout, built, plain)]
    out["layout_groups"] = (dist.get_process_group_ranks(layout.sp_group),
                            dist.get_process_group_ranks(layout.dp_group),
                            dist.get_process_group_ranks(built.sp_group))
    by_layout = TokenBalancedBatchSampler(lengths, global_batch_size=8, seed=1,
                                          num_replicas=layout.dp_size, rank=layout.dp_rank)
    handed = TokenBalancedBatchSampler(lengths, global_batch_size=8, seed=1, layout=layout)
    out["by_layout"] = list(by_layout) == out["mesh"] == list(handed)
    # the loss takes the same layout: its count is over the DP ranks; a layout of numbers alone has
    # no groups to reduce over under SP, and says so
    out["count_layout"] = float(GlobalTokenCount.start(mine, layout=layout).wait())
    try:
        GlobalTokenCount.start(mine, layout=plain)
        out["plain_error"] = ""
    except ValueError as e:
        out["plain_error"] = str(e)
    out["resolve_layout"] = resolve_dp(layout=layout)
    dist.barrier()
    return out


def test_dp_sp_mesh_four_ranks():
    res = run_ranks(_mesh_rank, 4, timeout=240)
    by_dp: dict[int, list[dict]] = {}
    for r in res:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_dp) == [0, 1] and all(len(v) == 2 for v in by_dp.values())
    for dp, peers in by_dp.items():
        a, b = peers
        assert a["sizes"] == b["sizes"] == (2, dp, 2, dp)
        assert a["mesh"] == b["mesh"] == a["group"] == b["group"]     # SP peers: identical batches
        assert a["wds"] == b["wds"] and a["wds_rank"] == dp
    # DP ranks: disjoint, equal step counts, together the whole epoch
    e0, e1 = by_dp[0][0]["mesh"], by_dp[1][0]["mesh"]
    assert len(e0) == len(e1)
    flat = [i for b in e0 + e1 for i in b]
    assert sorted(flat) == list(range(N))
    # the global rank (the default) gives the two SP peers different data: the bug this avoids
    assert any(p[0]["default"] != p[1]["default"] for p in by_dp.values())
    dp_total = by_dp[0][0]["mine"] + by_dp[1][0]["mine"]
    for r in res:
        assert r["count_mesh"] == r["count_group"] == dp_total
        assert r["count_world_factor"] == 2
        assert r["count_default"] == 2 * dp_total                    # all 4 ranks: counted twice
        assert r["mean"] == pytest.approx(r["mine"] * 4 / dp_total)
        assert sorted(r["hsdp"]) and r["hsdp"][0] == 4
        assert [("num_replicas=4" in e) for e in r["errors"][:1]] == [True]
        assert "rank=3" in r["errors"][1] and "not both" in r["errors"][2]
        assert "['a', 'b']" in r["errors"][3]
        # one layout whichever way it is built; its groups are the mesh's
        dp, sp = r["dp_rank"], r["sp_rank"]
        assert r["layouts"] == [(2, dp, 2, sp)] * 3
        assert r["layout_groups"] == ([2 * dp, 2 * dp + 1], [sp, sp + 2], [2 * dp, 2 * dp + 1])
        assert r["by_layout"] and r["resolve_layout"] == (2, dp)
        assert r["count_layout"] == dp_total and "no process groups" in r["plain_error"]
    assert sorted(r["hsdp"][1] for r in res) == [0, 1, 2, 3]


def test_resolve_dp_without_a_process_group():
    assert resolve_dp(4, 1) == (4, 1)
    with pytest.raises(ValueError, match="initialised"):
        resolve_dp(dp_group=object())
    with pytest.raises(ValueError, match="not both"):
        resolve_dp(dp_group=object(), device_mesh=object())


@given(st.integers(1, 64), st.integers(1, 16), st.data())
def test_layout_from_world_splits_every_rank_once(dp_size, sp_size, data):
    world = dp_size * sp_size
    layouts = [ParallelLayout.from_world(world, sp_size, r) for r in range(world)]
    every = {(d, s) for d in range(dp_size) for s in range(sp_size)}
    assert {(x.dp_rank, x.sp_rank) for x in layouts} == every
    for r, x in enumerate(layouts):
        assert (x.dp_size, x.sp_size, x.world_size) == (dp_size, sp_size, world)
        assert x.dp_rank * sp_size + x.sp_rank == r          # ranks [d*S, (d+1)*S) form DP group d
        assert resolve_dp(layout=x) == (dp_size, x.dp_rank)
    bad_sp = data.draw(st.integers(2, 64).filter(lambda s: world % s)) if world > 1 else 2
    with pytest.raises(ValueError, match=f"sp_size={bad_sp} must divide the world size {world}"):
        ParallelLayout.from_world(world, bad_sp)


def test_layout_rejects_bad_values_and_disagreeing_arguments():
    layout = ParallelLayout.from_world(8, 2, 5)
    assert (layout.dp_size, layout.dp_rank, layout.sp_size, layout.sp_rank) == (4, 2, 2, 1)
    with pytest.raises(ValueError, match="rank=8"):
        ParallelLayout.from_world(8, 2, 8)
    with pytest.raises(ValueError, match="dp_size"):
        ParallelLayout(0)
    with pytest.raises(ValueError, match="disagrees with layout"):
        resolve_dp(num_replicas=8, layout=layout)
    with pytest.raises(ValueError, match="not both"):
        resolve_dp(device_mesh=object(), layout=layout)


def _one_dimension_meshes(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tokenbal.data.stream import balanced_batches
    from tokenbal.parallel import dp_group_of

    lengths = _lengths()
    out: dict = {"errors": []}
    for name in ("sp", "tp"):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(name,))
        for make in (lambda m: TokenBalancedBatchSampler(lengths, global_batch_size=8, device_mesh=m),
                     ParallelLayout.from_mesh, lambda m: dp_group_of(device_mesh=m),
                     lambda m: balanced_batches(300, len, device_mesh=m)):
            try:
                make(mesh)
                out["errors"].append(None)
            except ValueError as e:
                out["errors"].append(str(e))
    dp_only = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out["dp_only"] = resolve_dp(device_mesh=dp_only)
    sp_only = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "sp"))
    sampler = TokenBalancedBatchSampler(lengths, global_batch_size=8, device_mesh=sp_only, seed=1)
    out["sp_only"] = list(sampler)
    dist.barrier()
    return out


def test_a_one_dimension_mesh_of_peers_sharing_a_batch_is_not_taken_as_data_parallel():
    # Two SP (or TP) peers must get the same batch; taking their mesh as the DP dimension would hand
    # them different samples without a word.
    res = run_ranks(_one_dimension_meshes, 2, timeout=120)
    for rank, r in enumerate(res):
        assert len(r["errors"]) == 8 and all(e is not None for e in r["errors"]), r["errors"]
        assert all("share one batch" in e and "not the data-parallel dimension" in e for e in r["errors"])
        assert "'sp'" in r["errors"][0] and "'tp'" in r["errors"][4]
        assert r["dp_only"] == (2, rank)
    assert res[0]["sp_only"] == res[1]["sp_only"] and res[0]["sp_only"]


def _collective_devices(rank: int, world: int) -> dict:
    from tokenbal.data.stream import agree_steps
    from tokenbal.parallel import collective_device

    # A gloo backend bound to CUDA alone stands in for NCCL (which has no CPU backend either): the
    # device is read from the group, never assumed to be the CPU.
    cuda_only = dist.new_group(list(range(world)), backend="cuda:gloo")
    mixed = dist.new_group(list(range(world)), backend="cpu:gloo,cuda:gloo")
    return {"default": collective_device(), "cuda_only": collective_device(cuda_only),
            "mixed": collective_device(mixed), "steps": agree_steps(10 + rank)}


def test_collectives_use_the_device_of_their_group():
    for r in run_ranks(_collective_devices, 2, timeout=120):
        assert r["default"] == r["mixed"] == torch.device("cpu")
        assert r["cuda_only"].type == "cuda"      # a CPU tensor there fails: no CPU backend
        assert r["steps"] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_only_group_runs_every_collective_tokenbal_issues():
    """On a real NCCL group (no CPU backend): the streaming stage's step agreement, verl's length
    gather, the loss's token count and the sampler's plan check all run."""
    import datetime

    from collate.loss import GlobalTokenCount
    from tests.helpers.dist_utils import free_port
    from tokenbal.data.stream import agree_steps
    from tokenbal.integrations.verl import gather_lengths

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        assert agree_steps(5) == 5
        assert gather_lengths([3, 4, 9]) == [3, 4, 9]
        count = GlobalTokenCount.start(7).wait()
        assert count.device.type == "cuda" and float(count) == 7.0
        sampler = TokenBalancedBatchSampler(_lengths(), global_batch_size=4, verify=True)
        assert sorted(i for b in sampler for i in b) == list(range(N))
    finally:
        dist.destroy_process_group()
