import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist_utils import run_ranks

# Two ranks with very different token counts: a plain per-rank mean would weight rank 1's
# tokens 4x more than rank 0's.
TOKENS_PER_RANK = (40, 10)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))


def _data():
    g = torch.Generator().manual_seed(1)
    n = sum(TOKENS_PER_RANK)
    return torch.randint(0, 50, (n,), generator=g), torch.randint(0, 50, (n,), generator=g)


def _fsdp_grads(rank, world_size, count_started_early=False):
    from torch.distributed.fsdp import fully_shard

    from collate.loss import GlobalTokenCount, global_token_mean

    x, y = _data()
    start = sum(TOKENS_PER_RANK[:rank])
    x, y = x[start:start + TOKENS_PER_RANK[rank]], y[start:start + TOKENS_PER_RANK[rank]]
    model = _model()
    fully_shard(model)
    count = GlobalTokenCount.start(len(y)) if count_started_early else len(y)  # before the forward
    loss_sum = F.cross_entropy(model(x), y, reduction="sum")
    global_token_mean(loss_sum, count).backward()
    return [p.grad.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("count_started_early", [False, True], ids=["count-at-loss", "count-before-forward"])
def test_global_token_mean_under_fsdp2_equals_one_process_on_the_whole_batch(count_started_early):
    x, y = _data()
    model = _model()
    F.cross_entropy(model(x), y).backward()
    expected = [p.grad for p in model.parameters()]
    for grads in run_ranks(_fsdp_grads, 2, count_started_early):
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_global_token_mean_without_process_group_is_the_local_token_mean():
    from collate.loss import GlobalTokenCount, global_token_mean

    loss_sum = torch.tensor(12.0)
    assert float(global_token_mean(loss_sum, 4)) == 3.0
    assert float(global_token_mean(loss_sum, GlobalTokenCount.start(4))) == 3.0
