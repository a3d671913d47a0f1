"""engine/backends/metrics.py on vLLM's and SGLang's documented formats (tests/fixtures name their source)."""

from __future__ import annotations

import json
import os

import pytest

from engine.backends.metrics import (MetricsError, parse_prometheus, sglang_request_counts, vllm_reading,
                                     vllm_request_counts)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def fixture(name: str) -> str:
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as file:
        return file.read()


def test_vllm_counts_of_one_request_are_the_difference_of_two_readings():
    counts = vllm_request_counts(fixture("vllm_metrics_before.txt"), fixture("vllm_metrics_after.txt"))
    assert (counts.drafted, counts.accepted, counts.drafts) == (60, 40, 20)
    assert counts.accepted_by_position == [17, 13, 10] and sum(counts.accepted_by_position) == counts.accepted
    assert counts.acceptance == 40 / 60 and not counts.approximate


def test_vllm_counts_are_approximate_when_other_requests_overlapped():
    counts = vllm_request_counts(fixture("vllm_metrics_before.txt"), fixture("vllm_metrics_after_overlapped.txt"))
    assert counts.approximate and counts.drafted == 90


def test_vllm_reading_skips_created_samples_and_sums_finish_reasons():
    reading = vllm_reading(fixture("vllm_metrics_before.txt"))
    assert reading["drafts"] == 120 and reading["finished"] == 10 and len(reading["per_position"]) == 3


def test_a_restarted_or_broken_metrics_endpoint_gives_a_one_line_error():
    with pytest.raises(MetricsError, match="restarted"):
        vllm_request_counts(fixture("vllm_metrics_after.txt"), fixture("vllm_metrics_before.txt"))
    with pytest.raises(MetricsError, match="line 1") as error:
        parse_prometheus("<html>502 Bad Gateway</html>\n")
    assert "\n" not in str(error.value)


def test_sglang_meta_info_counts_and_its_older_names():
    meta = json.loads(fixture("sglang_generate_meta_info.json"))["meta_info"]
    counts = sglang_request_counts(meta)
    assert (counts.drafted, counts.accepted, counts.drafts) == (48, 33, 16)
    assert counts.acceptance == pytest.approx(meta["spec_accept_rate"])
    assert meta["completion_tokens"] / counts.drafts == meta["spec_accept_length"]  # the bonus token counted
    older = {"spec_verify_ct": 16, "spec_draft_token_num": 48, "spec_accept_token_num": 33}
    assert sglang_request_counts(older).accepted == 33
    assert sglang_request_counts({"completion_tokens": 48}) is None  # no speculation: nothing to report
    with pytest.raises(MetricsError):
        sglang_request_counts({"spec_num_proposed_drafts": "many", "spec_num_correct_drafts": 3})
