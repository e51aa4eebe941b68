"""The discrete-event replay of a pipeline's order, against schedules worked out by hand."""

from __future__ import annotations

import math

import pytest

from cmpchat.bench.pipeline_schedule import HostLink, decode_seconds, grouped_decode_seconds, prefill_seconds

FREE = HostLink(bytes_per_second=math.inf, latency=0.0)


def test_one_stage_runs_its_chunks_back_to_back():
    timed = prefill_seconds([0.5], 6, 10**6, HostLink())
    assert timed.seconds == pytest.approx(3.0) and timed.busy == [pytest.approx(1.0)]


def test_equal_stages_with_free_links_fill_then_stream_one_chunk_a_stage_time():
    timed = prefill_seconds([1.0, 1.0, 1.0], 10, 5_000_000, FREE)
    assert timed.seconds == pytest.approx(12.0)  # 10 chunks + 2 ticks to fill the pipeline
    assert timed.busy == [pytest.approx(10 / 12)] * 3


def test_a_hop_costs_its_copies_once_on_the_way_in_and_overlaps_the_next_chunk():
    # Two stages of t, a hop of h each way (worked by hand in the order the backend issues them):
    # tick 0: s0 runs c0 (0 to t), its copy stream copies it out (t to t + h);
    # tick 1: s0 runs c1 (t to 2t) and copies it out (2t to 2t + h); the host waits for c0 (t + h), s1's copy
    #         stream copies it in (t + h to t + 2h), s1 runs c0 (t + 2h to 2t + 2h);
    # tick 2: the host waits for c1 (2t + h), s1 copies it in while it runs c0 (to 2t + 2h), then runs c1
    #         (2t + 2h to 3t + 2h).
    t, link = 1.0, HostLink(bytes_per_second=1e6, latency=0.0)
    h = link.seconds(100_000)
    assert prefill_seconds([t, t], 2, 100_000, link).seconds == pytest.approx(3 * t + 2 * h)


def test_copies_on_their_own_streams_let_every_card_run_a_step_a_chunk():
    # Three stages of t = 4h: arrivals and departures on their own streams overlap the steps, so the cards pace
    # at one step a chunk and each hop adds its two copies to the fill once. (At t = h the host, waiting for
    # each hop's bytes in turn, would set the pace instead: one thread queues every card's work.)
    link = HostLink(bytes_per_second=1e6, latency=0.0)
    h = link.seconds(1_000_000)
    t = 4 * h
    timed = prefill_seconds([t, t, t], 30, 1_000_000, link)
    assert timed.seconds == pytest.approx(30 * t + 2 * (t + 2 * h))
    assert prefill_seconds([h, h, h], 30, 1_000_000, link).seconds > 1.5 * 30 * h


def test_the_slowest_stage_sets_the_pace():
    timed = prefill_seconds([1.0, 3.0], 20, 0, FREE)
    assert timed.seconds == pytest.approx(1.0 + 20 * 3.0)
    assert timed.busy[1] > 0.98 and timed.busy[0] < 0.34


def test_27b_like_stages_on_cmp_links_gain_about_what_the_stages_allow():
    # Three stages of 0.3 s per 256-token chunk, 5.2 MB hidden states a hop at 250 MB/s: one card would take
    # 0.9 s a chunk; 18 chunks (4620 tokens) through three cards fill, then pace at one stage plus its copies.
    one_card = 18 * 0.9
    three = prefill_seconds([0.3, 0.3, 0.3], 18, 256 * 5120 * 4, HostLink()).seconds
    assert 2.3 < one_card / three < 3.0


def test_decode_goes_through_every_stage_and_back():
    link = HostLink(bytes_per_second=1e6, latency=1e-5)
    assert decode_seconds([0.01], 20_480, link) == pytest.approx(0.01)
    expected = 0.03 + 2 * 2 * link.seconds(20_480) + 2 * link.seconds(8)
    assert decode_seconds([0.01, 0.01, 0.01], 20_480, link) == pytest.approx(expected)


def test_one_decode_group_takes_a_round_trip_a_round():
    link = HostLink(bytes_per_second=1e6, latency=1e-4)
    stages = [1e-3, 2e-3, 1.5e-3]
    assert grouped_decode_seconds(stages, 1, 400, link) == pytest.approx(decode_seconds(stages, 400, link))


def test_groups_in_flight_keep_every_card_busy_until_the_busiest_sets_the_pace():
    free = FREE
    # Three equal stages: three groups fit in one round trip, a fourth makes every card the bottleneck.
    assert grouped_decode_seconds([1.0] * 3, 3, 0, free) == pytest.approx(3.0)
    assert grouped_decode_seconds([1.0] * 3, 4, 0, free) == pytest.approx(4.0)
    assert grouped_decode_seconds([1.0] * 3, 2, 0, free) == pytest.approx(3.0)  # a round trip, cards half idle
    # Uneven stages: the middle card runs 2 s for each of three groups.
    assert grouped_decode_seconds([1.0, 2.0, 1.0], 3, 0, free) == pytest.approx(6.0)


def test_groups_share_each_links_copies():
    link = HostLink(bytes_per_second=1.0, latency=0.0)  # a hop's copy takes as long as a stage's step
    # Two stages of 1 s and a 1 s copy each way: a round trip is 1 + 1 + 1 + 1 (+ the ids' free copies);
    # each link direction carries one copy a group, so two groups still fit in one round trip.
    assert grouped_decode_seconds([1.0, 1.0], 1, 1, link, ids_bytes=0) == pytest.approx(4.0)
    assert grouped_decode_seconds([1.0, 1.0], 2, 1, link, ids_bytes=0) == pytest.approx(4.0)
    assert grouped_decode_seconds([1.0, 1.0], 5, 1, link, ids_bytes=0) == pytest.approx(5.0)
