"""A pool whose last graph was released is never captured into again, on one GPU (issue 41).

torch's pinned-memory allocator (CachingHostAllocator, 2.11 on) counts a pool's graphs and fails an
internal assert (`use_count > 0`) on a capture into a pool whose graphs were all released. On two GPUs a
rank whose peer failed its capture hit it; on one GPU the same happens when a signature is given up past
`max_recaptures` (its graph released, the pool's last) and another signature then captures. The CPU test
(tests/test_pool_renewal.py) models the allocator; this one runs torch's own.
"""

from __future__ import annotations

import warnings

import torch
from gpu_common import assert_same_params, batches, deterministic, gpt_pair, needs_cuda, train_step

import graphstep

pytestmark = needs_cuda


def test_a_signature_given_up_and_then_another_captured_is_bitwise_equal_to_eager():
    (m_e, o_e), (m_g, o_g) = gpt_pair()
    config = graphstep.Config(max_recaptures=0, on_recapture_limit="eager")
    step = graphstep.capture(train_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    eager = train_step(m_e, o_e)
    large, small = batches(8), batches(6, batch_size=2, seed=1)
    with deterministic(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recapture limit's warning
        for i, batch in enumerate(large):
            if i == 5:  # a parameter's storage moves: past max_recaptures=0 this signature runs eagerly
                for m in (m_e, m_g):
                    m.head.weight.data = m.head.weight.data.clone()
            assert torch.equal(eager(*batch), step(*batch)), f"large call {i}"
        assert step.stats.graphs_alive == 0  # the pool's last graph went with the signature
        for i, batch in enumerate(small):  # warm-ups, then a capture: into a fresh pool
            assert torch.equal(eager(*batch), step(*batch)), f"small call {i}"
    assert_same_params(m_e, m_g)
    assert step.stats.captures == 2 and step.stats.graphs_alive == 1, step.stats
    step.close()
