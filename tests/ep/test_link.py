"""modelopt_ext.ep.link: the exchange's shared records (`Layout`), the `Link` protocol and `NcclLink` on one gloo
rank, whose steps take the call's plan and leave the link object as it was."""

import dataclasses

import pytest
import torch

from modelopt_ext.ep.link import Layout, Link, NcclLink

# two chunks, three ranks, two local experts: recv_blocks[w][c][e]
RECV_BLOCKS = [[[1, 0], [2, 1]], [[0, 3], [0, 0]], [[2, 2], [1, 0]]]
LAYOUT = Layout(send_sizes=[[2, 1, 0], [0, 4, 1]], recv_sizes=[[1, 3, 4], [3, 0, 1]], recv_blocks=RECV_BLOCKS)


def test_layout_offsets_are_the_chunks_first_rows_and_the_total():
    assert LAYOUT.send_off == [0, 3, 8]
    assert LAYOUT.recv_off == [0, 8, 12]


def test_chunk_segments_lay_the_received_rows_out_by_source_then_expert():
    # chunk 0: rank 0 sends 1 row for expert 0, rank 1 3 rows for expert 1, rank 2 2 + 2; rows counted in the chunk
    assert LAYOUT.chunk_segments(0) == [(0, 0, 1), (1, 1, 0), (0, 1, 0), (1, 1, 3), (0, 4, 2), (1, 6, 2)]
    assert LAYOUT.chunk_segments(1) == [(0, 0, 2), (1, 2, 1), (0, 3, 0), (1, 3, 0), (0, 3, 1), (1, 4, 0)]
    for c in (0, 1):  # the segments cover the chunk's received rows
        assert sum(rows for _, _, rows in LAYOUT.chunk_segments(c)) == sum(LAYOUT.recv_sizes[c])


def test_a_link_with_its_own_row_layout_gives_its_segments():
    own = [[(1, 0, 4)], [(0, 0, 2), (1, 2, 2)]]
    layout = Layout([[1, 1], [2, 2]], [[2, 2], [2, 2]], None, segments=own)
    assert layout.chunk_segments(0) == [(1, 0, 4)] and layout.chunk_segments(1) == own[1]


def test_the_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LAYOUT.send_sizes = [[0, 0, 0]]


def test_the_protocol_declares_the_steps_every_link_implements():
    assert Link.__abstractmethods__ == {"plan", "receive_buffer", "send", "return_buffer", "send_back"}
    with pytest.raises(TypeError, match="abstract"):
        Link()


def test_the_shared_steps_buffer_and_slice_by_the_plan():
    link = NcclLink(None)
    x = torch.zeros(5, 6, dtype=torch.bfloat16)
    send = link.send_buffer(LAYOUT, x)
    assert send.shape == (8, 6) and send.dtype == torch.bfloat16
    recv = torch.arange(12.0).unsqueeze(1)
    assert link.received(LAYOUT, 0, recv).flatten().tolist() == list(range(8))
    chunk1 = link.received(LAYOUT, 1, recv)
    assert chunk1.flatten().tolist() == [8, 9, 10, 11] and chunk1.data_ptr() == recv[8].data_ptr()  # a view
    assert vars(link) == {"group": None}


def test_nccl_link_exchanges_counts_then_rows_and_results_back(one_rank_group):
    link = NcclLink(one_rank_group)
    before = dict(vars(link))
    send_WCE = torch.tensor([[[2, 1], [0, 3]]])  # one rank, two chunks, two experts
    plan = link.plan(send_WCE, None, None)
    assert type(plan) is Layout
    assert plan.send_sizes == [[3], [3]] and plan.recv_sizes == [[3], [3]]
    assert plan.recv_blocks == [[[2, 1], [0, 3]]] and plan.chunk_segments(1) == [(0, 0, 0), (1, 0, 3)]

    x_TH = torch.arange(10.0).reshape(5, 2)
    send_x, recv_x = link.send_buffer(plan, x_TH), link.receive_buffer(plan, x_TH)
    assert send_x.shape == recv_x.shape == (6, 2)
    for c, rows in enumerate((torch.tensor([4, 0, 2]), torch.tensor([1, 1, 3]))):
        link.send(plan, c, x_TH, rows, send_x, recv_x).wait()
        assert torch.equal(send_x[3 * c:3 * c + 3], x_TH[rows])  # the chunk's rows gathered in send order
        assert torch.equal(link.received(plan, c, recv_x), x_TH[rows])  # one rank: received from itself
    back = link.return_buffer(plan, recv_x)
    assert back.shape == (6, 2)
    for c in range(2):
        link.send_back(plan, c, 10 * link.received(plan, c, recv_x), back).wait()
    assert torch.equal(back, 10 * recv_x)
    assert vars(link) == before  # the call left nothing on the link


def test_two_plans_through_one_nccl_link_do_not_mix(one_rank_group):
    """Two calls whose steps interleave through one link object: each step reads its own call's plan."""
    link = NcclLink(one_rank_group)
    x1, x2 = torch.arange(8.0).reshape(4, 2), -torch.arange(12.0).reshape(6, 2)
    p1 = link.plan(torch.tensor([[[1, 3]]]), None, None)  # one chunk: 4 rows
    p2 = link.plan(torch.tensor([[[2, 0], [4, 0]]]), None, None)  # two chunks: 2 + 4 rows
    rows1, rows2 = torch.tensor([3, 2, 1, 0]), torch.tensor([5, 4, 3, 2, 1, 0])
    send1, recv1 = link.send_buffer(p1, x1), link.receive_buffer(p1, x1)
    send2, recv2 = link.send_buffer(p2, x2), link.receive_buffer(p2, x2)
    link.send(p2, 0, x2, rows2[:2], send2, recv2).wait()
    link.send(p1, 0, x1, rows1, send1, recv1).wait()
    link.send(p2, 1, x2, rows2[2:], send2, recv2).wait()
    assert torch.equal(link.received(p1, 0, recv1), x1[rows1])
    assert torch.equal(torch.cat([link.received(p2, c, recv2) for c in range(2)]), x2[rows2])
    assert p1.chunk_segments(0) == [(0, 0, 1), (1, 1, 3)] and p2.chunk_segments(1) == [(0, 0, 4), (1, 4, 0)]
