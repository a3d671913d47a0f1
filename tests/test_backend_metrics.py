"""engine/backends/metrics.py on vLLM's and SGLang's documented formats (tests/fixtures name their source)."""

from __future__ import annotations

import json
import os

import pytest

from engine.backends.metrics import (MetricsError, parse_prometheus, sglang_request_counts, vllm_reading,
                                     vllm_request_counts, vllm_response_counts)

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


def test_vllm_per_request_metrics_give_exact_counts_by_position():
    spec = json.loads(fixture("vllm_chat_stream_spec_metrics.json"))["chunk"]["metrics"]["speculative_decoding"]
    counts = vllm_response_counts(spec)
    assert (counts.drafted, counts.accepted, counts.drafts, counts.approximate) == (129, 10, 43, False)
    assert counts.accepted_by_position == [4, 3, 3] and sum(counts.accepted_by_position) == counts.accepted
    assert counts.drafted_by_position == [43, 43, 43] and sum(counts.drafted_by_position) == counts.drafted
    assert 1 + counts.accepted / counts.drafts == spec["mean_acceptance_length"]
    with pytest.raises(MetricsError, match="documented format"):
        vllm_response_counts({"num_draft_tokens": 3})


def test_sglang_spec_tokens_details_by_position():
    details = json.loads(fixture("sglang_chat_stream_sglext.json"))["chunk"]["sglext"]["spec_tokens_details"]
    counts = sglang_request_counts(details)
    assert (counts.drafted, counts.accepted, counts.drafts) == (215, 63, 43)
    assert counts.accepted_by_position == [32, 18, 7, 3, 3] and sum(counts.accepted_by_position) == 63
    assert counts.drafted_by_position == [43] * 5  # 215 = 43 passes x 5 drafts
    tree = {**details, "spec_num_proposed_drafts": 300}  # not k per pass: by position unknown, not guessed
    assert sglang_request_counts(tree).drafted_by_position == []


def test_vllm_without_speculative_counters_did_not_draft():
    idle = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 0.0\n'
    assert vllm_request_counts(idle, idle) is None
    waiting = fixture("vllm_metrics_after.txt").replace('vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 0.0',
                                                         'vllm:num_requests_waiting{engine="0"} 1.0')
    assert vllm_request_counts(fixture("vllm_metrics_before.txt"), waiting).approximate  # another one queued
