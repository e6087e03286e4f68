"""The fully-async producer's bookkeeping: admission within the staleness bound, and
partial samples joined with their spans."""

from __future__ import annotations

from slime_like.job.samples import train_masks
from slime_like.rollout.generate import Sample, continue_sample, join_spans
from slime_like.rollout.producer import ProducerCounts, admission_capacity


def test_admission_keeps_the_producer_at_most_n_plus_one_batches_ahead():
    # nothing trained yet, bound 1, batches of 4 groups: 8 groups may be under way
    assert admission_capacity(1, 4, trained=0, accepted=0, running=0) == 8
    assert admission_capacity(1, 4, trained=0, accepted=5, running=3) == 0
    # each trained batch opens room for one more
    assert admission_capacity(1, 4, trained=1, accepted=5, running=3) == 4
    # bound 0: exactly one batch per trained step (the sync schedule)
    assert admission_capacity(0, 4, trained=2, accepted=8, running=0) == 4
    assert admission_capacity(0, 4, trained=2, accepted=8, running=4) == 0


def test_every_admitted_group_ends_exactly_once():
    counts = ProducerCounts(admitted=10, taken=6, dropped_stale=1, filtered=1, left_over=2)
    assert counts.balanced()
    counts.taken += 1
    assert not counts.balanced()


def _piece(out, lps, version, finish="abort"):
    return Sample(0, [1, 2], out, lps, version, finish)


def test_a_partial_sample_continues_with_its_tokens_and_spans():
    first = _piece([7, 8], [-0.1, -0.2], "3")
    more = _piece([9], [-0.3], "4", finish="length")
    joined = continue_sample(first, more)
    assert joined.output_ids == [7, 8, 9] and joined.output_logprobs == [-0.1, -0.2, -0.3]
    assert joined.spans() == [("3", 0, 2), ("4", 2, 3)] and joined.mixed
    assert joined.partial_resubmits == 1 and joined.finish_reason == "length"
    assert join_spans([("3", 0, 2), ("3", 2, 5), ("4", 5, 5)]) == [("3", 0, 5)]


def test_mask_offpolicy_leaves_the_earlier_versions_of_a_partial_sample_out():
    partial = continue_sample(_piece([7, 8], [-0.1, -0.2], "3"),
                              _piece([9], [-0.3], "4", finish="length"))
    whole = _piece([5, 6], [-0.1, -0.2], "4", finish="length")
    assert train_masks([partial, whole], mask_offpolicy=False) is None
    assert train_masks([partial, whole], mask_offpolicy=True) == [[0, 0, 1], [1, 1]]
